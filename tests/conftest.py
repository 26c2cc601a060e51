"""Shared pytest fixtures, and the tiers: each test is marked with its directory's tier
(unit, integration, e2e, kernels, real, deploy), so `-m "unit or kernels"` picks tiers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import FAST_PATH_FILES, TIERS


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: a test of tests/{tier}/")
    config.addinivalue_line("markers", "fast_path: its outcome depends on REIN_CPU_FAST_PATHS (make test-fallback)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # One torch thread per xdist worker (set before torch is imported): `make test` runs a
        # worker per core, and two workers of two threads each on two cores spin against
        # each other. Real-tier and e2e code that wants its own thread count still sets it.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        relative = item.path.relative_to(root).as_posix()
        tier = relative.split("/", 1)[0]
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if relative in FAST_PATH_FILES:
            item.add_marker(pytest.mark.fast_path)
        # Under `--dist loadgroup` (make test): a file's tests stay on one worker, so its module
        # fixtures (an e2e stack) start once; the real tier shares one worker, so each real
        # model loads once per run.
        item.add_marker(pytest.mark.xdist_group("real" if tier == "real" else relative))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_models(arch="llama", preset="tiny", seed=0, embedding=None, thinking=False)` -> directory
    of a random-weight model (`embedding="last" | "mean" | "cls"`: an embedding model; `thinking`:
    a reasoning model's tokenizer and Qwen3-style template, rein.fixtures.tiny_tokenizer).

    Each (arch, preset, seed) is built once per session (see rein.fixtures.tiny_model) into a
    session temp dir; the directories are shared, so treat them as read-only.
    """
    from rein.fixtures.tiny_model import make_tiny_model

    built: dict[tuple[str, str, int, str | None, bool], Path] = {}

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0, embedding: str | None = None,
            thinking: bool = False) -> Path:
        key = (arch, preset, seed, embedding, thinking)
        if key not in built:
            kind = f"-embed-{embedding}" if embedding else "-thinking" if thinking else ""
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{preset}-seed{seed}{kind}")
            built[key] = make_tiny_model(out, arch=arch, seed=seed, preset=preset, embedding=embedding,
                                         thinking=thinking)
        return built[key]

    return get


@pytest.fixture
def clean_rein_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No REIN_* variable from the machine leaks into a test; the cached settings are dropped
    (modules about settings use it for every test: `pytest.mark.usefixtures`)."""
    from rein.core.settings import get_settings

    for name in list(os.environ):
        if name.startswith("REIN_"):
            monkeypatch.delenv(name)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def _set_cpu_fast_paths(monkeypatch: pytest.MonkeyPatch, on: bool) -> Iterator[None]:
    from rein.core.settings import get_settings
    from rein.kernels import cpu_native, cpu_paths

    monkeypatch.setenv("REIN_CPU_FAST_PATHS", "1" if on else "0")
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    get_settings.cache_clear()
    cpu_paths.reset()
    yield
    get_settings.cache_clear()
    cpu_paths.reset()


@pytest.fixture
def cpu_fast_paths_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """REIN_CPU_FAST_PATHS=0 for one test: torch's code alone, as on a CPU that can run none
    of rein's fast paths (rein.kernels.cpu_paths); the probes are forgotten before and after."""
    yield from _set_cpu_fast_paths(monkeypatch, on=False)


@pytest.fixture
def cpu_fast_paths_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """REIN_CPU_FAST_PATHS=1 for one test, whatever the suite runs with (`make test-fallback`
    runs it with 0): the fast paths this CPU can run."""
    yield from _set_cpu_fast_paths(monkeypatch, on=True)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint URL of an S3-compatible server for this run: moto's own HTTP server
    (`python -m moto.server`, from the dev extra) on a free port, as a subprocess, so the tests
    talk real HTTP through boto3 as against AWS or MinIO. Skips with the reason when it cannot
    start (fails under CI=true, like the other services)."""
    import subprocess
    import sys
    import urllib.request

    from support import free_port, unreachable

    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()
                break
            except OSError as exc:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    unreachable(f"moto's S3 server (log: {log.read_text()[-500:]!r})", exc)
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture
def s3_bucket(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A new, empty bucket on the test's S3 server, with the standard AWS_* variables pointing
    boto3 (and every S3 tool) at it for this test; the bucket's name."""
    import secrets

    from rein.core import s3_client as clients
    from rein.store import s3

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(clients, "_clients", {})     # a client built from these variables
    bucket = f"rein-test-{secrets.token_hex(4)}"
    s3.s3_client().create_bucket(Bucket=bucket)
    return bucket
