"""Tests for ModelRunner._plan's inline decode rows: they must lay out exactly what the general
row code lays out for the same requests (input ids, positions, slots, sampled rows, block tables),
and the step tensors built from the plan must hold the plan's values."""

from __future__ import annotations

import dataclasses

import torch

from rein.engine import EngineConfig, LLMEngine, SamplingParams


def _engine_mid_decode(model_dir) -> LLMEngine:
    """An engine whose requests are decoding, one of them with a prompt still being prefilled."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="8MiB", max_model_len=512,
                                    block_size=16, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)
    for i in range(6):   # contexts that cross block boundaries at different steps
        engine.add_request(f"d{i}", [1 + (i * 5 + k) % 500 for k in range(3 + 7 * i)], params)
    for _ in range(6):
        engine.step()
    engine.add_request("long", [7 + k % 300 for k in range(150)], params)   # chunked over steps
    return engine


def _plan_fields(plan) -> dict:
    fields = dataclasses.asdict(plan)
    fields.pop("image_rows"), fields.pop("mrope_rows")
    return fields


def test_inline_decode_rows_match_the_general_rows(model_dir):
    engine = _engine_mid_decode(model_dir)
    runner = engine.runner
    checked_mixed = False
    for _ in range(12):
        scheduled = engine.scheduler.schedule().scheduled
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        assert decodes
        checked_mixed |= len(decodes) < len(scheduled)
        inline, (sampling, _, _) = runner._plan(scheduled)
        # A prompt_logprobs list sends a decode through the general row code; a decode past its
        # prompt scores nothing, so the plan must come out the same.
        for s in decodes:
            s.request.prompt_logprobs = []
        general, (general_sampling, scoring, _) = runner._plan(scheduled)
        for s in decodes:
            s.request.prompt_logprobs = None
        assert not scoring
        assert _plan_fields(inline) == _plan_fields(general)
        assert sampling == general_sampling
        # And against the definition: decode rows first, by context length.
        ordered = sorted(decodes, key=lambda s: s.end)
        bs = runner.block_size
        assert inline.input_ids[:len(ordered)] == [s.request.token_at(s.start) for s in ordered]
        assert inline.positions[:len(ordered)] == [s.start for s in ordered]
        assert inline.slots[:len(ordered)] == [s.request.block_ids[s.start // bs] * bs + s.start % bs
                                               for s in ordered]
        _finish_step(engine, scheduled)
    assert checked_mixed


def _finish_step(engine: LLMEngine, scheduled) -> None:
    """Run the step the plan was made for, so the next plan moves on."""
    from rein.engine.scheduler_output import SchedulerOutput

    result = engine.runner.execute(scheduled)
    output, _, _ = engine._sample(result)
    engine.scheduler.update(SchedulerOutput(scheduled=scheduled), output)


def test_step_tensors_hold_the_plan(model_dir):
    engine = _engine_mid_decode(model_dir)
    runner = engine.runner
    plan, _ = runner._plan(engine.scheduler.schedule().scheduled)
    table = runner._table(plan.decode_rows)
    assert table.dtype == torch.int32 and table.tolist() == plan.decode_rows
    slots = runner._tensor(plan.slots, torch.int64)
    assert slots.dtype == torch.int64 and slots.tolist() == plan.slots
    lens = runner._tensor(plan.decode_lens, torch.int32)
    assert lens.dtype == torch.int32 and lens.tolist() == plan.decode_lens
    assert runner._tensor([], torch.int64).shape == (0,)
