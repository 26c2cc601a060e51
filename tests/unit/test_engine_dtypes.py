"""The engine in bfloat16 and float16 on the CPU, end to end, against float32.

On every CPU: where oneDNN has no low-precision primitive (an AVX2-only CPU) the linears run on
torch, elsewhere on oneDNN, and with REIN_CPU_FAST_PATHS=0 on torch everywhere. Greedy tokens of
a random-weight model may part ways between dtypes where two logits nearly tie, so the check is
teacher-forced: every logprob the low-precision engine reports (the prompt's, from prefill, and
the generated tokens', from decode steps) is compared with float32's for the same token after
the same context.
"""

from __future__ import annotations

import pytest

from rein import LLM, SamplingParams

PROMPTS = [[5 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate([3, 9, 20, 33])]
MAX_TOKENS = 8
# Largest logprob difference from float32 (seen: bfloat16 0.10, float16 0.01 on the tiny model).
TOLERANCE = {"bfloat16": 0.3, "float16": 0.05}


def make_llm(model_dir, dtype: str) -> LLM:
    return LLM(str(model_dir), dtype=dtype, kv_cache_memory="16MiB", max_model_len=128, max_num_seqs=4)


def chosen_logprobs(entries) -> list[float]:
    """The logprob of the token each entry was for (the first key: the chosen or prompt token)."""
    return [next(iter(entry.values())).logprob for entry in entries if entry is not None]


@pytest.fixture(scope="module")
def float32_llm(tiny_models):
    return make_llm(tiny_models("llama"), "float32")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_engine_matches_float32(tiny_models, float32_llm, dtype, request):
    for fast_paths in ("fast", "torch"):
        request.getfixturevalue(f"cpu_fast_paths_{'on' if fast_paths == 'fast' else 'off'}")
        llm = make_llm(tiny_models("llama"), dtype)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        # float32 over each prompt followed by what the low-precision engine generated
        forced = float32_llm.generate(
            [{"prompt_token_ids": p + out.outputs[0].token_ids} for p, out in zip(PROMPTS, outputs, strict=True)],
            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
        for prompt, low, reference in zip(PROMPTS, outputs, forced, strict=True):
            completion = low.outputs[0]
            assert len(completion.token_ids) == MAX_TOKENS
            got = chosen_logprobs(low.prompt_logprobs) + chosen_logprobs(completion.logprobs)
            want = chosen_logprobs(reference.prompt_logprobs)
            assert len(got) == len(want) == len(prompt) - 1 + MAX_TOKENS
            worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
            assert worst < TOLERANCE[dtype], f"{dtype} ({fast_paths} paths) is {worst:.3f} off float32"
