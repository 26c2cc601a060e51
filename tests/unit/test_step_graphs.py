"""Whole-step decode graphs (rein.engine.cuda_graphs): the graph of a decode step samples its
rows itself when they let it, and gives the tokens the plain path gives.

On the CPU the graphs run without capturing (`DecodeGraphs(capture=False)`): the same static
buffers, padding, knobs and noise, run eagerly. Each workload runs on a plain engine and on one
whose runner has such graphs; `DecodeGraphs.runs` says which modes ran and how many steps the
graph sampled, so a test fails when the path it is about was not taken.
"""

from __future__ import annotations

import pickle
import random

import pytest
import torch

from rein.engine import EngineConfig, LLMEngine, SamplingParams
from rein.engine.cuda_graphs import (
    FILTER,
    GREEDY,
    SAMPLE,
    STEP_MODES,
    DecodeGraphs,
    GraphSampling,
    step_mode,
)
from rein.engine.sampler import Sampler, SamplingBatch, make_generator

GREEDY_PARAMS = {"temperature": 0}
RANDOM_PARAMS = [
    {"temperature": 0.8},
    {"temperature": 1.3, "top_k": 5},
    {"temperature": 0.9, "top_p": 0.7},
    {"temperature": 1.0, "min_p": 0.2},
    {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
]
# Rows the graph cannot sample: the step falls back to the host Sampler on the graph's logits.
HOST_PARAMS = [
    {"temperature": 0.8, "logprobs": 2},
    {"temperature": 0, "logit_bias": {7: 5.0}},
    {"temperature": 0.9, "repetition_penalty": 1.3, "frequency_penalty": 0.2},
    {"temperature": 0, "min_tokens": 3},
]


def make_engine(model_dir, **config) -> LLMEngine:
    config.setdefault("device", "cpu")
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=256,
                                  max_num_seqs=12, **config))


def with_graphs(engine: LLMEngine, max_num_seqs: int = 6) -> DecodeGraphs:
    """Give the engine's runner rank 0's sampling graphs, run eagerly; max_num_seqs below the
    engine's 12 makes larger decode batches take the eager path in the same run."""
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, max_num_seqs=max_num_seqs,
                          max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
                          device=runner.device, capture=False, vocab_size=runner.spec.vocab_size,
                          modes=STEP_MODES)
    runner.decode_graphs = graphs
    return graphs


def run_workload(engine: LLMEngine, kinds: list[dict], seed: int = 0, count: int = 14) -> dict:
    """Requests of mixed lengths arriving over several steps, so decode batches change size (and
    bucket) and mix with prefills; each request takes its params from `kinds` in turn, with a
    seed. Returns each request's tokens and logprobs."""
    rng = random.Random(seed)
    pending = [(f"r{i}", [rng.randrange(5, 2000) for _ in range(rng.randint(1, 40))],
                SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True, seed=100 + i, **kinds[i % len(kinds)]))
               for i in range(count)]
    got: dict[str, list] = {}
    step = 0
    while pending or engine.has_unfinished():
        if pending and step % 3 == 0:
            for _ in range(rng.randint(1, 4)):
                if pending:
                    engine.add_request(*pending.pop(0))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(
                zip(out.new_token_ids, [(lp.token_id, round(lp.logprob, 4)) for lp in out.logprobs]
                    if out.logprobs else [None] * len(out.new_token_ids), strict=True))
        step += 1
    engine.close()
    return got


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen3")


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(("kinds", "modes"), [
    ([GREEDY_PARAMS], {GREEDY}),
    ([RANDOM_PARAMS[0]], {SAMPLE}),
    (RANDOM_PARAMS, {FILTER}),
    ([GREEDY_PARAMS, RANDOM_PARAMS[0]], {SAMPLE}),
    ([GREEDY_PARAMS, *RANDOM_PARAMS], {FILTER}),
], ids=["greedy", "temperature", "filters", "greedy-and-temperature", "greedy-and-filters"])
def test_the_graph_samples_the_plain_paths_tokens(model_dir, kinds, modes, async_scheduling):
    expected = run_workload(make_engine(model_dir, async_scheduling=async_scheduling), kinds)
    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    graphs = with_graphs(engine)
    assert run_workload(engine, kinds) == expected
    assert graphs.runs["device"] > 0, "decode steps must have sampled inside the graph"
    assert graphs.runs["device"] == sum(graphs.runs[mode] for mode in STEP_MODES), "no step fell back"
    assert modes <= {mode for mode in STEP_MODES if graphs.runs[mode]}
    # Async scheduling launches a step planned ahead before the ids of the one before reach the
    # host: its graph takes them from the device.
    assert (graphs.runs["fed"] > 0) == async_scheduling
    assert engine.pool.num_used == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_rows_the_graph_cannot_sample_fall_back_in_the_same_run(model_dir, async_scheduling):
    kinds = [GREEDY_PARAMS, *RANDOM_PARAMS, *HOST_PARAMS]
    expected = run_workload(make_engine(model_dir, async_scheduling=async_scheduling), kinds, count=20)
    engine = make_engine(model_dir, async_scheduling=async_scheduling)
    graphs = with_graphs(engine)
    assert run_workload(engine, kinds, count=20) == expected
    graph_steps = sum(graphs.runs[mode] for mode in STEP_MODES)
    assert 0 < graphs.runs["device"] < graph_steps, "some steps sampled in the graph and some on the host"


def test_graphs_that_do_not_sample_leave_sampling_to_the_host(model_dir):
    """The other ranks' graphs (no vocab_size) and graphs with only the greedy mode stop at the
    logits: every step is sampled by the engine's Sampler."""
    kinds = [GREEDY_PARAMS, *RANDOM_PARAMS]
    expected = run_workload(make_engine(model_dir), kinds)
    engine = make_engine(model_dir)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, max_num_seqs=6,
                          max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
                          device=runner.device, capture=False, modes=STEP_MODES)
    runner.decode_graphs = graphs
    assert run_workload(engine, kinds) == expected
    assert graphs.runs[GREEDY] > 0 and graphs.runs["device"] == 0


def test_padding_rows_and_every_bucket_sample_like_the_sampler(model_dir):
    """Direct: each size's graph, with padding rows, samples what Sampler samples from the
    same logits with generators seeded alike."""
    engine = make_engine(model_dir)
    graphs = with_graphs(engine, max_num_seqs=8)
    vocab = engine.runner.spec.vocab_size
    params = [SamplingParams(**kind) for kind in (GREEDY_PARAMS, *RANDOM_PARAMS)] * 2
    for n in (8, 3, 5, 1):   # the larger first: padding rows hold an earlier step's values
        rows = params[:n]
        with torch.inference_mode():   # as the runner's steps run
            check_step(graphs, rows, vocab)
    assert graphs.runs["device"] == 4


def check_step(graphs: DecodeGraphs, rows: list[SamplingParams], vocab: int) -> None:
    n = len(rows)
    step = graphs.run(list(range(3, 3 + n)), [0] * n, [-1] * n, [1] * n, [[0]] * n, None, step_mode(rows),
                      GraphSampling(rows, [make_generator(i, "cpu") for i in range(n)]))
    assert step.logits.shape == (n, vocab)
    expected = Sampler()(step.logits.clone(), SamplingBatch(
        rows, [make_generator(i, "cpu") for i in range(n)], [[]] * n, [[]] * n))
    assert step.sampled.tolist() == expected.token_ids
    assert step.sampled.device.shape == (n,)


def test_a_mode_that_cannot_sample_the_rows_is_refused(model_dir):
    graphs = with_graphs(make_engine(model_dir))
    rows = [SamplingParams(temperature=0.8, top_p=0.5)]
    with pytest.raises(ValueError, match="cannot sample"), torch.inference_mode():
        graphs.run([3], [0], [-1], [1], [[0]], None, SAMPLE, GraphSampling(rows, [None]))
    with pytest.raises(ValueError, match="modes"):
        DecodeGraphs(graphs.model, graphs.caches, max_num_seqs=2, max_blocks_per_seq=1,
                     device=torch.device("cpu"), capture=False, modes=(SAMPLE,))
    wrong = DecodeGraphs(graphs.model, graphs.caches, max_num_seqs=2, max_blocks_per_seq=1, device=torch.device("cpu"),
                         capture=False, vocab_size=graphs.noise.shape[1] + 1, modes=STEP_MODES)
    with pytest.raises(ValueError, match="columns"), torch.inference_mode():
        wrong.run([3], [0], [-1], [1], [[0]], None, FILTER, GraphSampling(rows, [None]))


@pytest.mark.parametrize(("kinds", "mode"), [
    ([GREEDY_PARAMS], GREEDY),
    ([GREEDY_PARAMS, {"temperature": 0.5}], SAMPLE),
    ([{"temperature": 0.5, "top_k": 3}], FILTER),
    ([GREEDY_PARAMS, {"temperature": 0.5, "min_p": 0.1}], FILTER),
    ([{"temperature": 0, "top_p": 0.5}], GREEDY),   # a greedy row's filters change nothing
])
def test_step_mode(kinds, mode):
    assert step_mode([SamplingParams(**kind) for kind in kinds]) == mode


class InProcessFollower:
    """Stands in for rein.engine.rank_processes.RankProcesses with one follower runner in this
    process: each plan, pickled as the pipe would carry it, runs on it at once (one rank's
    model, so no collective to meet)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def send(self, plan) -> None:
        self.runner.follow(pickle.loads(pickle.dumps(plan)))


def test_other_ranks_replay_the_mode_rank_0s_plan_names(model_dir):
    """Under tensor parallelism the other ranks' graphs (no sampling) replay what rank 0's plan
    says, so the collectives pair up: here a follower runner beside rank 0's, fed its plans,
    runs the same modes and writes the same KV cache."""
    kinds = [GREEDY_PARAMS, *RANDOM_PARAMS, HOST_PARAMS[0]]
    engine = make_engine(model_dir)
    graphs = with_graphs(engine)
    follower = make_engine(model_dir).runner
    follower_graphs = DecodeGraphs(follower.model, follower.caches, max_num_seqs=6,
                                   max_blocks_per_seq=-(-follower.max_model_len // follower.block_size),
                                   device=follower.device, capture=False, modes=STEP_MODES)
    follower.decode_graphs = follower_graphs
    engine.runner.ranks = InProcessFollower(follower)
    run_workload(engine, kinds)
    assert graphs.runs["device"] > 0 and follower_graphs.runs["device"] == 0
    assert {mode: follower_graphs.runs[mode] for mode in STEP_MODES} == {mode: graphs.runs[mode] for mode in STEP_MODES}
    assert len({mode for mode in STEP_MODES if graphs.runs[mode]}) >= 2
    for mine, theirs in zip(engine.runner.caches, follower.caches, strict=True):
        assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)
