"""Priority that preempts, through the whole engine (tiny model): an urgent request arriving
while max_num_seqs is full of batch requests starts within a step, the preempted batch
requests resume (from the prefix cache when it is on) and generate exactly the tokens they
generate when nothing preempts them, n > 1 choices included."""

from __future__ import annotations

import pytest
from unit_support import prompt_of, record_plans

from rein.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK = 16
INTERACTIVE, BATCH = 0, 6


def make_engine(model_dir, **config) -> LLMEngine:
    config.setdefault("kv_cache_memory", "8MiB")
    config.setdefault("max_model_len", 256)
    config.setdefault("max_num_seqs", 4)
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **config))


def run(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> tuple[dict, dict]:
    """arrivals[k]: (id, prompt, params, priority) added before step k. Returns the tokens per
    (id, choice) and the step of each request's first output."""
    tokens: dict[tuple[str, int], list[int]] = {}
    first_output: dict[str, int] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for request_id, prompt, params, priority in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params, priority=priority)
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            first_output.setdefault(out.request_id, step)
        step += 1
    return tokens, first_output


def batch_arrivals(n: int = 1) -> dict[int, list[tuple]]:
    # n > 1: sampled (seeded), so that the choices differ.
    sampling = {"temperature": 0.8, "seed": 5} if n > 1 else {"temperature": 0}
    params = SamplingParams(max_tokens=40, ignore_eos=True, n=n, **sampling)
    count = 4 // n
    return {0: [(f"batch{i}", prompt_of(37 + i, seed=i), params, BATCH) for i in range(count)]}


URGENT = ("urgent", prompt_of(20, seed=99), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), INTERACTIVE)


@pytest.mark.parametrize("caching", [True, False])
def test_an_urgent_request_starts_at_once_and_preempted_ones_finish_with_the_same_tokens(tiny_models, caching):
    model_dir = tiny_models("llama")
    expected, _ = run(make_engine(model_dir, enable_prefix_caching=caching), batch_arrivals())
    # Alone, the urgent request's tokens are these.
    alone, _ = run(make_engine(model_dir, enable_prefix_caching=caching), {0: [URGENT]})

    engine = make_engine(model_dir, enable_prefix_caching=caching)
    plans = record_plans(engine)
    arrivals = batch_arrivals()
    arrivals[10] = [URGENT]
    got, first_output = run(engine, arrivals)

    assert first_output["urgent"] == 10                 # admitted, prefilled and sampled in its first step
    assert plans[10].priority_preemptions == 1 and [r.request_id for r in plans[10].preempted] == ["batch3"]
    assert got[("urgent", 0)] == alone[("urgent", 0)]
    assert {k: v for k, v in got.items() if k[0] != "urgent"} == expected
    # The victim resumed: from its cached blocks when caching is on, from scratch otherwise.
    resumed = next(s for plan in plans[11:] for s in plan.scheduled if s.request.request_id == "batch3")
    computed = 37 + 3 + 10                              # prompt + 10 sampled tokens, the last not computed yet
    assert resumed.start == ((computed - 1) // BLOCK * BLOCK if caching else 0)
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_a_choice_of_an_n_request_is_preempted_and_all_choices_keep_their_tokens(tiny_models):
    model_dir = tiny_models("llama")
    expected, _ = run(make_engine(model_dir), batch_arrivals(n=4))
    assert len(expected) == 4 and len({tuple(v) for v in expected.values()}) > 1   # the choices differ

    engine = make_engine(model_dir)
    plans = record_plans(engine)
    arrivals = batch_arrivals(n=4)
    arrivals[6] = [URGENT]
    got, first_output = run(engine, arrivals)
    assert first_output["urgent"] == 6
    [victim] = plans[6].preempted
    assert victim.request_id == "batch0" and victim.index == 3          # the last choice ranks last
    assert {k: v for k, v in got.items() if k[0] != "urgent"} == expected
    assert engine.pool.num_used == 0


def test_batch_requests_finish_under_a_steady_stream_of_urgent_ones(tiny_models):
    engine = make_engine(tiny_models("llama"), max_num_seqs=2)
    engine.scheduler.priority_aging_steps = 3
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    arrivals = {0: [(f"batch{i}", prompt_of(10, seed=i), params, BATCH) for i in range(2)]}
    for step in range(120):   # more urgent work than two sequences can serve
        arrivals.setdefault(step, []).append((f"chat{step}", prompt_of(6, seed=100 + step),
                                              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                                              INTERACTIVE))
    _, first_output = run(engine, arrivals)
    # Aged 6 x 3 = 18 steps, they start once the urgent requests that arrived before step 18 have run.
    assert first_output["batch0"] < 60 and first_output["batch1"] < 60
    assert first_output["chat119"] > first_output["batch1"]
