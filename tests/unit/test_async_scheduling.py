"""Async scheduling (rein.engine.async_scheduling) makes the same outputs as the synchronous
step: each workload runs on two engines of one configuration, async_scheduling off and on, and
every request's outputs (tokens, text, finish and stop reasons, logprobs, prompt logprobs,
cached tokens) are compared. Each also checks that the async engine did plan steps ahead where
the workload lets it, so a pipeline that silently fell back everywhere would fail."""

from __future__ import annotations

import random

import pytest

from rein.engine import EngineConfig, LLMEngine, SamplingParams
from rein.engine.loop import EngineCore


def make_engine(model_dir, async_scheduling: bool, **config) -> LLMEngine:
    config = {"kv_cache_memory": "8MiB", "max_model_len": 512, "max_num_seqs": 32} | config
    return LLMEngine(EngineConfig(model=str(model_dir), async_scheduling=async_scheduling, **config))


def record(results: dict, out) -> None:
    """Append one output to its (request, choice)'s record."""
    r = results.setdefault((out.request_id, out.index), {
        "tokens": [], "text": "", "finish": None, "stop_reason": None, "logprobs": [], "prompt_logprobs": None,
        "cached": None, "finished": False})
    r["tokens"].extend(out.new_token_ids)
    r["text"] += out.text_delta
    if out.logprobs:
        r["logprobs"].extend((lp.token_id, lp.logprob, lp.top) for lp in out.logprobs)
    if out.prompt_logprobs is not None:
        r["prompt_logprobs"] = out.prompt_logprobs
    if out.finish_reason is not None:
        r["finish"], r["stop_reason"], r["cached"] = out.finish_reason, out.stop_reason, out.num_cached_tokens
    r["finished"] = r["finished"] or out.finished


def drain(engine: LLMEngine, on_output=None) -> dict:
    results: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            record(results, out)
            if on_output is not None:
                on_output(engine, out, results)
    return results


def both(model_dir, add, on_output=None, **config) -> tuple[dict, dict, LLMEngine, LLMEngine]:
    """The results of the workload `add(engine)` on a synchronous and an async engine."""
    runs = []
    for async_scheduling in (False, True):
        engine = make_engine(model_dir, async_scheduling, **config)
        add(engine)
        runs.append((drain(engine, on_output), engine))
        engine.close()
    (sync, sync_engine), (pipelined, async_engine) = runs
    assert set(pipelined) == set(sync)
    for key in sync:
        assert pipelined[key] == sync[key], key
    return sync, pipelined, sync_engine, async_engine


def prompt_of(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(5, 2000) for _ in range(length)]


def test_greedy_and_seeded_sampling_with_logprobs(model_dir):
    def add(engine):
        rng = random.Random(1)
        for i in range(24):
            params = SamplingParams(max_tokens=rng.randint(1, 48), temperature=rng.choice([0.0, 0.8, 1.0]),
                                    top_p=rng.choice([1.0, 0.9]), seed=i, logprobs=rng.choice([None, 0, 3]),
                                    ignore_eos=rng.random() < 0.5)
            engine.add_request(f"r{i}", prompt_of(rng, rng.randint(1, 40)), params)

    sync, _, _, async_engine = both(model_dir, add)
    assert {r["finish"] for r in sync.values()} <= {"length", "stop"}
    assert any(r["logprobs"] for r in sync.values())
    assert async_engine.stats.planned_ahead > 20


def test_stop_tokens_eos_and_stop_strings_drop_the_planned_row(model_dir, tokenizer):
    """Requests that a token ends (a stop token, a stop string) had their next step planned and
    run already: those rows are dropped, and nothing of them shows."""
    rng = random.Random(2)
    prompts = [prompt_of(rng, rng.randint(4, 30)) for _ in range(16)]
    # Find tokens the greedy continuations actually produce, to stop on them.
    probe = make_engine(model_dir, False)
    for i, prompt in enumerate(prompts):
        probe.add_request(f"p{i}", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    probed = drain(probe)
    stop_tokens = [r["tokens"][rng.randint(2, 30)] for r in probed.values()]
    texts = [r["text"] for r in probed.values()]

    def add(engine):
        for i, prompt in enumerate(prompts):
            if i % 2:
                params = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_tokens[i]])
            else:
                text = texts[i]
                stop = text[len(text) // 2:len(text) // 2 + 3] if len(text) > 8 else "zzz"
                params = SamplingParams(max_tokens=40, temperature=0, stop=[stop])
            engine.add_request(f"r{i}", prompt, params)

    sync, _, _, async_engine = both(model_dir, add)
    reasons = [r["finish"] for r in sync.values()]
    assert reasons.count("stop") >= 8 and any(r["stop_reason"] for r in sync.values())
    assert async_engine.stats.planned_ahead > 10


def test_preemption_with_a_small_kv_cache(model_dir):
    def add(engine):
        rng = random.Random(3)
        for i in range(20):
            engine.add_request(f"r{i}", prompt_of(rng, rng.randint(20, 60)),
                               SamplingParams(max_tokens=60, temperature=rng.choice([0.0, 1.0]), seed=i,
                                              ignore_eos=True))

    _, _, sync_engine, async_engine = both(model_dir, add, kv_cache_memory="600KiB", enable_prefix_caching=False)
    assert sync_engine.stats.preemptions > 0
    assert async_engine.stats.preemptions == sync_engine.stats.preemptions
    assert async_engine.stats.planned_ahead > 0


def test_prefix_caching_and_prompt_logprobs(model_dir):
    def add(engine):
        rng = random.Random(4)
        shared = prompt_of(rng, 48)
        for i in range(12):
            params = SamplingParams(max_tokens=rng.randint(4, 30), temperature=0, ignore_eos=True,
                                    prompt_logprobs=2 if i % 5 == 0 else None, logprobs=1)
            engine.add_request(f"r{i}", shared + prompt_of(rng, rng.randint(1, 20)), params)

    sync, _, _, async_engine = both(model_dir, add)
    assert any(r["cached"] for r in sync.values())
    assert any(r["prompt_logprobs"] for r in sync.values())
    assert async_engine.stats.planned_ahead > 0


def test_requests_arriving_while_others_decode(model_dir):
    """New requests come in at fixed points of the outputs (not of the step calls, which the
    async engine makes one more of): waiting requests make it schedule synchronously."""
    rng = random.Random(5)
    late = [prompt_of(rng, rng.randint(2, 30)) for _ in range(6)]

    def add(engine):
        engine.add_request("first", prompt_of(random.Random(6), 10),
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))

    def on_output(engine, out, results):
        count = len(results[("first", 0)]["tokens"])
        if out.request_id == "first" and count % 8 == 0 and count // 8 <= len(late):
            i = count // 8 - 1
            engine.add_request(f"late{i}", late[i], SamplingParams(max_tokens=12 + i, temperature=1.0, seed=i,
                                                                   ignore_eos=True))

    both(model_dir, add, on_output)


def test_structured_outputs_and_n_choices(model_dir):
    """Grammar requests and the step an n > 1 request forks in run synchronously; the steps
    between, and the forked choices' decodes, are planned ahead."""
    spec = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                              "required": ["a"]}}

    def add(engine):
        rng = random.Random(7)
        engine.add_request("json", prompt_of(rng, 12), SamplingParams(max_tokens=40, temperature=1.0, seed=3,
                                                                      structured=spec))
        engine.add_request("n3", prompt_of(rng, 20), SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=5,
                                                                    ignore_eos=True, logprobs=2))
        engine.add_request("n2", prompt_of(rng, 9), SamplingParams(n=2, max_tokens=30, temperature=0,
                                                                   ignore_eos=True))

    sync, _, _, _ = both(model_dir, add)
    assert {key[1] for key in sync if key[0] == "n3"} == {0, 1, 2}

    def add_choices(engine):
        rng = random.Random(8)
        engine.add_request("n4", prompt_of(rng, 20), SamplingParams(n=4, max_tokens=30, temperature=1.0, seed=9,
                                                                    ignore_eos=True))

    _, _, _, async_engine = both(model_dir, add_choices)
    assert async_engine.stats.planned_ahead > 20


@pytest.mark.parametrize("abort_at", [1, 5, 17])
def test_aborts_at_a_fixed_output_count(model_dir, abort_at):
    """A request aborted after its Nth output: its step in flight (async) is dropped, so both
    engines end it with N tokens and `abort`; the others are unaffected."""
    def add(engine):
        rng = random.Random(9)
        for i in range(6):
            engine.add_request(f"r{i}", prompt_of(rng, 8 + i), SamplingParams(max_tokens=30, temperature=1.0,
                                                                             seed=i, ignore_eos=True))

    def on_output(engine, out, results):
        if out.request_id in ("r1", "r4") and not out.finished and \
                len(results[(out.request_id, 0)]["tokens"]) == abort_at:
            engine.abort(out.request_id)

    sync, _, _, async_engine = both(model_dir, add, on_output)
    assert sync[("r1", 0)]["finish"] == "abort" and len(sync[("r1", 0)]["tokens"]) == abort_at
    assert sync[("r0", 0)]["finish"] == "length"
    assert async_engine.pool.num_free == async_engine.pool.num_blocks or async_engine.pool.num_free > 0


def test_engine_core_stop_aborts_what_is_in_flight(model_dir):
    """EngineCore's stop aborts every request while a step is in flight: each gets its final
    output and the async engine ends with nothing in flight and every block back."""
    engine = make_engine(model_dir, True, enable_prefix_caching=False)
    rng = random.Random(10)
    for i in range(4):
        engine.add_request(f"r{i}", prompt_of(rng, 10), SamplingParams(max_tokens=100, temperature=0,
                                                                      ignore_eos=True))
    results: dict = {}
    calls = iter(range(100))

    def drain_commands(block: bool) -> bool:
        return next(calls) < 6   # six steps, then stop

    EngineCore(engine, drain_commands, lambda outs: [record(results, o) for o in outs]).run()
    assert all(r["finished"] and r["finish"] == "abort" for r in results.values()) and len(results) == 4
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.close()


def test_interactive_and_batch_priorities_under_the_step_budget(model_dir):
    """With both interactive and batch requests running, the step budget pauses batch decodes:
    not planned ahead then, and the outputs still agree; once the interactive ones are done
    the batch ones are planned ahead."""
    from rein.core.priorities import PRIORITY_BATCH

    def add(engine):
        rng = random.Random(11)
        for i in range(8):
            engine.add_request(f"b{i}", prompt_of(rng, 12), SamplingParams(max_tokens=40, temperature=1.0, seed=i,
                                                                          ignore_eos=True),
                               priority=PRIORITY_BATCH)
        for i in range(2):
            engine.add_request(f"i{i}", prompt_of(rng, 6), SamplingParams(max_tokens=10, temperature=0,
                                                                         ignore_eos=True))

    _, _, _, async_engine = both(model_dir, add, interactive_step_budget=4)
    assert async_engine.stats.planned_ahead > 0
