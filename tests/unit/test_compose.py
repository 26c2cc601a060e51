"""compose.yaml, compose.gpu.yaml and the Dockerfile, checked statically (no Docker engine
needed): the services and their order of start, health checks, Redis durability, the CPU
default and the GPU override's reservations, that every REIN_* name the deployment uses
is a real setting, and the hardening (no-new-privileges, capabilities, memory limits, Redis'
password, Grafana without anonymous access). tests/deploy runs them for real (make test-deploy)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rein.core.settings import Settings, refuse_placeholder_secrets

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
GPU_COMPOSE = ROOT / "compose.gpu.yaml"
DOCKERFILE = ROOT / "Dockerfile"
REIN_NAME = re.compile(r"\bREIN_[A-Z0-9_]+")
SETTINGS_NAMES = {f"REIN_{field.upper()}" for field in Settings.model_fields}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture(scope="module")
def gpu_services() -> dict:
    return yaml.safe_load(GPU_COMPOSE.read_text())["services"]


def command_text(service: dict) -> str:
    command = service.get("command", "")
    return " ".join(command) if isinstance(command, list) else str(command)


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def healthcheck_text(service: dict) -> str:
    test = service["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else test


def test_services_exist(services):
    assert {"postgres", "redis", "migrate", "api", "worker"} <= set(services)
    for name in ("postgres", "redis", "migrate", "api", "worker"):
        assert not services[name].get("profiles"), f"{name} must start with a plain `docker compose up`"


def test_health_checks(services):
    assert "pg_isready" in healthcheck_text(services["postgres"])
    assert "redis-cli" in healthcheck_text(services["redis"]) and "ping" in healthcheck_text(services["redis"])
    api_check = healthcheck_text(services["api"])
    assert "/healthz" in api_check and ":8000" in api_check
    assert "worker_health.py" in healthcheck_text(services["worker"])
    assert (ROOT / "deploy" / "worker_health.py").is_file()


def test_start_order(services):
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker"):
        deps = services[name]["depends_on"]
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        assert deps["migrate"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name
    # Every dependency names a service of the file.
    for name, service in services.items():
        for dep in service.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"


def test_commands(services):
    assert command_text(services["migrate"]).split()[0] == "migrate"
    api = command_text(services["api"]).split()
    assert api[0] == "api" and api[api.index("--host") + 1] == "0.0.0.0"
    assert any(p.split(":")[-1] == "8000" for p in services["api"]["ports"])
    assert command_text(services["worker"]).split()[:2] == ["worker", "--model"]


def test_redis_is_durable_and_never_evicts(services):
    command = command_text(services["redis"])
    assert re.search(r"--appendonly\s+yes", command)
    assert re.search(r"--maxmemory-policy\s+noeviction", command)


def test_rein_names_are_settings():
    used = set(REIN_NAME.findall(COMPOSE.read_text() + GPU_COMPOSE.read_text()))
    assert {"REIN_DATABASE_URL", "REIN_REDIS_URL", "REIN_MODELS"} <= used
    unknown = used - SETTINGS_NAMES
    assert not unknown, f"compose.yaml uses REIN_* names that are not settings: {sorted(unknown)}"


def test_rein_services_point_at_the_compose_servers(services):
    for name in ("migrate", "api", "worker"):
        env = environment(services[name])
        assert "@postgres:5432/" in env["REIN_DATABASE_URL"], name
        assert re.fullmatch(r"redis://:[^@]+@redis:6379/\d+", env["REIN_REDIS_URL"]), name
        assert "smollm2=/opt/rein/models/smollm2-135m-instruct.gguf" in env["REIN_MODELS"], name


def test_the_default_worker_runs_on_the_cpu(services):
    """A plain `docker compose up` works on a machine without a GPU: no reservation."""
    assert environment(services["worker"])["REIN_DEVICE"] == "cpu"
    assert "deploy" not in services["worker"]


def test_gpu_override_runs_one_worker_with_an_engine_per_gpu(gpu_services):
    assert [name for name in gpu_services if name.startswith("worker")] == ["worker"]
    service = gpu_services["worker"]
    assert environment(service)["REIN_DEVICE"] == "cuda"
    assert "REIN_GPU_MEMORY_UTILIZATION" in environment(service)
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and device["count"] == "all"
    command = service["command"]
    assert command[command.index("--devices") + 1] == "${WORKER_DEVICES:-all}"   # one engine per GPU it sees
    # a worker that cannot use its GPUs exits 2: a bounded restart, never a loop
    assert re.fullmatch(r"on-failure:\d+", service["restart"])
    for name in ("migrate", "api", "worker"):
        args = gpu_services[name]["build"]["args"]
        assert "/whl/cu128" in args["TORCH_INDEX_URL"] and "cuda" in args["EXTRAS"], name
        assert gpu_services[name]["image"] == gpu_services["worker"]["image"], name


def test_volumes_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    assert {"postgres-data", "redis-data", "models"} <= declared
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source")
            if not source.startswith((".", "/")):
                assert source in declared, f"{name} mounts undeclared volume {source}"
    assert any(v.startswith("postgres-data:") for v in services["postgres"]["volumes"])
    assert any(v.startswith("redis-data:") for v in services["redis"]["volumes"])


def test_dockerfile():
    text = DOCKERFILE.read_text()
    instructions = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    copies = [line for line in instructions if line.upper().startswith("COPY ")]
    assert any(re.match(r"COPY\s+migrations/?\s", line) for line in copies), copies
    assert any(re.match(r"COPY\s+rein/?\s", line) for line in copies), copies
    # the project itself, with the GGUF extra: pip install . / '.[gguf]'
    assert any(re.match(r"RUN\s+pip install(\s+\S+)*\s+'?\.(\[gguf\])?'?$", line) for line in instructions)
    assert re.search(r"^FROM\s+\S*python:3\.11-slim|^ARG BASE_IMAGE=python:3\.11-slim", text, re.M)
    assert re.search(r"^USER\s+(?!root\b|0\b)\S+", text, re.M), "the image must run as a non-root user"
    assert re.search(r'^ENTRYPOINT\s+\["rein"\]\s*$', text, re.M)


def test_dockerignore_keeps_the_context_small():
    ignored = {line.strip().rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", ".cache", "demo", ".git", "tests"} <= ignored
    assert "migrations" not in ignored and "rein" not in ignored


# -- the monitoring profile ------------------------------------------------------------------

PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "rein.json"
METRIC_NAME = re.compile(r"\brein:[a-z0-9_]+")


def test_monitoring_profile_services(services):
    for name in ("prometheus", "grafana"):
        assert services[name].get("profiles") == ["monitoring"], name
    assert "prometheus" in services["grafana"]["depends_on"]
    assert any(p.split(":")[-1] == "9090" for p in services["prometheus"]["ports"])
    assert any(p.split(":")[-1] == "3000" for p in services["grafana"]["ports"])


def test_monitoring_mounts_files_of_the_repo(services):
    mounted = {}
    for name in ("prometheus", "grafana"):
        for volume in services[name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repo"
                mounted[target] = ROOT / source
    config = next(v for v in services["prometheus"]["command"] if v.startswith("--config.file="))
    assert mounted[config.split("=", 1)[1]] == PROMETHEUS
    provisioning = mounted["/etc/grafana/provisioning"]
    assert (provisioning / "datasources" / "prometheus.yml").exists()
    providers = yaml.safe_load((provisioning / "dashboards" / "rein.yml").read_text())["providers"]
    assert mounted[providers[0]["options"]["path"]] == DASHBOARD.parent
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["uid"] == "prometheus"


def test_prometheus_scrapes_the_ports_the_services_serve(services):
    jobs = {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]}
    api_command = command_text(services["api"]).split()
    api_port = api_command[api_command.index("--port") + 1]
    assert jobs["rein-api"]["static_configs"][0]["targets"] == [f"api:{api_port}"]
    assert jobs["rein-api"].get("metrics_path", "/metrics") == "/metrics"
    # The API's /metrics needs an admin key: Prometheus reads it from the mounted secrets folder.
    credentials = jobs["rein-api"]["authorization"]["credentials_file"]
    mounts = [v.split(":") for v in services["prometheus"]["volumes"]]
    assert any(credentials.startswith(target + "/") and (ROOT / source).is_dir() for source, target, *_ in mounts)
    # A worker with several engines (--devices) serves engine N's metrics on its port + N.
    workers = jobs["rein-worker"]["dns_sd_configs"]
    assert {name for config in workers for name in config["names"]} == {"worker"}
    port = Settings(worker_metrics_port=environment(services["worker"])["REIN_WORKER_METRICS_PORT"]).worker_metrics_port
    assert [config["port"] for config in workers] == [port + n for n in range(len(workers))]


def test_dashboard_shows_every_metric_and_only_real_ones():
    from rein.api.metrics import APIMetrics
    from rein.worker.metrics import WorkerMetrics

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    families = {family.name: family.type for metrics in (WorkerMetrics("m"), APIMetrics(Settings()))
                for family in metrics.registry.collect()}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = set(METRIC_NAME.findall(exprs))
    exposed = {name + suffix for name, kind in families.items() for suffix in suffixes[kind]}
    assert used <= exposed, f"the dashboard queries metrics nobody exposes: {sorted(used - exposed)}"
    shown = {name for name, kind in families.items() if any(name + s in used for s in suffixes[kind])}
    assert shown == set(families), f"metrics without a panel: {sorted(set(families) - shown)}"
    assert all(p.get("datasource", {}).get("uid", "prometheus") == "prometheus" for p in dashboard["panels"])


# -- the hardening ---------------------------------------------------------------------------

VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")
# The capabilities a service may add back after dropping all: the official postgres and redis
# images start as root to own their data folder, then drop to their user with gosu.
CAPABILITIES = {"postgres": {"CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID"},
                "redis": {"CHOWN", "SETGID", "SETUID"}}
# What each service needs at least: tests/deploy's docker stats after its batch read the worker
# 1.7 GiB, the API 0.34 GiB, Postgres 54 MiB, Redis 5 MiB (SmolLM2 on the CPU).
MIN_MEMORY = {"worker": 4 * 1024**3, "api": 2 * 1024**3, "redis": 512 * 1024**2, "postgres": 512 * 1024**2}


def resolve(text: str, env: dict[str, str] | None = None) -> str:
    """compose's interpolation of ${VAR:-default} (and ${VAR}), with `env` as the environment."""
    env = env or {}
    return VARIABLE.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), text)


def memory_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([bkmg]?)", text.lower()).groups()
    return int(number) * 1024 ** "bkmg".index(unit or "b")


def test_every_service_is_hardened(services):
    for name, service in services.items():
        assert "no-new-privileges:true" in service.get("security_opt", []), f"{name}: no no-new-privileges"
        assert service.get("cap_drop") == ["ALL"], f"{name}: capabilities not dropped"
        assert set(service.get("cap_add", [])) <= CAPABILITIES.get(name, set()), f"{name}: {service['cap_add']}"
        assert not service.get("privileged"), name
        assert "mem_limit" in service, f"{name}: no memory limit"
        limit = memory_bytes(resolve(str(service["mem_limit"])))
        assert limit >= MIN_MEMORY.get(name, 256 * 1024**2), f"{name}: {service['mem_limit']}"


def test_the_gpu_override_keeps_the_hardening(gpu_services):
    for name, service in gpu_services.items():
        assert not {"cap_add", "cap_drop", "security_opt", "privileged"} & set(service), name
    assert memory_bytes(resolve(str(gpu_services["worker"]["mem_limit"]))) >= 16 * 1024**3


def test_redis_requires_the_password_every_client_has(services):
    command = services["redis"]["command"]
    password = command[command.index("--requirepass") + 1]
    assert VARIABLE.fullmatch(password), "the password comes from the environment (REDIS_PASSWORD)"
    for name, service in services.items():
        url = environment(service).get("REIN_REDIS_URL")
        if url is not None:
            assert url.startswith(f"redis://:{password}@"), name
    # The health check asks with the password (redis-cli reads REDISCLI_AUTH) and wants PONG:
    # a NOAUTH answer is not healthy.
    assert environment(services["redis"])["REDISCLI_AUTH"] == password
    assert "grep -q PONG" in healthcheck_text(services["redis"])
    # Full, Redis refuses writes (noeviction) before the container's limit kills it.
    maxmemory = memory_bytes(resolve(command[command.index("--maxmemory") + 1]).removesuffix("b"))
    assert maxmemory < memory_bytes(resolve(str(services["redis"]["mem_limit"])))


def test_the_default_passwords_are_warned_about_and_placeholders_refused(services):
    """The defaults (`rein`, tolerable on a network nothing else reaches) start, with a warning
    in migrate's log; a placeholder from the deployment files would stop migrate and the API."""
    entrypoint = " ".join(services["migrate"]["entrypoint"])
    assert "WARNING: POSTGRES_PASSWORD is the default" in entrypoint
    assert "WARNING: REDIS_PASSWORD is the default" in entrypoint
    env = environment(services["api"])
    refuse_placeholder_secrets(Settings(database_url=resolve(env["REIN_DATABASE_URL"]),
                                        redis_url=resolve(env["REIN_REDIS_URL"])))
    placeholders = {"POSTGRES_PASSWORD": "CHANGE-ME", "REDIS_PASSWORD": "changeme"}
    with pytest.raises(ValueError, match="REIN_DATABASE_URL.*\\n.*REIN_REDIS_URL"):
        refuse_placeholder_secrets(Settings(database_url=resolve(env["REIN_DATABASE_URL"], placeholders),
                                            redis_url=resolve(env["REIN_REDIS_URL"], placeholders)))


def test_grafana_has_no_anonymous_access_and_no_default_password(services):
    env = environment(services["grafana"])
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    # The admin password comes from GRAFANA_ADMIN_PASSWORD, with no default; the entrypoint
    # refuses an empty one before Grafana would fall back to `admin`.
    assert VARIABLE.fullmatch(env["GF_SECURITY_ADMIN_PASSWORD"]).groups() in (("GRAFANA_ADMIN_PASSWORD", ""),
                                                                             ("GRAFANA_ADMIN_PASSWORD", None))
    entrypoint = " ".join(services["grafana"]["entrypoint"])
    assert '-z "$$GF_SECURITY_ADMIN_PASSWORD"' in entrypoint and "exit 1" in entrypoint
