"""Decode steps through rein.engine.cuda_graphs: the graph sizes, and the static, padded
decode path giving what the plain eager path gives.

On CPU the path runs without capturing (`capture=False`), which checks the buffers and the
padding (slot -1, context 0); on CUDA the engine captures and replays real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from rein.engine import EngineConfig, LLMEngine, SamplingParams
from rein.engine.cuda_graphs import MAX_CAPTURE_SIZE, DecodeGraphs, capture_sizes

ON_GPU = torch.cuda.is_available()


@pytest.mark.parametrize(("max_num_seqs", "expected"), [
    (1, [1]),
    (3, [1, 2, 3]),
    (9, [1, 2, 4, 8, 9]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_capture_sizes_cover_every_batch_up_to_max_num_seqs(max_num_seqs, expected):
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_are_capped():
    sizes = capture_sizes(10_000)
    assert sizes[-1] == MAX_CAPTURE_SIZE and sizes[:4] == [1, 2, 4, 8]


def run_workload(engine: LLMEngine, seed: int = 0) -> dict[str, list[int]]:
    """Requests of mixed lengths arriving over several steps, greedy and seeded sampling, so
    steps are decode-only of many sizes and mixed with prefills; tokens by request."""
    rng = random.Random(seed)
    pending = [(f"r{i}", [rng.randrange(5, 2000) for _ in range(rng.randint(1, 40))],
                SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True,
                               **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})))
               for i in range(14)]
    tokens: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            for _ in range(rng.randint(1, 4)):
                if pending:
                    engine.add_request(*pending.pop(0))
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return tokens


def make_engine(model_dir, **config) -> LLMEngine:
    config.setdefault("device", "cpu")
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=256,
                                  max_num_seqs=12, **config))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_static_padded_decode_path_gives_the_eager_tokens(tiny_models, kv_cache_dtype):
    model_dir = tiny_models("qwen3")
    eager = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    expected = run_workload(eager)

    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    runner = engine.runner
    # max_num_seqs 6 < 12: larger decode batches take the eager path in the same run.
    graphs = DecodeGraphs(runner.model, runner.caches, max_num_seqs=6,
                          max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
                          device=runner.device, capture=False)
    sizes_run: list[tuple[int, int]] = []
    plain_run = graphs.run

    def counting_run(input_ids, *args):
        sizes_run.append((len(input_ids), graphs.size_for(len(input_ids))))
        return plain_run(input_ids, *args)

    graphs.run = counting_run
    runner.decode_graphs = graphs
    got = run_workload(engine)

    assert got == expected
    assert any(n < size for n, size in sizes_run), "some steps must have run with padding rows"
    assert {size for _, size in sizes_run} >= {4, 6}
    assert engine.pool.num_used == 0
    # Padding rows store nothing: both engines wrote the same cache contents.
    for mine, theirs in zip(runner.caches, eager.runner.caches, strict=True):
        torch.testing.assert_close(mine.k.float(), theirs.k.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mine.v.float(), theirs.v.float(), rtol=1e-4, atol=1e-4)


def test_cpu_engines_capture_nothing(tiny_models):
    assert make_engine(tiny_models("llama")).runner.decode_graphs is None


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_graph_replay_gives_the_eager_tokens(tiny_models, arch):
    model_dir = tiny_models(arch)
    expected = run_workload(make_engine(model_dir, device="cuda", dtype="float32", enforce_eager=True))
    engine = make_engine(model_dir, device="cuda", dtype="float32")
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.captured and sorted(graphs.graphs) == capture_sizes(12)
    replays: list[int] = []
    plain_run = graphs.run
    graphs.run = lambda input_ids, *args: (replays.append(len(input_ids)), plain_run(input_ids, *args))[1]
    assert run_workload(engine) == expected
    assert replays and engine.pool.num_used == 0
