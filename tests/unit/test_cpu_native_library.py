"""Where the native CPU kernels' library lives and what is checked before it is loaded
(rein.kernels.cpu_native.library_path): a 0700 folder of this user, and the SHA-256 recorded at
build time. The compiler is replaced by a stand-in that writes bytes (the real build and load:
tests/kernels/test_cpu_native.py)."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from rein.core.settings import get_settings
from rein.kernels import cpu_native


@pytest.fixture
def builds(tmp_path, monkeypatch) -> list[str]:
    """REIN_CACHE_DIR in tmp_path, the compiler a stand-in; the list of the builds it made."""
    made: list[str] = []

    def build(compiler, flags, out):
        made.append(out.name)
        out.write_bytes(b"\x7fELF stand-in library %d" % len(made))

    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path / "cache"))
    get_settings.cache_clear()
    monkeypatch.setattr(cpu_native, "_build", build)
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: "/usr/bin/cc")
    yield made
    get_settings.cache_clear()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_built_once_into_a_private_folder_with_its_checksum(builds, tmp_path):
    library = cpu_native.library_path()
    assert library.parent == tmp_path / "cache" / "kernels" and mode(library.parent) == 0o700
    checksum = library.with_name(library.name + ".sha256").read_text().strip()
    assert checksum == cpu_native._sha256(library)
    assert cpu_native.library_path() == library and len(builds) == 1   # checked, not built again


def test_a_changed_library_is_built_again_not_loaded(builds, caplog):
    library = cpu_native.library_path()
    library.write_bytes(b"\x7fELF something else")    # same size or not: the checksum tells
    with caplog.at_level(logging.WARNING, logger="rein.kernels.cpu_native"):
        assert cpu_native.library_path() == library
    assert len(builds) == 2 and "not the one recorded at build time" in caplog.text
    assert library.read_bytes() == b"\x7fELF stand-in library 2"
    library.with_name(library.name + ".sha256").unlink()   # no checksum: built again too
    cpu_native.library_path()
    assert len(builds) == 3


def test_an_existing_folder_only_others_may_read_is_made_private(builds, tmp_path):
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    cpu_native.library_path()
    assert mode(folder) == 0o700


@pytest.mark.parametrize("folder_mode", [0o775, 0o757, 0o777])
def test_a_folder_others_may_write_is_refused(builds, tmp_path, folder_mode):
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    folder.chmod(folder_mode)
    with pytest.raises(OSError, match="may be written by its group or others"):
        cpu_native.library_path()
    assert builds == [] and mode(folder) == folder_mode


def test_a_folder_of_another_user_is_refused(builds, tmp_path, monkeypatch):
    cpu_native.library_path()
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(OSError, match="belongs to user id"):
        cpu_native.library_path()


def test_a_refused_folder_means_torch_code_not_a_crash(builds, tmp_path, monkeypatch):
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    for setting in ("REIN_CPU_KERNELS", "REIN_CPU_FAST_PATHS"):
        monkeypatch.delenv(setting, raising=False)
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    assert cpu_native.library() is None
    assert "may be written by its group or others" in cpu_native.why_unavailable()
