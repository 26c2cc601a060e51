"""deploy/k8s: every manifest validates against the Kubernetes and KEDA schemas, and what the
manifests say about rein (queue keys, settings, the worker the ScaledObject scales) is what
rein's own code says, so a rename in rein breaks this test rather than the autoscaling.

Kubernetes objects: kubernetes-validate's bundled JSON schemas (offline), strict (an unknown
field is an error, as `kubectl apply --validate=strict` makes it). KEDA's ScaledObject and
TriggerAuthentication: the openAPIV3Schema of KEDA's CRDs (tests/unit/schemas/, whose
`$comment` names the release), made strict the same way, with jsonschema. Where `kubectl` is
installed, `kubectl kustomize` builds both variants (base, prometheus) and what it renders is
checked the same way.

The hardening (deploy/k8s/README.md, "What the manifests enforce"): every pod and container's
security settings, the writable volumes a read-only root filesystem needs (where the image
writes, read from the Dockerfile), and the NetworkPolicies, evaluated as Kubernetes would for
each flow rein needs and for ones it must not allow. Redis over TLS with the certificate
verified, the same for KEDA.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import shutil
import ssl
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kombu.transport.redis import Channel

from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.core.settings import Settings, load_settings
from rein.jobs.queues import broker_ssl, priority_lists, queued_slots

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s" / "base"
OVERLAY = K8S.parent / "prometheus"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The oldest Kubernetes release still supported upstream when this was written, and the
# newest kubernetes-validate bundles: the manifests use nothing newer than the first.
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.latest_version())
KEDA_KINDS = ("ScaledObject", "TriggerAuthentication")
# The trigger metadata KEDA's scalers read (pkg/scalers/redis_scaler.go and prometheus_scaler.go,
# v2.20.2): the CRD types it as a map of strings, so a misspelt key would pass the schema.
SCALER_METADATA = {
    "redis": {"address", "host", "port", "listName", "listLength", "activationListLength", "databaseIndex",
              "enableTLS", "unsafeSsl", "addressFromEnv", "hostFromEnv", "portFromEnv", "usernameFromEnv",
              "passwordFromEnv"},
    "prometheus": {"serverAddress", "query", "threshold", "activationThreshold", "namespace", "ignoreNullValues",
                   "unsafeSsl", "timeout", "queryParameters", "customHeaders"},
}
REQUIRED_METADATA = {"redis": {"listName"}, "prometheus": {"serverAddress", "query", "threshold"}}


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.yaml") if p.name != "kustomization.yaml")


MANIFESTS = {path.name: load_documents(path) for path in manifest_files(K8S)}
DOCUMENTS = [doc for docs in MANIFESTS.values() for doc in docs]


def strict(schema: object) -> object:
    """The schema with `additionalProperties: false` on every object that lists its properties
    and says nothing of others (the API server prunes or refuses unknown fields of a CRD)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def keda_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((SCHEMAS / f"keda-{kind.lower()}-v1alpha1.json").read_text())
    return jsonschema.Draft7Validator(strict(schema))


def validate(doc: dict) -> None:
    if doc["apiVersion"] == "keda.sh/v1alpha1":
        assert doc["kind"] in KEDA_KINDS, f"no KEDA schema vendored for {doc['kind']}"
        keda_validator(doc["kind"]).validate(doc)
        if doc["kind"] == "ScaledObject":
            spec = doc["spec"]   # the CRD's CEL rule, which jsonschema cannot run
            assert spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch: how kustomize applies a patch to a custom resource, whose
    lists it cannot merge by key (a list is replaced whole, null removes a field)."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def find(kind: str, name: str | None = None, docs: list[dict] = DOCUMENTS) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def the(kind: str, name: str | None = None) -> dict:
    (doc,) = find(kind, name)
    return doc


def pod_spec(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def container_env(container: dict) -> dict[str, str]:
    """The environment a container gets: its ConfigMaps' and Secrets' keys, then its own env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(the("ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(the("Secret", source["secretRef"]["name"])["stringData"])
    env.update({item["name"]: item["value"] for item in container.get("env", []) if "value" in item})
    return env


def rein_containers() -> list[tuple[dict, dict]]:
    return [(doc, container) for doc in DOCUMENTS if doc["kind"] in ("Deployment", "Job")
            for container in pod_spec(doc)["containers"]]


def every_container(doc: dict) -> list[dict]:
    """A workload's containers, its init containers included."""
    return [*pod_spec(doc).get("initContainers", []), *pod_spec(doc)["containers"]]


WORKLOADS = [doc for doc in DOCUMENTS if doc["kind"] in ("Deployment", "Job")]


def settings_of(container: dict, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """rein's settings as this container would read them (load_settings parses every value)."""
    for name, value in container_env(container).items():
        monkeypatch.setenv(name, value)
    return load_settings()


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("REIN_"):
            monkeypatch.delenv(name)
    return monkeypatch


def worker_model(deployment: dict) -> str:
    (container,) = pod_spec(deployment)["containers"]
    args = container["args"]
    assert args[0] == "worker" and "--model" in args, args
    return args[args.index("--model") + 1]


# -- schemas ------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_validates(doc: dict) -> None:
    validate(doc)


def test_the_validators_refuse_unknown_and_mistyped_fields() -> None:
    deployment = copy.deepcopy(the("Deployment", "rein-api"))
    deployment["spec"]["replica"] = 2     # a typo of replicas
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    scaled = copy.deepcopy(the("ScaledObject"))
    scaled["spec"]["triggers"][0]["metdata"] = scaled["spec"]["triggers"][0].pop("metadata")
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    scaled = copy.deepcopy(the("ScaledObject"))
    scaled["spec"]["maxReplicaCount"] = "8"
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)


def test_the_prometheus_overlay_validates_once_applied() -> None:
    (kustomization,) = load_documents(OVERLAY / "kustomization.yaml")
    assert kustomization["resources"] == ["../base"]
    for entry in kustomization["patches"]:
        (patch,) = load_documents(OVERLAY / entry["path"])
        (base,) = find(patch["kind"], patch["metadata"]["name"])
        patched = merge_patch(base, patch)
        validate(patched)
        check_triggers(patched)


# -- the kustomization -----------------------------------------------------------------------------


def test_the_kustomization_lists_every_manifest_and_names_every_image() -> None:
    (kustomization,) = load_documents(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(MANIFESTS)
    images = {image["name"] for image in kustomization["images"]}
    used = {container["image"] for doc in WORKLOADS for container in every_container(doc)}
    assert used == images, "every rein container's image is one the kustomization sets, and no other"


# -- what the manifests say about rein ------------------------------------------------------------


def check_triggers(scaled: dict) -> None:
    names = [trigger["name"] for trigger in scaled["spec"]["triggers"]]
    formula = scaled["spec"]["advanced"]["scalingModifiers"]["formula"]
    assert sorted(formula.replace("+", " ").split()) == sorted(names), (formula, names)
    for trigger in scaled["spec"]["triggers"]:
        metadata = trigger["metadata"]
        assert set(metadata) <= SCALER_METADATA[trigger["type"]], trigger
        assert REQUIRED_METADATA[trigger["type"]] <= set(metadata), trigger


def test_the_scaled_object_scales_the_worker_on_its_models_queues(clean_env: pytest.MonkeyPatch) -> None:
    scaled = the("ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert target.get("kind", "Deployment") == "Deployment"
    deployment = the("Deployment", target["name"])
    model = worker_model(deployment)
    (container,) = pod_spec(deployment)["containers"]
    settings = settings_of(container, clean_env)
    assert settings.served_model(model) is not None, f"the worker's model {model!r} is not in REIN_MODELS"

    check_triggers(scaled)
    lists = {trigger["name"]: trigger["metadata"]["listName"] for trigger in scaled["spec"]["triggers"]}
    # What rein's broker writes: kombu's list per priority step of each queue (the batch queue's
    # shards each), and its hash of taken, unacknowledged messages, all under the prefix
    # (kombu's global_keyprefix).
    (interactive,) = priority_lists(settings, model, PRIORITY_INTERACTIVE)
    batch = {f"batch{shard}": key for shard, key in enumerate(priority_lists(settings, model, PRIORITY_BATCH))}
    assert lists == {"interactive": interactive, **batch,
                     "in_flight": settings.redis_key_prefix + Channel.unacked_key}
    # Replicas follow the sum of them all.
    terms = scaled["spec"]["advanced"]["scalingModifiers"]["formula"].split(" + ")
    assert sorted(terms) == sorted(lists)
    database = int(urlparse(settings.redis_url).path.lstrip("/") or 0)
    assert {t["metadata"]["databaseIndex"] for t in scaled["spec"]["triggers"]} == {str(database)}

    # The target per worker is what one worker holds, as rein computes it from its settings.
    per_worker = settings.max_num_seqs + queued_slots(settings)
    assert scaled["spec"]["advanced"]["scalingModifiers"]["target"] == str(per_worker)
    assert {t["metadata"]["listLength"] for t in scaled["spec"]["triggers"]} == {str(per_worker)}

    authentication = the("TriggerAuthentication", scaled["spec"]["triggers"][0]["authenticationRef"]["name"])
    for ref in authentication["spec"]["secretTargetRef"]:
        assert ref["key"] in the("Secret", ref["name"])["stringData"]


def test_the_prometheus_queries_name_the_workers_model(clean_env: pytest.MonkeyPatch) -> None:
    (patch,) = load_documents(OVERLAY / "scaledobject-triggers.yaml")
    model = worker_model(the("Deployment", the("ScaledObject")["spec"]["scaleTargetRef"]["name"]))
    queries = [trigger["metadata"]["query"] for trigger in patch["spec"]["triggers"]]
    assert all(f'model_name="{model}"' in query for query in queries)
    assert any("rein:queue_depth" in query for query in queries)


# The variables every S3 tool reads, boto3 included (rein.store.s3): the API's object storage.
S3_VARIABLES = {"AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


def test_every_rein_variable_is_a_setting_and_parses(clean_env: pytest.MonkeyPatch) -> None:
    known = {f"REIN_{name.upper()}" for name in Settings.model_fields} | S3_VARIABLES
    for doc, container in rein_containers():
        env = container_env(container)
        unknown = sorted(set(env) - known)
        assert not unknown, f"{doc['metadata']['name']}: not rein settings: {unknown}"
        with clean_env.context() as patch:
            settings_of(container, patch)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize) is not installed")
@pytest.mark.parametrize("variant", [K8S, OVERLAY], ids=lambda path: path.name)
def test_kustomize_builds_each_variant(variant: Path) -> None:
    built = subprocess.run(["kubectl", "kustomize", str(variant)], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    docs = [doc for doc in yaml.safe_load_all(built.stdout) if doc]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in DOCUMENTS)
    (kustomization,) = load_documents(K8S / "kustomization.yaml")
    images = {f"{image['newName']}:{image['newTag']}" for image in kustomization["images"]}
    for doc in docs:
        validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == kustomization["namespace"]
        if doc["kind"] in ("Deployment", "Job"):
            assert {c["image"] for c in every_container(doc)} <= images
            check_hardened(doc)
    (scaled,) = find("ScaledObject", docs=docs)
    check_triggers(scaled)


# -- the hardening: pods and containers -------------------------------------------------------------


def check_hardened(doc: dict) -> None:
    """No service account token; non-root, RuntimeDefault seccomp; in every container (init
    containers too) no privilege escalation, no capability, a read-only root filesystem."""
    name, spec = doc["metadata"]["name"], pod_spec(doc)
    assert spec.get("automountServiceAccountToken") is False, f"{name}: the pod gets a Kubernetes API token"
    pod = spec.get("securityContext", {})
    assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, name
    for container in every_container(doc):
        where = f"{name}/{container['name']}"
        context = container.get("securityContext", {})
        seccomp = context.get("seccompProfile", pod.get("seccompProfile", {}))
        assert seccomp.get("type") == "RuntimeDefault", f"{where}: seccomp {seccomp}"
        assert context.get("runAsNonRoot", True) is True and context.get("runAsUser", 1) != 0, where
        assert context.get("allowPrivilegeEscalation") is False, f"{where}: privilege escalation allowed"
        assert context.get("privileged", False) is False, where
        assert context.get("readOnlyRootFilesystem") is True, f"{where}: writable root filesystem"
        capabilities = context.get("capabilities", {})
        assert capabilities.get("drop") == ["ALL"] and not capabilities.get("add"), f"{where}: {capabilities}"


@pytest.mark.parametrize("doc", WORKLOADS, ids=lambda d: d["metadata"]["name"])
def test_every_workload_is_hardened(doc: dict) -> None:
    check_hardened(doc)


@pytest.mark.parametrize("field, value", [
    (("automountServiceAccountToken",), None), (("securityContext", "seccompProfile"), None),
    (("containers", 0, "securityContext", "allowPrivilegeEscalation"), None),
    (("containers", 0, "securityContext", "readOnlyRootFilesystem"), False),
    (("containers", 0, "securityContext", "capabilities", "drop"), ["NET_RAW"]),
    (("containers", 0, "securityContext", "capabilities", "add"), ["SYS_ADMIN"]),
    (("initContainers", 0, "securityContext"), None),
])
def test_the_hardening_check_refuses_a_weakened_pod(field: tuple, value: object) -> None:
    deployment = copy.deepcopy(the("Deployment", "rein-api"))
    *path, last = field
    target = pod_spec(deployment)
    for key in path:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    with pytest.raises(AssertionError):
        check_hardened(deployment)


def image_writes() -> dict[str, str]:
    """Where rein's image writes at run time: its HOME and the caches its ENV names (the
    final stage's)."""
    text = (ROOT / "Dockerfile").read_text()
    final = text[text.rindex("\nFROM "):].replace("\\\n", " ")
    env = dict(re.findall(r"\b(REIN_CACHE_DIR|HF_HOME)=(\S+)", final))
    (user,) = re.findall(r"useradd --create-home --uid \d+ (\w+)", final)
    return {"HOME": f"/home/{user}", **env, "temporary files": "/tmp"}


def writable_mounts(doc: dict, container: dict) -> dict[str, dict]:
    volumes = {volume["name"]: volume for volume in pod_spec(doc).get("volumes", [])}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        assert mount["name"] in volumes, f"{container['name']} mounts undeclared volume {mount['name']}"
        if not mount.get("readOnly"):
            mounts[mount["mountPath"]] = volumes[mount["name"]]
    return mounts


def covered(path: str, mounts: dict[str, dict]) -> dict | None:
    return next((volume for mount, volume in mounts.items() if path == mount or path.startswith(mount + "/")), None)


@pytest.mark.parametrize("doc", WORKLOADS, ids=lambda d: d["metadata"]["name"])
def test_a_read_only_root_leaves_writable_what_rein_writes(doc: dict) -> None:
    """/tmp everywhere; the API and the workers also their caches and HOME (Triton's compiled
    kernels), in volumes; the API's batch files go to object storage, no shared claim."""
    component = doc["metadata"]["labels"]["app.kubernetes.io/component"]
    container = pod_spec(doc)["containers"][0]
    mounts = writable_mounts(doc, container)
    needed = image_writes() if component in ("api", "worker") else {"temporary files": "/tmp"}
    for what, path in needed.items():
        volume = covered(path, mounts)
        assert volume is not None, f"{doc['metadata']['name']}: {what} ({path}) is on the read-only root"
        assert "emptyDir" in volume, volume
    assert not any("persistentVolumeClaim" in volume for volume in pod_spec(doc).get("volumes", [])), \
        "no claim: batch files are in object storage (REIN_FILES_URL)"


@pytest.mark.parametrize("doc", [d for d in WORKLOADS if pod_spec(d).get("initContainers")],
                         ids=lambda d: d["metadata"]["name"])
def test_the_cache_volume_starts_with_the_images_caches(doc: dict) -> None:
    """An emptyDir over /models would hide what the build read into it: an init container
    copies the image's /models into the volume first."""
    (init,) = pod_spec(doc)["initContainers"]
    main = pod_spec(doc)["containers"][0]
    assert init["image"] == main["image"]
    command = init["command"]
    assert command[0] == "cp" and "-R" in command and "-a" not in command   # -a fails on the volume's root
    source, target = command[-2:]
    (seed,) = [m for m in init["volumeMounts"] if target.rstrip("/") == m["mountPath"]]
    (cache,) = [m for m in main["volumeMounts"] if m["name"] == seed["name"]]
    assert source.rstrip("./") == cache["mountPath"] == str(Path(image_writes()["REIN_CACHE_DIR"]).parent)


# -- the hardening: network policies ----------------------------------------------------------------

POLICIES = find("NetworkPolicy")
NAMESPACE = "rein"
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
KUBE_DNS = ({"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"})
INTERNET = "203.0.113.7"   # any address outside the cluster but the managed services'


def selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector; {} selects everything."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        value, operator = labels.get(expression["key"]), expression["operator"]
        if operator == "In" and value not in expression["values"]:
            return False
        if operator == "NotIn" and value in expression["values"]:
            return False
        if operator == "Exists" and expression["key"] not in labels:
            return False
        if operator == "DoesNotExist" and expression["key"] in labels:
            return False
    return True


def peer_matches(peer: dict, other: dict) -> bool:
    """One `from`/`to` entry against the other end: a pod {namespace, labels, ip} or an address
    outside the cluster {ip}."""
    if "ipBlock" in peer:
        if "labels" in other:   # pods are addressed by selectors (an ipBlock holds no pod IPs here)
            return False
        network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
        address = ipaddress.ip_address(other["ip"])
        return address in network and not any(address in ipaddress.ip_network(c)
                                               for c in peer["ipBlock"].get("except", []))
    if "labels" not in other:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other["namespace_labels"]):
            return False
    elif other["namespace_labels"].get("kubernetes.io/metadata.name") != NAMESPACE:
        return False
    return selects(peer.get("podSelector", {}), other["labels"])


def port_matches(rule: dict, port: int, protocol: str) -> bool:
    if "ports" not in rule:
        return True
    for entry in rule["ports"]:
        assert isinstance(entry.get("port"), int), f"a numbered port, so this test can check it: {entry}"
        if entry.get("protocol", "TCP") == protocol and entry["port"] <= port <= entry.get("endPort", entry["port"]):
            return True
    return False


def allowed(direction: str, pod: dict, other: dict, port: int, protocol: str = "TCP",
            policies: list[dict] | None = None) -> bool:
    """Whether `pod` (in the rein namespace) may receive from (Ingress) or send to (Egress)
    `other` on this port: allowed when no policy selecting it covers the direction, or some
    rule of such a policy matches (NetworkPolicy's union of allows)."""
    key = direction.lower()
    policies = [p for p in (POLICIES if policies is None else policies) if selects(p["spec"]["podSelector"], pod["labels"])
                and direction in p["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    peers = "from" if direction == "Ingress" else "to"
    return any(port_matches(rule, port, protocol) and (peers not in rule or any(peer_matches(peer, other)
                                                                                  for peer in rule[peers]))
               for policy in policies for rule in policy["spec"].get(key, []))


def pod(namespace: str = NAMESPACE, **labels: str) -> dict:
    return {"namespace_labels": {"kubernetes.io/metadata.name": namespace}, "labels": labels, "ip": "10.1.2.3"}


def rein_pod(component: str) -> dict:
    (doc,) = [d for d in WORKLOADS if d["metadata"]["labels"]["app.kubernetes.io/component"] == component][:1]
    return pod(**doc["spec"]["template"]["metadata"]["labels"])


def managed(url: str) -> tuple[dict, int]:
    """The managed server a URL names, as the policies know it (the address of the ipBlock that
    stands for it) and its port."""
    parsed = urlparse(url)
    blocks = [peer["ipBlock"]["cidr"] for p in POLICIES for rule in p["spec"].get("egress", [])
              for peer in rule.get("to", []) if "ipBlock" in peer
              and any(entry["port"] == parsed.port for entry in rule.get("ports", []))]
    assert len(blocks) == 1, f"one ipBlock for {parsed.hostname}:{parsed.port}: {blocks}"
    return {"ip": str(ipaddress.ip_network(blocks[0])[0])}, parsed.port


@pytest.fixture()
def servers(clean_env: pytest.MonkeyPatch) -> dict[str, tuple[dict, int]]:
    (container,) = pod_spec(the("Deployment", "rein-api"))["containers"]
    settings = settings_of(container, clean_env)
    return {"postgres": managed(settings.database_url.replace("+psycopg", "")), "redis": managed(settings.redis_url)}


def test_everything_is_denied_unless_allowed() -> None:
    (deny,) = [p for p in POLICIES if p["spec"]["podSelector"] == {}]
    assert sorted(deny["spec"]["policyTypes"]) == ["Egress", "Ingress"]
    assert not deny["spec"].get("ingress") and not deny["spec"].get("egress")


def test_only_the_api_port_takes_clients() -> None:
    api, worker, migrate = rein_pod("api"), rein_pod("worker"), rein_pod("migrate")
    (container,) = pod_spec(the("Deployment", "rein-api"))["containers"]
    port = int(container_env(container)["REIN_API_PORT"])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    for client in ({"ip": INTERNET}, pod("shop"), pod(**{"app": "ingress-nginx"})):
        assert allowed("Ingress", api, client, port)
        assert not allowed("Ingress", api, client, 9100)
        assert not allowed("Ingress", worker, client, 9100) and not allowed("Ingress", worker, client, port)
        assert not allowed("Ingress", migrate, client, port)


def test_the_workers_metrics_port_takes_prometheus_only() -> None:
    worker = rein_pod("worker")
    (container,) = pod_spec(the("Deployment", "rein-worker-smollm2"))["containers"]
    port = int(container_env(container)["REIN_WORKER_METRICS_PORT"])
    assert [p["containerPort"] for p in container["ports"]] == [port]
    prometheus = pod("monitoring", **PROMETHEUS)
    assert allowed("Ingress", worker, prometheus, port)
    for other in (pod("monitoring", app="grafana"), pod("shop", **PROMETHEUS), rein_pod("api"), rein_pod("worker"),
                  {"ip": INTERNET}):
        assert not allowed("Ingress", worker, other, port), other
    # Nothing else of a worker is reachable, Prometheus included: not gloo's or NCCL's ports
    # (tensor parallelism stays inside the pod), not the API's.
    for other_port in (8000, 29500, 6379):
        assert not allowed("Ingress", worker, prometheus, other_port)
        assert not allowed("Ingress", worker, rein_pod("worker"), other_port)


def test_each_component_reaches_only_its_servers(servers: dict[str, tuple[dict, int]]) -> None:
    (postgres, postgres_port), (redis, redis_port) = servers["postgres"], servers["redis"]
    needs = {"api": {"postgres", "redis"}, "worker": {"postgres", "redis"}, "migrate": {"postgres"}}
    for component, wanted in needs.items():
        source = rein_pod(component)
        assert allowed("Egress", source, postgres, postgres_port) == ("postgres" in wanted), component
        assert allowed("Egress", source, redis, redis_port) == ("redis" in wanted), component
        assert allowed("Egress", source, pod(KUBE_DNS[0]["kubernetes.io/metadata.name"], **KUBE_DNS[1]), 53, "UDP")
        # Not the managed servers' other ports, not the internet, not another pod of rein's.
        assert not allowed("Egress", source, postgres, 22) and not allowed("Egress", source, redis, postgres_port)
        for port in (443, 80, postgres_port, redis_port):
            assert not allowed("Egress", source, {"ip": INTERNET}, port), (component, port)
        assert not allowed("Egress", source, rein_pod("worker"), 9100)
        assert not allowed("Egress", source, rein_pod("api"), 8000)
        assert not allowed("Egress", source, pod("kube-system", component="apiserver"), 443)


def test_the_api_keeps_its_files_in_object_storage_the_workers_read(clean_env: pytest.MonkeyPatch) -> None:
    """Batch files in S3-compatible object storage (REIN_FILES_URL), read by boto3 from the
    standard AWS_* variables, so API replicas on any nodes share them; no ReadWriteMany claim.
    The API reaches the endpoint on 443, and the workers (they read the images the API stored
    for vision jobs, from the same bucket and prefix); migrations do not."""
    from rein.core import s3_client as clients
    from rein.store.filestore import filestore_for
    from rein.store.s3 import S3FileStore

    assert not find("PersistentVolumeClaim")
    (container,) = pod_spec(the("Deployment", "rein-api"))["containers"]
    env = container_env(container)
    assert S3_VARIABLES <= set(env)
    clean_env.setattr(clients, "_clients", {})     # this test's client, from the manifest's variables
    settings = settings_of(container, clean_env)
    assert settings.files_url.startswith("s3://")
    store = filestore_for(settings)     # builds a client from the variables, sends nothing
    assert isinstance(store, S3FileStore) and store.bucket and store.prefix
    endpoint = urlparse(env["AWS_ENDPOINT_URL"])
    assert endpoint.scheme == "https"
    storage, port = managed(f"https://{endpoint.hostname}:{endpoint.port or 443}")
    for component in ("api", "worker"):
        assert allowed("Egress", rein_pod(component), storage, port), component
        assert not allowed("Egress", rein_pod(component), storage, 80), component
    assert not allowed("Egress", rein_pod("migrate"), storage, port)
    for doc, other in rein_containers():
        name = doc["metadata"]["name"]
        if name == "rein-api":
            continue
        other_env = container_env(other)
        if "worker" in name:     # the API's files, where the API keeps them
            assert {k: other_env.get(k) for k in ("REIN_FILES_URL", "AWS_ENDPOINT_URL", "AWS_REGION")} == \
                {k: env[k] for k in ("REIN_FILES_URL", "AWS_ENDPOINT_URL", "AWS_REGION")}, name
        else:                    # migrations touch no files
            assert "REIN_FILES_URL" not in other_env and "REIN_FILES_DIR" not in other_env, name


def test_the_policy_evaluator_sees_a_missing_policy() -> None:
    """The checks above can fail: without the default deny, a pod no other policy selects for a
    direction (migrate's ingress) is open to all; without the metrics policy, Prometheus is shut
    out of the workers."""
    without_deny = [p for p in POLICIES if p["spec"]["podSelector"] != {}]
    assert allowed("Ingress", rein_pod("migrate"), {"ip": INTERNET}, 8000, policies=without_deny)
    assert not allowed("Ingress", rein_pod("migrate"), {"ip": INTERNET}, 8000)
    without_metrics = [p for p in POLICIES if p["metadata"]["name"] != "rein-worker-metrics"]
    assert not allowed("Ingress", rein_pod("worker"), pod("monitoring", **PROMETHEUS), 9100, policies=without_metrics)


# -- the hardening: Redis over TLS --------------------------------------------------------------


def test_redis_is_reached_over_tls_with_the_certificate_verified(clean_env: pytest.MonkeyPatch) -> None:
    for doc, container in rein_containers():
        settings = settings_of(container, clean_env)
        url = urlparse(settings.redis_url)
        assert url.scheme == "rediss", f"{doc['metadata']['name']}: Redis without TLS"
        assert "ssl_cert_reqs=none" not in url.query and "ssl_check_hostname=false" not in url.query.lower()
        assert broker_ssl(settings.redis_url)["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    # KEDA's scaler reads the same server, with TLS, at the address the URL names (the one its
    # certificate names: no alias).
    scaled = the("ScaledObject")
    assert {t["metadata"].get("enableTLS") for t in scaled["spec"]["triggers"]} == {"true"}
    auth = the("TriggerAuthentication", scaled["spec"]["triggers"][0]["authenticationRef"]["name"])
    (address,) = [ref for ref in auth["spec"]["secretTargetRef"] if ref["parameter"] == "address"]
    assert the("Secret", address["name"])["stringData"][address["key"]] == f"{url.hostname}:{url.port}"
    assert not find("Service", "redis"), "an alias of the Redis host would fail the certificate's name check"
