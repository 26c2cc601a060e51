"""Fixtures the unit test modules share (the whole suite's are in tests/conftest.py).

Module-scoped, as each module had its own copy: a module that needs another model or
tokenizer defines a fixture of the same name, which wins over these.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def model_dir(tiny_models: Callable[..., Path]) -> Path:
    """The tiny random-weight llama model (read-only: the directory is shared)."""
    return tiny_models("llama")


@pytest.fixture(scope="module")
def tokenizer(tiny_models: Callable[..., Path]):
    """The tiny llama model's tokenizer (byte-level BPE, with a chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models("llama")))
