"""n > 1 through the engine: one prefill, forked choices sharing the prompt's KV blocks
(copy-on-write last block), per-choice seeds, outputs with `index`, abort and preemption."""

from __future__ import annotations

import random

import pytest
import torch
from unit_support import make_engine, prompt_of

from rein.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK = 16


def drain(engine: LLMEngine, outputs_seen: list | None = None) -> dict[tuple[str, int], dict]:
    """Step until idle; per (request id, choice index): tokens, text, finish reason."""
    results: dict[tuple[str, int], dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if outputs_seen is not None:
                outputs_seen.append(out)
            r = results.setdefault((out.request_id, out.index), {"tokens": [], "text": "", "finish": None})
            assert r["finish"] is None, "no output after a choice's finish_reason"
            r["tokens"].extend(out.new_token_ids)
            r["text"] += out.text_delta
            r["finish"] = out.finish_reason
    return results


def check_request_outputs(outputs, request_id: str, n: int) -> None:
    """The SEMANTICS of n > 1: every choice ends once; only the very last output of the
    request is `finished`, and it ends a choice."""
    mine = [o for o in outputs if o.request_id == request_id]
    ends = [o.index for o in mine if o.finish_reason is not None]
    assert sorted(ends) == list(range(n))
    assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
    assert mine[-1].finish_reason is not None


def test_n_choices_share_one_prefill_and_free_every_block(model_dir):
    engine = make_engine(model_dir)
    prompt = prompt_of(37)   # 2 full blocks + 5 tokens in a third
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request("r", prompt, params)
    first = engine.step()
    # One step computed the prompt and forked: four first tokens, all from one logits row.
    assert sorted(o.index for o in first) == [0, 1, 2, 3]
    choices = engine.requests["r"].group.choices
    assert [c.index for c in choices] == [0, 1, 2, 3]
    shared = choices[0].block_ids[:2]
    for c in choices:
        assert c.block_ids[:2] == shared
        assert c.num_computed_tokens == 37
    assert all(engine.pool.ref_count(b) == 4 for b in shared)
    lasts = {c.block_ids[2] for c in choices}
    assert len(lasts) == 4 and all(engine.pool.ref_count(b) == 1 for b in lasts)
    assert engine.pool.num_used == 2 + 4
    # The copies are made before the next forward (queued by the KV cache manager): then the
    # copied blocks hold the parent's prompt K/V (the 5 prompt slots).
    parent_last = choices[0].block_ids[2]
    seen = list(first) + engine.step()
    for cache in engine.runner.caches:
        for c in choices[1:]:
            assert torch.equal(cache.k[c.block_ids[2], :5], cache.k[parent_last, :5])
            assert torch.equal(cache.v[c.block_ids[2], :5], cache.v[parent_last, :5])

    results = drain(engine, seen)
    check_request_outputs(seen, "r", 4)
    assert engine.stats.prompt_tokens == 37   # prefilled once, not four times
    assert engine.stats.generation_tokens == 4 * 20
    texts = {results[("r", i)]["text"] for i in range(4)}
    assert len(texts) == 4, "four seeded choices should differ"
    assert all(results[("r", i)]["finish"] == "length" and len(results[("r", i)]["tokens"]) == 18
               for i in range(4))   # plus the first two tokens each, from the first two steps
    assert engine.pool.num_free == engine.pool.num_blocks
    assert "r" not in engine.requests and not engine.has_unfinished()


# The prompt ends on a block boundary (nothing to copy) or inside one; the int8 cache copies
# its scales with the block.
@pytest.mark.parametrize(("length", "kv_cache_dtype"), [(32, "auto"), (37, "auto"), (37, "int8")])
def test_choice_i_equals_a_single_request_seeded_seed_plus_i(model_dir, length, kv_cache_dtype):
    prompt = prompt_of(length, seed=1)
    params = SamplingParams(n=3, max_tokens=16, temperature=0.9, top_p=0.95, seed=100, ignore_eos=True)
    engine = make_engine(model_dir, kv_cache_dtype=kv_cache_dtype)
    engine.add_request("n3", prompt, params)
    together = drain(engine)
    for i in range(3):
        single = make_engine(model_dir, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
        single.add_request("one", prompt, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95,
                                                          seed=100 + i, ignore_eos=True))
        assert drain(single)[("one", 0)]["tokens"] == together[("n3", i)]["tokens"]


def test_seeded_choices_are_reproducible_in_a_crowded_batch(model_dir):
    prompt = prompt_of(21, seed=2)
    params = SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    engine = make_engine(model_dir, max_num_batched_tokens=64)
    engine.add_request("alone", prompt, params)
    alone = drain(engine)

    rng = random.Random(0)
    crowded = make_engine(model_dir, max_num_batched_tokens=64)
    for i in range(6):
        crowded.add_request(f"noise-{i}", prompt_of(rng.randint(1, 50), seed=10 + i),
                            SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.7, ignore_eos=True,
                                           n=rng.choice([1, 2, 3])))
    crowded.step()
    crowded.add_request("crowded", prompt, params)
    crowded.add_request("greedy-n", prompt, SamplingParams(n=2, max_tokens=10, temperature=0))
    got = drain(crowded)
    for i in range(4):
        assert got[("crowded", i)]["tokens"] == alone[("alone", i)]["tokens"]
    assert crowded.pool.num_free == crowded.pool.num_blocks


def test_greedy_choices_equal_each_other_and_the_single_request(model_dir):
    prompt = prompt_of(19, seed=3)
    engine = make_engine(model_dir)
    engine.add_request("g", prompt, SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_request("one", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    results = drain(engine)
    assert results[("g", 0)]["tokens"] == results[("g", 1)]["tokens"] == results[("one", 0)]["tokens"]


def test_prompt_computed_once_with_chunked_prefill_and_no_prefix_cache(model_dir):
    engine = make_engine(model_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    engine.add_request("c", prompt_of(37, seed=4), SamplingParams(n=5, max_tokens=6, temperature=1.0, seed=1,
                                                                     ignore_eos=True))
    seen: list = []
    results = drain(engine, seen)
    check_request_outputs(seen, "c", 5)
    assert engine.stats.prompt_tokens == 37
    assert all(len(results[("c", i)]["tokens"]) == 6 for i in range(5))
    assert engine.pool.num_free == engine.pool.num_blocks


def test_choices_end_on_their_own_and_finished_marks_the_last(model_dir):
    engine = make_engine(model_dir)
    prompt = prompt_of(9, seed=5)
    engine.add_request("probe", prompt, SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=3,
                                                        ignore_eos=True))
    probe = drain(engine)
    # Stop choice 1 at its 4th token: the other choices go on to max_tokens.
    stop_token = probe[("probe", 1)]["tokens"][3]
    assert stop_token not in probe[("probe", 0)]["tokens"] + probe[("probe", 2)]["tokens"]
    engine.add_request("s", prompt, SamplingParams(n=3, max_tokens=30, temperature=1.0, seed=3, ignore_eos=True,
                                                    stop_token_ids=[stop_token]))
    seen: list = []
    results = drain(engine, seen)
    check_request_outputs(seen, "s", 3)
    assert results[("s", 1)]["finish"] == "stop" and len(results[("s", 1)]["tokens"]) == 4
    assert results[("s", 0)]["finish"] == results[("s", 2)]["finish"] == "length"
    ends = [o for o in seen if o.finish_reason is not None]
    assert ends[0].index == 1 and not ends[0].finished
    assert all(o.num_prompt_tokens == 9 for o in seen)
    assert {o.index: o.num_output_tokens for o in ends} == {0: 30, 1: 4, 2: 30}


def test_max_tokens_1_ends_every_choice_at_the_fork(model_dir):
    engine = make_engine(model_dir)
    engine.add_request("one", prompt_of(20), SamplingParams(n=3, max_tokens=1, temperature=1.0, seed=0,
                                                            ignore_eos=True))
    seen = engine.step()
    assert sorted(o.index for o in seen) == [0, 1, 2]
    check_request_outputs(seen, "one", 3)
    assert not engine.has_unfinished() and engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding"])
def test_abort_ends_every_choice_and_frees_everything(model_dir, when):
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    engine.add_request("a", prompt_of(40), SamplingParams(n=4, max_tokens=100, temperature=1.0, seed=9,
                                                          ignore_eos=True))
    seen: list = []
    steps = {"waiting": 0, "prefilling": 1, "decoding": 5}[when]
    for _ in range(steps):
        seen.extend(engine.step())
    assert engine.abort("a")
    assert not engine.abort("a")   # already aborted
    seen.extend(engine.step())
    check_request_outputs(seen, "a", 4)
    ends = [o for o in seen if o.finish_reason is not None]
    assert all(o.finish_reason == "abort" for o in ends)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished() and "a" not in engine.requests
    assert engine.scheduler._reserved_seqs == 0


def test_preempted_choices_recompute_and_give_the_same_tokens(model_dir):
    prompt = prompt_of(20, seed=6)
    params = SamplingParams(n=4, max_tokens=60, temperature=0.8, seed=21, ignore_eos=True)
    roomy = make_engine(model_dir)
    roomy.add_request("p", prompt, params)
    expected = drain(roomy)

    spec = roomy.spec
    block_bytes = spec.kv_bytes_per_token(torch.float32) * BLOCK
    # 6 blocks = 96 slots for four choices of up to 80 tokens: they must take turns.
    tiny = make_engine(model_dir, kv_cache_memory=6 * block_bytes, max_model_len=96)
    assert tiny.pool.num_blocks == 6
    tiny.add_request("p", prompt, params)
    seen: list = []
    got = drain(tiny, seen)
    assert tiny.stats.preemptions > 0
    check_request_outputs(seen, "p", 4)
    for i in range(4):
        assert got[("p", i)]["tokens"] == expected[("p", i)]["tokens"]
    assert tiny.pool.num_free == tiny.pool.num_blocks


def test_running_choices_never_exceed_max_num_seqs(model_dir):
    engine = make_engine(model_dir, max_num_seqs=4)
    schedule = engine.scheduler.schedule
    peaks: list[int] = []

    def spy():
        peaks.append(len(engine.scheduler.running))   # after the last step's forks
        plan = schedule()
        peaks.append(len(engine.scheduler.running))
        # Below the limit, the slots kept for future choices count too.
        if engine.scheduler._reserved_seqs and len(engine.scheduler.running) > 1:
            peaks.append(len(engine.scheduler.running) + engine.scheduler._reserved_seqs)
        return plan

    engine.scheduler.schedule = spy
    engine.add_request("single", prompt_of(10), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    engine.add_request("n3", prompt_of(12, seed=1), SamplingParams(n=3, max_tokens=20, temperature=1.0, seed=5,
                                                                   ignore_eos=True))
    engine.add_request("n6", prompt_of(14, seed=2), SamplingParams(n=6, max_tokens=8, temperature=1.0, seed=6,
                                                                   ignore_eos=True))
    engine.add_request("late", prompt_of(8, seed=3), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    seen: list = []
    results = drain(engine, seen)
    assert max(peaks) <= 4
    for rid, n in (("single", 1), ("n3", 3), ("n6", 6), ("late", 1)):
        check_request_outputs(seen, rid, n)
    # n6 > max_num_seqs: the choices that found no slot waited and recomputed (their prompt
    # counted again), with the same tokens as when they all fit.
    assert engine.stats.prompt_tokens > 10 + 12 + 14 + 8
    roomy = make_engine(model_dir)
    roomy.add_request("n6", prompt_of(14, seed=2), SamplingParams(n=6, max_tokens=8, temperature=1.0, seed=6,
                                                                  ignore_eos=True))
    expected = drain(roomy)
    for i in range(6):
        assert results[("n6", i)]["tokens"] == expected[("n6", i)]["tokens"]
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.scheduler._reserved_seqs == 0


def test_prefix_cache_hit_then_fork(model_dir):
    prompt = prompt_of(40, seed=8)
    engine = make_engine(model_dir)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    drain(engine)
    engine.add_request("hit", prompt, SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=4, ignore_eos=True))
    seen: list = []
    results = drain(engine, seen)
    assert {o.num_cached_tokens for o in seen} == {32}
    cold = make_engine(model_dir, enable_prefix_caching=False)
    cold.add_request("hit", prompt, SamplingParams(n=3, max_tokens=10, temperature=0.9, seed=4, ignore_eos=True))
    expected = drain(cold)
    for i in range(3):
        assert results[("hit", i)]["tokens"] == expected[("hit", i)]["tokens"]
    assert engine.pool.num_used == 0


def test_randomized_n_add_abort_step_leaves_no_blocks(model_dir):
    engine = make_engine(model_dir, kv_cache_memory=24 * 16 * 2 * 2 * 2 * 16 * 4, max_model_len=128,
                         max_num_seqs=8, max_num_batched_tokens=40)
    assert engine.pool.num_blocks == 24
    rng = random.Random(11)
    live: dict[str, int] = {}
    seen: list = []

    def step():
        for out in engine.step():
            seen.append(out)
            if out.finished:
                del live[out.request_id]

    for i in range(150):
        op = rng.random()
        if op < 0.3:
            rid, n = f"r{i}", rng.choice([1, 1, 2, 3, 5])
            engine.add_request(rid, prompt_of(rng.randint(1, 50), seed=i),
                               SamplingParams(n=n, max_tokens=rng.randint(1, 40), temperature=rng.choice([0, 1]),
                                              ignore_eos=True))
            live[rid] = n
        elif op < 0.4 and live:
            engine.abort(rng.choice(sorted(live)))
        else:
            step()
    while engine.has_unfinished():
        step()
    assert not live
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.scheduler._reserved_seqs == 0 and engine._num_unforked == 0
    assert engine.stats.preemptions > 0
    for rid in {o.request_id for o in seen}:
        n = max(o.index for o in seen if o.request_id == rid) + 1
        check_request_outputs(seen, rid, n)


def run_mixed(engine: LLMEngine) -> tuple[dict, list]:
    """n > 1 and prompt-logprob requests under a budget of 2 tokens per step: one decoding
    request plus a prompt advancing one token a step, so most steps are decode-only (the
    CUDA-graph path) while prompt positions are scored and choices fork."""
    engine.add_request("lead", prompt_of(6, seed=20), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.add_request("n3", prompt_of(21, seed=21), SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=8,
                                                                    ignore_eos=True, prompt_logprobs=2))
    seen: list = []
    return drain(engine, seen), seen


def test_forks_and_prompt_logprobs_on_the_static_decode_path(model_dir):
    from rein.engine.cuda_graphs import DecodeGraphs

    expected, expected_seen = run_mixed(make_engine(model_dir, max_num_batched_tokens=2, max_num_seqs=8))
    engine = make_engine(model_dir, max_num_batched_tokens=2, max_num_seqs=8)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, max_num_seqs=8,
                          max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
                          device=runner.device, capture=False)
    calls: list[int] = []
    plain_run = graphs.run
    graphs.run = lambda input_ids, *args: (calls.append(len(input_ids)), plain_run(input_ids, *args))[1]
    runner.decode_graphs = graphs
    got, seen = run_mixed(engine)
    assert calls, "decode-only steps must have taken the static path"
    assert got == expected
    lp = next(o.prompt_logprobs for o in seen if o.prompt_logprobs is not None)
    lp_expected = next(o.prompt_logprobs for o in expected_seen if o.prompt_logprobs is not None)
    assert len(lp) == 21 and [e.token_id for e in lp[1:]] == [e.token_id for e in lp_expected[1:]]
    assert [e.logprob for e in lp[1:]] == pytest.approx([e.logprob for e in lp_expected[1:]], abs=1e-4)
    assert engine.pool.num_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_forks_on_cuda_with_graphs_give_the_eager_tokens(model_dir):
    eager = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_cache_memory="8MiB",
                                   max_model_len=256, max_num_batched_tokens=2, max_num_seqs=8, enforce_eager=True))
    expected, _ = run_mixed(eager)
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", dtype="float32", kv_cache_memory="8MiB",
                                    max_model_len=256, max_num_batched_tokens=2, max_num_seqs=8))
    assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.captured
    got, _ = run_mixed(engine)
    assert got == expected
    assert engine.pool.num_used == 0


def test_a_fork_copy_queued_for_blocks_freed_and_handed_out_again_is_harmless(model_dir):
    """A fork's block copy waits for the next forward (the KV cache manager queues it). When the
    choices are aborted in between and their blocks go to a new request, the copy is made
    before that request writes them: its greedy tokens are those of an engine that never forked."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = prompt_of(50, seed=5)   # 4 blocks: all the pool has
    roomy = make_engine(model_dir)
    roomy.add_request("b", prompt, greedy)
    expected = drain(roomy)[("b", 0)]["tokens"]

    block_bytes = roomy.spec.kv_bytes_per_token(torch.float32) * BLOCK
    tiny = make_engine(model_dir, kv_cache_memory=4 * block_bytes, max_model_len=64)
    assert tiny.pool.num_blocks == 4
    tiny.add_request("a", prompt_of(20, seed=6), SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=3))
    tiny.step()   # prefill and fork: the child's copy of block 2 of 2 is queued
    parent, child = tiny.requests["a"].group.choices
    source, copy = parent.block_ids[1], child.block_ids[1]
    assert tiny.pool.num_used == 3 and tiny.abort("a")
    b = tiny.add_request("b", prompt, greedy)
    first = tiny.step()
    assert {source, copy} <= set(b.block_ids), "the new request must get the copy's blocks"
    got = drain(tiny)
    got[("b", 0)]["tokens"][:0] = [t for o in first if o.request_id == "b" for t in o.new_token_ids]
    assert got[("b", 0)]["tokens"] == expected
    assert tiny.pool.num_free == tiny.pool.num_blocks
