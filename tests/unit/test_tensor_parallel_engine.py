"""The whole engine under tensor parallelism (rein.engine.rank_processes): with two ranks (gloo,
on CPU) a workload that exercises prefix caching, chunked prefill, preemption, n > 1, prompt
logprobs and structured outputs gives the same tokens as one rank, and logprobs within 1e-4;
the step plans, the block pool and the preemptions are rank 0's alone, so they are the same
too. And an engine whose rank 0 dies leaves no rank behind.

The models are random-weight tiny ones: GQA with untied embeddings (llama), q/k RMSNorm with
tied embeddings (qwen3), q/k/v bias with tied embeddings (qwen2). SmolLM2 over three ranks is in
tests/real/test_smollm2_tensor_parallel.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.rank_processes import RankDiedError, rank_device
from rein.engine.sampling_params import SamplingParams
from rein.model.parallel.shm_reduce import process_alive

LOGPROB_TOLERANCE = 1e-4
# Per rank: with two ranks each holds half the KV heads, so half the memory gives the same
# number of blocks -- the same pool, so the same preemptions.
KV_MEMORY_ONE_RANK = 256 * 1024


def workload() -> dict[str, tuple[list[int], SamplingParams]]:
    shared = list(range(100, 164))    # four whole blocks every "prefix" request starts with
    requests = {}
    for i in range(4):
        requests[f"prefix{i}"] = (shared + [300 + i, 7, 8], SamplingParams(max_tokens=24, temperature=0, logprobs=3))
    # Longer than one step's token budget (64): prefilled in chunks.
    requests["long"] = (list(range(500, 700)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                              prompt_logprobs=2))
    requests["fork"] = ([9, 10, 11, 12, 13], SamplingParams(max_tokens=30, temperature=0, n=3, ignore_eos=True))
    requests["regex"] = ([21, 22, 23], SamplingParams(max_tokens=20, temperature=0,
                                                      structured={"type": "regex", "pattern": "[a-z]{2,6}( [a-z]{2,6}){3}"}))
    for i in range(6):   # enough long generations that the small pool runs out: preemption
        requests[f"grow{i}"] = ([40 + i, 41, 42], SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))
    return requests


def run_engine(model: str, tensor_parallel_size: int) -> tuple[dict, dict, LLMEngine]:
    engine = LLMEngine(EngineConfig(
        model=model, device="cpu", tensor_parallel_size=tensor_parallel_size, max_model_len=256, max_num_seqs=8,
        max_num_batched_tokens=64, kv_cache_memory=KV_MEMORY_ONE_RANK // tensor_parallel_size))
    try:
        for request_id, (prompt, params) in workload().items():
            engine.add_request(request_id, prompt, params)
        tokens: dict[tuple[str, int], list[int]] = {}
        extra: dict[tuple[str, int], list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                key = (out.request_id, out.index)
                tokens.setdefault(key, []).extend(out.new_token_ids)
                seen = extra.setdefault(key, [])
                if out.logprobs:
                    seen.extend(out.logprobs)
                if out.prompt_logprobs:
                    seen.append(("prompt", out.prompt_logprobs))
                if out.finished or out.finish_reason:
                    seen.append(("finish", out.finish_reason))
    finally:
        engine.close()
    return tokens, extra, engine


def close_logprobs(one, two) -> float:
    """The largest difference between two runs' logprobs (chosen and top alternatives, same ids)."""
    worst = 0.0
    for a, b in zip(one, two, strict=True):
        if isinstance(a, tuple) and a[0] == "finish":
            assert a == b
            continue
        if isinstance(a, tuple) and a[0] == "prompt":
            a_entries, b_entries = a[1], b[1]
        else:
            a_entries, b_entries = [a], [b]
        for x, y in zip(a_entries, b_entries, strict=True):
            if x is None:
                assert y is None
                continue
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            tops = zip(x.top, y.top, strict=True)
            worst = max(worst, abs(x.logprob - y.logprob), *(abs(p - q) for (_, p), (_, q) in tops))
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_two_ranks_generate_what_one_rank_does(arch, tiny_models):
    model = str(tiny_models(arch))
    one_tokens, one_extra, one = run_engine(model, 1)
    two_tokens, two_extra, two = run_engine(model, 2)
    assert two_tokens == one_tokens
    assert set(one_tokens) >= {("fork", 0), ("fork", 1), ("fork", 2)}
    for key in one_extra:
        assert close_logprobs(one_extra[key], two_extra[key]) < LOGPROB_TOLERANCE, key
    # Rank 0 scheduled alike: the same pool, prefix-cache hits, preemptions and steps.
    assert two.pool.num_blocks == one.pool.num_blocks
    assert one.stats.preemptions > 0 and one.stats.prefix_cache_hits > 0
    for counter in ("steps", "preemptions", "prefix_cache_hits", "prompt_tokens", "generation_tokens"):
        assert getattr(two.stats, counter) == getattr(one.stats, counter), counter


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_rank_starts(tiny_models):
    started = time.monotonic()
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide the model's 4 attention heads"):
        LLMEngine(EngineConfig(model=str(tiny_models("llama")), device="cpu", tensor_parallel_size=3))
    assert time.monotonic() - started < 30


def test_ranks_take_the_devices_after_rank_zeros():
    assert [rank_device("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("cpu", 1) == "cpu"


def test_a_rank_that_cannot_start_fails_the_engine_at_once(tiny_models, monkeypatch, tmp_path):
    from rein.engine import rank_processes as ranks

    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'no torch here' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setattr(ranks.sys, "executable", str(broken))
    started = time.monotonic()
    with pytest.raises(RankDiedError, match="rank 1 could not start: exited with code 3"):
        LLMEngine(EngineConfig(model=str(tiny_models("llama")), device="cpu", tensor_parallel_size=2,
                               kv_cache_memory="1MiB", max_model_len=256))
    assert time.monotonic() - started < 30


def test_a_dead_rank_fails_the_step_naming_it(tiny_models):
    engine = LLMEngine(EngineConfig(model=str(tiny_models("llama")), device="cpu", tensor_parallel_size=2,
                                    kv_cache_memory="1MiB", max_model_len=256))
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        engine.step()
        process = engine.ranks.processes[0]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)
        with pytest.raises(RankDiedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
            for _ in range(10):
                engine.step()
    finally:
        engine.close()


def test_no_rank_outlives_its_engine_process(tiny_models):
    from rein.engine.process_client import ProcessEngineClient

    client = ProcessEngineClient(EngineConfig(model=str(tiny_models("llama")), device="cpu", tensor_parallel_size=2,
                                              kv_cache_memory="1MiB", max_model_len=256))
    try:
        followers = _children(client.pid)
        assert len(followers) == 1
        os.kill(client.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(process_alive(pid) for pid in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_alive(pid) for pid in followers), "a rank outlived its engine process"
    finally:
        client.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]
