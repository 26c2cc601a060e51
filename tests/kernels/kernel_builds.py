"""Shared by the C-kernel tests: building rein's CPU kernels for a chosen -march (imported by
them as a plain module)."""

from __future__ import annotations

import pytest


def use_c_kernels(monkeypatch: pytest.MonkeyPatch, build_root, march: str) -> None:
    """Make rein.kernels.cpu_native build (into `build_root`, once per march) and load the C
    kernels for `march`, with the fast paths on whatever the suite runs with; any library an
    earlier test loaded is forgotten. The caller clears the settings cache after the test."""
    from rein.core.settings import get_settings
    from rein.kernels import cpu_native

    monkeypatch.setenv("REIN_CACHE_DIR", str(build_root))
    for setting in ("REIN_CPU_KERNELS", "REIN_CPU_FAST_PATHS"):
        monkeypatch.delenv(setting, raising=False)
    monkeypatch.setattr(cpu_native, "MARCH", march)
    get_settings.cache_clear()
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
