"""The engine end to end with an int8 KV cache on CPU: pool size, no leaked blocks, and
output close to the fp32 cache's.

The tiny llama (2 layers, 2 KV heads, head_dim 16) with 8 MiB of KV memory and block size 16:
    fp32 cache: 2 (K,V) x 2 layers x 2 heads x 16 dims x 4 bytes            = 512 B/token
                -> 8 MiB / (512 x 16) = 1024 blocks
    int8 cache: 2 x 2 x 2 x 16 x 1 byte + one fp32 scale per token, head, K/V
                (2 x 2 x 2 x 4 = 32 bytes)                                   = 160 B/token
                -> 8 MiB // (160 x 16) = 8388608 // 2560 = 3276 blocks
"""

from __future__ import annotations

import random

import pytest
import torch

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams

KV_MEMORY = 8 * 2**20
MAX_TOKENS = 4
# A budget of 32 tokens a step prefills the longer prompts in chunks, so later chunks
# attend to a prefix read back from the (quantized) cache.
MAX_NUM_BATCHED_TOKENS = 32
# The first token comes from attention over the prompt only. Over 200 seeded prompts its
# |logprob| moved at most 0.13 with int8 (mean 0.02), and the 4 first tokens that changed
# all had an fp32 top-1/top-2 logprob gap under 0.04. A request whose fp32 gap is wider
# than MARGIN must keep its first token; near-ties may legitimately flip.
MARGIN = 0.25


def make_engine(model_dir, kv_cache_dtype: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_dtype=kv_cache_dtype,
                                  kv_cache_memory=KV_MEMORY, max_model_len=256,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS))


def make_prompts(count: int = 16) -> list[list[int]]:
    rng = random.Random(0)
    lengths = [1, 3, 7, 16, 17, 24, 31, 40, 64, 100, 9, 50]
    # Ids 10..2042 stay clear of the special tokens at the top of the 2048-token vocab.
    return [[rng.randrange(10, 2043) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


def run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    logprobs: dict[str, list] = {str(i): [] for i in range(len(prompts))}
    finish: dict[str, str | None] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.logprobs or [])
            if out.finished:
                finish[out.request_id] = out.finish_reason
        steps += 1
        assert steps < 1000, "the engine did not finish"
    keys = [str(i) for i in range(len(prompts))]
    return {"tokens": [tokens[k] for k in keys], "logprobs": [logprobs[k] for k in keys],
            "finish": [finish.get(k) for k in keys]}


@pytest.fixture(scope="module")
def runs(model_dir):
    prompts = make_prompts()
    fp32, int8 = make_engine(model_dir, "float32"), make_engine(model_dir, "int8")
    return {"prompts": prompts, "fp32_engine": fp32, "int8_engine": int8,
            "fp32": run(fp32, prompts), "int8": run(int8, prompts)}


def test_int8_pool_holds_more_blocks_for_the_same_memory(runs):
    fp32, int8 = runs["fp32_engine"], runs["int8_engine"]
    spec = int8.spec
    # The hand-computed counts in the module docstring assume the tiny preset's shape.
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    assert fp32.pool.num_blocks == 1024
    assert int8.pool.num_blocks == 3276
    assert int8.runner.capacity.bytes_per_token == 160
    cache = int8.runner.caches[0]
    assert cache.k.dtype == torch.int8 and cache.v.dtype == torch.int8
    assert cache.k.shape == (3276, 16, 2, 16)
    assert cache.k_scale.dtype == torch.float32 and cache.k_scale.shape == (3276, 16, 2)
    assert fp32.runner.caches[0].k.dtype == torch.float32 and fp32.runner.caches[0].k_scale is None


def test_int8_engine_runs_to_the_end_and_frees_every_block(runs):
    out, engine = runs["int8"], runs["int8_engine"]
    assert out["finish"] == ["length"] * len(runs["prompts"])
    assert all(len(t) == MAX_TOKENS for t in out["tokens"])
    assert all(0 <= t < engine.spec.vocab_size for seq in out["tokens"] for t in seq)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(engine.pool.ref_count(b) == 0 for b in range(engine.pool.num_blocks))
    assert not engine.has_unfinished() and engine.num_running == 0 and not engine.requests


def test_int8_first_token_matches_fp32(runs):
    fp32, int8 = runs["fp32"], runs["int8"]
    firsts = list(zip(fp32["logprobs"], int8["logprobs"], strict=True))
    gaps = [a[0].top[0][1] - a[0].top[1][1] for a, _ in firsts]
    clear = [i for i, gap in enumerate(gaps) if gap > MARGIN]
    # Enough clear-margin requests that the check below means something.
    assert len(clear) >= len(firsts) // 2, f"only {len(clear)} of {len(firsts)} prompts have a clear top-1"
    changed = [i for i in clear if fp32["tokens"][i][0] != int8["tokens"][i][0]]
    assert not changed, f"first token changed under int8 for clear-margin requests {changed}"
    same = sum(a[0] == b[0] for a, b in zip(fp32["tokens"], int8["tokens"], strict=True))
    assert same >= 0.9 * len(firsts)

    diffs = [abs(a[0].logprob - b[0].logprob) for a, b in firsts]
    # The cache really was quantized (identical logprobs would mean int8 was not used) ...
    assert max(diffs) > 1e-4
    # ... and dequantized correctly: a wrong scale moves logprobs by whole units.
    assert max(diffs) < 0.5 and sum(diffs) / len(diffs) < 0.1
