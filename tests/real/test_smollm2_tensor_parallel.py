"""SmolLM2-135M over three tensor-parallel ranks (gloo, on CPU): its 9 query and 3 KV heads split
by 3, one KV head per rank, each rank reading only its shard of the GGUF file. Greedy answers to
the tier's prompts equal the one-rank engine's token for token, logprobs within 1e-4."""

from __future__ import annotations

import pytest
from real_support import generate

pytestmark = pytest.mark.real

LOGPROB_TOLERANCE = 1e-4


def test_three_ranks_answer_as_one(make_engine, references, rein_answers):
    engine = make_engine(tensor_parallel_size=3)
    try:
        assert engine.runner.cache_spec.num_kv_heads == 1 and engine.runner.model.layers[0].self_attn.num_heads == 3
        logprobs = [0 if answer.logprobs else None for answer in rein_answers]
        answers = generate(engine, [r.prompt for r in references], logprobs=logprobs)
    finally:
        engine.close()
    for one, three in zip(rein_answers, answers, strict=True):
        assert three.token_ids == one.token_ids
        assert three.finish_reason == one.finish_reason
        assert len(three.logprobs) == len(one.logprobs)
        assert all(abs(a - b) < LOGPROB_TOLERANCE for a, b in zip(one.logprobs, three.logprobs, strict=True))
    assert any(one.logprobs for one in rein_answers)
