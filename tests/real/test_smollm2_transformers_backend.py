"""SmolLM2 through the Transformers backend (`--model-impl transformers`: transformers' own Llama
code with rein's paged attention) gives the native code's greedy tokens on the tier's prompts."""

from __future__ import annotations

import pytest
from real_support import REPORT, generate, leading_match

pytestmark = pytest.mark.real


def test_the_transformers_backend_matches_native_greedy(make_engine, references, rein_answers):
    engine = make_engine(model_impl="transformers")
    assert engine.spec.family == "transformers"
    got = generate(engine, [r.prompt for r in references], logprobs=[0] * len(references))
    differ = [f"{ref.text!r}: same first {leading_match(native.token_ids, mine.token_ids)} tokens"
              for ref, native, mine in zip(references, rein_answers, got, strict=True)
              if mine.token_ids != native.token_ids]
    worst = max(abs(a - b) for native, mine in zip(rein_answers, got, strict=True)
                for a, b in zip(native.logprobs, mine.logprobs, strict=False))
    REPORT.append(f"Transformers backend vs native: {len(got) - len(differ)}/{len(got)} prompts equal; "
                  f"chosen-token logprobs differ by at most {worst:.2e}")
    assert not differ, "the Transformers backend's greedy answers differ from native:\n" + "\n".join(differ)
