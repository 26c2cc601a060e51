"""Automatic prefix caching through the whole engine: requests that share leading tokens
reuse the KV blocks computed for them, report those tokens as cached, and generate exactly
what an engine without the cache generates."""

from __future__ import annotations

import random

import pytest
import torch

from rein.engine import EngineConfig, LLMEngine, SamplingParams
from rein.model.spec import ModelSpec

BLOCK = 16


def make_engine(model_dir, **config) -> LLMEngine:
    config.setdefault("kv_cache_memory", "8MiB")
    config.setdefault("max_model_len", 512)
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **config))


def run(engine: LLMEngine, arrivals: list[list[tuple[str, list[int], SamplingParams]]]) -> dict[str, dict]:
    """arrivals[k]: the requests added before step k (later steps add none); per request its
    tokens and the cached count of its last output."""
    results: dict[str, dict] = {}
    step = 0
    while step < len(arrivals) or engine.has_unfinished():
        for request_id, prompt, params in arrivals[step] if step < len(arrivals) else []:
            engine.add_request(request_id, prompt, params)
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "cached": None})
            r["tokens"].extend(out.new_token_ids)
            if out.finished:
                r["cached"] = out.num_cached_tokens
        step += 1
    return results


def shared_prefix_workload(seed: int = 0) -> list[list[tuple[str, list[int], SamplingParams]]]:
    rng = random.Random(seed)
    system = [rng.randrange(10, 2000) for _ in range(45)]          # 2 full blocks + 13 tokens
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, ignore_eos=True,
                              **({"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i}))
    first = [("a0", system + [rng.randrange(10, 2000) for _ in range(7)], params(0))]
    # Step 1: two more while a0 still runs (its blocks are shared while held).
    second = [(f"b{i}", system + [rng.randrange(10, 2000) for _ in range(rng.randint(1, 30))], params(i))
              for i in range(2)]
    quiet = [[] for _ in range(20)]                                  # everything finishes
    # Then, after the holders are gone: the cached blocks are found among the free ones.
    later = [(f"c{i}", system + [rng.randrange(10, 2000) for _ in range(rng.randint(1, 30))], params(i + 1))
             for i in range(3)]
    same = [("d0", system[:32], params(3)), ("d1", system[:32], params(4))]   # whole prompt cached
    return [first, second, *quiet, later, [], same]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_shared_prefixes_are_reused_and_change_no_token(tiny_models, kv_cache_dtype):
    model_dir = tiny_models("llama")
    expected = run(make_engine(model_dir, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False),
                   shared_prefix_workload())
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    got = run(engine, shared_prefix_workload())

    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in expected.items()}
    assert all(v["cached"] == 0 for v in expected.values())
    cached = {k: v["cached"] for k, v in got.items()}
    assert cached["a0"] == 0
    assert cached["b0"] == cached["b1"] == 2 * BLOCK            # a0's two full system blocks
    assert cached["c0"] == cached["c1"] == cached["c2"] == 2 * BLOCK
    # A 32-token prompt seen before: its first block is reused, the last one computed again
    # (the last token's logits give the first new token).
    assert cached["d0"] == cached["d1"] == BLOCK
    assert engine.stats.prefix_cache_hits == sum(cached.values())
    assert engine.stats.prefix_cache_queries == sum(len(p) for step in shared_prefix_workload() for _, p, _ in step)
    assert engine.pool.num_used == 0


def test_prefix_caching_under_preemption_gives_the_same_tokens(tiny_models):
    model_dir = tiny_models("qwen2")
    rng = random.Random(3)
    stems = [[rng.randrange(10, 2000) for _ in range(40)] for _ in range(2)]
    workload = [[(f"r{step}-{j}", rng.choice(stems)[: rng.randint(17, 40)] + [rng.randrange(10, 2000)],
                  SamplingParams(max_tokens=rng.randint(5, 40), temperature=0, ignore_eos=True))
                 for j in range(rng.randint(0, 3))] for step in range(12)]
    # A tight pool (12 blocks), so running requests are preempted and recomputed (partly from
    # the cache); the same pool without the cache gives the expected tokens.
    pool_bytes = 12 * BLOCK * ModelSpec.from_dir(model_dir).kv_bytes_per_token(torch.float32)
    expected = run(make_engine(model_dir, kv_cache_memory=pool_bytes, max_model_len=192,
                               enable_prefix_caching=False), workload)
    engine = make_engine(model_dir, kv_cache_memory=pool_bytes, max_model_len=192)
    assert engine.pool.num_blocks == 12
    got = run(engine, workload)
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in expected.items()}
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert engine.pool.num_used == 0


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_models):
    """Lines of a batch with one system prompt arrive together: the first computes the prompt's
    blocks, the others wait for them (a step, or as many as its chunks take) and take them from
    the cache -- the same tokens as without the cache, and the prefix computed once."""
    rng = random.Random(3)
    system = [rng.randrange(10, 2000) for _ in range(6 * BLOCK)]
    prompts = {f"r{i}": system + [rng.randrange(10, 2000) for _ in range(5 + i)] for i in range(4)}
    other = [rng.randrange(10, 2000) for _ in range(2 * BLOCK)]   # no shared prefix: not held back
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    arrivals = [[*((rid, prompt, params) for rid, prompt in prompts.items()), ("other", other, params)]]
    for budget in (2048, 40):   # whole prompts in one step; and prompts prefilled in chunks
        engine = make_engine(tiny_models("llama"), max_num_batched_tokens=budget)
        cached = run(engine, arrivals)
        plain = run(make_engine(tiny_models("llama"), max_num_batched_tokens=budget, enable_prefix_caching=False),
                    arrivals)
        assert {rid: r["tokens"] for rid, r in cached.items()} == {rid: r["tokens"] for rid, r in plain.items()}
        # The system prompt's six blocks once (r0), then each line's own tokens, and the other prompt.
        own = sum(len(p) - len(system) for p in prompts.values())
        assert engine.stats.prompt_tokens == len(system) + own + len(other), budget
        assert [cached[f"r{i}"]["cached"] for i in range(1, 4)] == [len(system)] * 3
