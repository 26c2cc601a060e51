"""Gemma 3 270M over two tensor-parallel ranks (gloo, on CPU): its one KV head is replicated, as
vLLM does (rein.model.parallel.layers) -- each rank holds two of the four query heads, a copy of
the KV head and a whole cache of it, reading its shard of the GGUF file (Q4_K kept quantized).
Greedy answers equal the one-rank engine's token for token, logprobs within 1e-4, and each
rank's pool is one rank's: the same memory gives the same blocks.

The model comes under Gemma's terms: `rein fetch-model gemma3-270m` fetches it into the cache;
without it the test skips (fails under CI=true). About a minute on two cores.
"""

from __future__ import annotations

import pytest
from real_support import generate, torch_threads

pytestmark = pytest.mark.real

LOGPROB_TOLERANCE = 1e-4
MAX_TOKENS = 32
OPENINGS = [
    "The capital of France is",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, the first humans",
    "A recipe for pancakes:\n1.",
    "SELECT name, email FROM users WHERE",
]


def gemma_engine(gemma_path, tensor_parallel_size: int):
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    with torch_threads(1):
        return LLMEngine(EngineConfig(model=str(gemma_path), device="cpu", dtype="float32", max_model_len=512,
                                      kv_cache_memory="64MiB", tensor_parallel_size=tensor_parallel_size))


def answers(engine) -> list:
    prompts = [engine.tokenizer(text).input_ids for text in OPENINGS]
    return generate(engine, prompts, max_tokens=MAX_TOKENS, logprobs=[0] * len(prompts))


def test_two_ranks_replicating_the_kv_head_answer_as_one(gemma_path):
    one = gemma_engine(gemma_path, 1)
    try:
        assert one.spec.num_kv_heads == 1 and one.spec.num_heads == 4
        want, blocks = answers(one), one.pool.num_blocks
    finally:
        one.close()
    two = gemma_engine(gemma_path, 2)
    try:
        attention = two.runner.model.layers[0].self_attn
        assert (attention.num_heads, attention.num_kv_heads) == (2, 1) and two.runner.cache_spec.num_kv_heads == 1
        assert two.pool.num_blocks == blocks
        got = answers(two)
    finally:
        two.close()
    for a, b in zip(want, got, strict=True):
        assert b.token_ids == a.token_ids and len(a.token_ids) == MAX_TOKENS
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < LOGPROB_TOLERANCE
