"""bench/quantized.py gives rein the KV cache llama.cpp gets (bench/peers_llamacpp.py): float16,
room for `parallel` sequences of the workload's longest request and no more, so neither
system's peak RSS carries a larger cache than the other's."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_rein_kv_cache_holds_the_batch_of_longest_requests_in_whole_blocks():
    quantized = bench_module("quantized")
    requests = {"prompts": [[1] * 128, [1] * 120, [1] * 100], "max_tokens": [128, 140, 128], "parallel": 3}
    # The longest request: 120 + 140 = 260 tokens, 17 blocks of 16, for each of 3 sequences.
    assert quantized.rein_kv_cache(16, 1000, requests) == (260, 1000 * 16 * 17 * 3)
    assert quantized.rein_kv_cache(16, 1000, {**requests, "parallel": 1}) == (260, 1000 * 16 * 17)


def test_both_caches_are_float16_and_llamacpp_gets_the_longest_request():
    quantized, peer = bench_module("quantized"), bench_module("peers_llamacpp")
    assert quantized.KV_CACHE_DTYPE == "float16"
    job = peer.check_job({"prompts": [[1] * 128, [1] * 120], "max_tokens": [128, 140], "parallel": 2})
    assert job["n_ctx"] == 260   # one sequence's context; llama.cpp's n_ctx is parallel times it
