"""Engine behaviour beyond greedy parity: seeded sampling, stops, aborts, logprobs, the
runner thread, validation errors, and the block pool after random add/abort/step."""

from __future__ import annotations

import random
import threading

import pytest

from rein.engine import (
    ContextLengthExceeded,
    EngineClient,
    EngineConfig,
    EngineRequestError,
    LLMEngine,
    SamplingParams,
)


@pytest.fixture()
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512))


def drain(engine: LLMEngine) -> dict[str, dict]:
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "finish": None,
                                                    "logprobs": [], "stop_reason": None})
            r["tokens"].extend(out.new_token_ids)
            r["text"] += out.text_delta
            if out.logprobs:
                r["logprobs"].extend(out.logprobs)
            if out.finished:
                r["finish"] = out.finish_reason
                r["stop_reason"] = out.stop_reason
    return results


def test_seeded_sampling_is_independent_of_batch_composition(engine):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = [11, 22, 33, 44, 55]
    engine.add_request("alone", prompt, params)
    alone = drain(engine)["alone"]["tokens"]

    rng = random.Random(0)
    for i in range(5):  # others before, with different lengths and their own sampling
        engine.add_request(f"noise-{i}", [rng.randrange(5, 2000) for _ in range(rng.randint(1, 30))],
                           SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.7, ignore_eos=True))
    engine.step()
    engine.add_request("crowded", prompt, params)
    engine.add_request("noise-greedy", [7] * 9, SamplingParams(max_tokens=10, temperature=0))
    crowded = drain(engine)["crowded"]["tokens"]
    assert crowded == alone

    engine.add_request("other-seed", prompt, SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9,
                                                            seed=99, ignore_eos=True))
    assert drain(engine)["other-seed"]["tokens"] != alone


def test_stop_string_cuts_output_exactly(engine):
    engine.add_request("free", [101, 102, 103], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    full = drain(engine)["free"]["text"]
    assert len(full) > 12
    stop = full[8:11]
    engine.add_request("stopped", [101, 102, 103],
                       SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))
    result = drain(engine)["stopped"]
    assert result["text"] == full[: full.index(stop)]
    assert result["finish"] == "stop" and result["stop_reason"] == stop


def test_stop_token_ids_and_max_tokens(engine):
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens = drain(engine)["free"]["tokens"]
    engine.add_request("tok", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                        stop_token_ids=[tokens[4]]))
    result = drain(engine)["tok"]
    first = tokens.index(tokens[4])
    assert result["tokens"] == tokens[: first + 1]
    assert result["finish"] == "stop" and result["stop_reason"] == tokens[4]
    engine.add_request("len", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    result = drain(engine)["len"]
    assert len(result["tokens"]) == 3 and result["finish"] == "length"


def test_logprobs_returned_with_alternatives(engine):
    engine.add_request("lp", [9, 8, 7], SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True))
    result = drain(engine)["lp"]
    assert len(result["logprobs"]) == 5
    for token, entry in zip(result["tokens"], result["logprobs"], strict=True):
        assert entry.token_id == token
        assert len(entry.top) == 3
        assert entry.top[0][0] == token  # greedy picks the top alternative
        assert entry.logprob == pytest.approx(entry.top[0][1])
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]


def test_abort_frees_blocks_and_reports_abort(engine):
    engine.add_request("long", list(range(10, 60)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.pool.num_used > 0
    assert engine.abort("long")
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("long", True, "abort")]
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished()
    assert not engine.abort("long")


def test_validation_errors_are_clear(engine):
    with pytest.raises(ContextLengthExceeded) as info:
        engine.add_request("big", [5] * 500, SamplingParams(max_tokens=100))
    assert "512" in str(info.value) and "500" in str(info.value) and "100" in str(info.value)
    with pytest.raises(EngineRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(EngineRequestError, match="vocabulary"):
        engine.add_request("oov", [10**6], SamplingParams())
    engine.add_request("dup", [5], SamplingParams(max_tokens=1))
    with pytest.raises(EngineRequestError, match="already"):
        engine.add_request("dup", [5], SamplingParams(max_tokens=1))
    drain(engine)


def test_randomized_add_abort_step_leaves_no_blocks(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=24 * 16 * 2 * 2 * 2 * 16 * 4,
                                    max_model_len=128, max_num_seqs=8, max_num_batched_tokens=40))
    assert engine.pool.num_blocks == 24
    rng = random.Random(7)
    live: list[str] = []
    for i in range(150):
        op = rng.random()
        if op < 0.3:
            rid = f"r{i}"
            engine.add_request(rid, [rng.randrange(5, 2000) for _ in range(rng.randint(1, 60))],
                               SamplingParams(max_tokens=rng.randint(1, 60), temperature=rng.choice([0, 1]),
                                              ignore_eos=True))
            live.append(rid)
        elif op < 0.4 and live:
            engine.abort(rng.choice(live))
        else:
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
    assert not live
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.stats.preemptions > 0


def test_runner_streams_from_many_threads(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=256))
    expected = {}
    for i in range(6):
        engine.add_request(f"ref{i}", [20 + i] * (i + 1), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for rid, r in drain(engine).items():
        expected[rid.replace("ref", "")] = r["text"]

    results: dict[str, str] = {}
    with EngineClient(engine) as runner:
        def client(i: int) -> None:
            stream = runner.submit(f"c{i}", [20 + i] * (i + 1),
                                   SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            results[str(i)] = "".join(out.text_delta for out in stream)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        with pytest.raises(ContextLengthExceeded):
            runner.submit("too-long", [5] * 300, SamplingParams(max_tokens=8))
        slow = runner.submit("slow", [5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        first = slow.get(timeout=30)
        assert not first.finished
        slow.abort()
        last = [o for o in slow][-1]
        assert last.finished and last.finish_reason == "abort"
    assert results == expected
    assert not runner.alive
    assert engine.pool.num_free == engine.pool.num_blocks


def test_runner_stop_ends_open_streams(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=256))
    runner = EngineClient(engine).start()
    stream = runner.submit("x", [5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    stream.get(timeout=30)
    runner.stop(timeout=10)
    assert not runner.alive
    outputs = []
    with pytest.raises(Exception):  # noqa: B017 - either the abort output then the stop error
        while True:
            outputs.append(stream.get(timeout=5))
    assert outputs and outputs[-1].finish_reason == "abort"


def test_collecting_stream_hands_over_the_whole_result_at_the_end(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=256))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    with EngineClient(engine) as runner:
        streamed = list(runner.submit("one-by-one", [30, 31, 32], params))
        stream = runner.submit("collected", [30, 31, 32], params, collect=True)
        assert stream.wait(timeout=60)
        collected = stream.collected
        assert collected.text == "".join(o.text_delta for o in streamed)
        assert collected.token_ids == [t for o in streamed for t in o.new_token_ids] and len(collected.token_ids) == 12
        assert [lp.token_id for lp in collected.logprobs] == collected.token_ids
        assert collected.final.finished and collected.final.finish_reason == "length"
        assert collected.first_token_at is not None and collected.first_token_monotonic is not None

        slow = runner.submit("slow", [5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                             collect=True)
        assert not slow.wait(timeout=0.01)   # still running: a timeout, not an end
        slow.abort()
        assert slow.wait(timeout=30) and slow.collected.final.finish_reason == "abort"

        stopped = runner.submit("stopped", [5, 6], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                                collect=True)
    # Stopping the runner aborts what still runs: the collecting stream ends with that abort.
    assert stopped.wait(timeout=10) and stopped.collected.final.finish_reason == "abort"
