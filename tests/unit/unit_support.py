"""Helpers the unit test modules share (imported by name: pytest puts tests/unit on sys.path;
the shared fixtures are in conftest.py)."""

from __future__ import annotations

import random

from rein.engine import EngineConfig, LLMEngine


def make_engine(model_dir, **config) -> LLMEngine:
    """A CPU engine on `model_dir` (8 MiB of KV cache, 256 tokens of context unless `config` says)."""
    config.setdefault("kv_cache_memory", "8MiB")
    config.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **config))


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """`length` random token ids in [10, 2000), the same for the same `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]
