"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny_models(arch="llama", preset="tiny", seed=0, embedding=None)` -> directory of a
    random-weight model (`embedding="last" | "mean" | "cls"`: an embedding model).

    Each (arch, preset, seed) is built once per session (see rein.tiny_model) into a
    session temp dir; the directories are shared, so treat them as read-only.
    """
    from rein.tiny_model import make_tiny_model

    built: dict[tuple[str, str, int, str | None], Path] = {}

    def get(arch: str = "llama", preset: str = "tiny", seed: int = 0, embedding: str | None = None) -> Path:
        key = (arch, preset, seed, embedding)
        if key not in built:
            kind = f"-embed-{embedding}" if embedding else ""
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{preset}-seed{seed}{kind}")
            built[key] = make_tiny_model(out, arch=arch, seed=seed, preset=preset, embedding=embedding)
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
