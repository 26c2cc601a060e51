"""A float32 model with a float16 or bfloat16 KV cache on the CPU, end to end, against a float32
cache: on rein's C attention kernels (which read the 16-bit cache, csrc/kv_types.h) and on
torch's path (REIN_CPU_FAST_PATHS=0).

K and V are rounded to 16 bits as they are stored, so the logits move a little. Greedy tokens of
a random-weight model part ways where two logits nearly tie (seen on tiny Qwen3, 5 prompts x 16
tokens: float16 80 of 80 the same, bfloat16 54 of 80), so the check is teacher-forced, as in
test_engine_dtypes: every logprob the 16-bit-cache engine reports is compared with the float32
cache's for the same token after the same context.
"""

from __future__ import annotations

import pytest
import torch

from rein import LLM, SamplingParams
from rein.kernels import cpu_native

# Tiny Qwen3: head_dim 32, which both C kernels take (the tiny Llama's 16 is off the prefill panel).
ARCH = "qwen3"
PROMPTS = [[5 + (7 * i + j) % 300 for j in range(n)] for i, n in enumerate([3, 9, 20, 33, 70])]
MAX_TOKENS = 8
# Largest logprob difference from the float32 cache (seen: bfloat16 0.034, float16 0.0035).
TOLERANCE = {"bfloat16": 0.15, "float16": 0.02}


def make_llm(model_dir, kv_cache_dtype: str) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="16MiB",
               max_model_len=128, max_num_seqs=4)


def chosen_logprobs(entries) -> list[float]:
    return [next(iter(entry.values())).logprob for entry in entries if entry is not None]


@pytest.fixture(scope="module")
def float32_llm(tiny_models):
    return make_llm(tiny_models(ARCH), "float32")


def record_attention_calls(monkeypatch) -> list[tuple[str, torch.dtype, bool]]:
    """(kernel, cache dtype, whether the C kernel ran) for every native attention call."""
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(cpu_native, name)

        def spy(*args, real=real, name=name, **kwargs):
            out = real(*args, **kwargs)
            calls.append((name, args[1].dtype, out is not None))
            return out

        monkeypatch.setattr(cpu_native, name, spy)
    return calls


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("paths", ["fast", "torch"])
def test_16bit_cache_matches_float32_cache(tiny_models, float32_llm, kv_cache_dtype, paths, request, monkeypatch):
    request.getfixturevalue(f"cpu_fast_paths_{'on' if paths == 'fast' else 'off'}")
    calls = record_attention_calls(monkeypatch)
    llm = make_llm(tiny_models(ARCH), kv_cache_dtype)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    cache_dtype = getattr(torch, kv_cache_dtype)
    if paths == "fast":
        # prefill attention takes torch's kernel on a CPU without AVX-512 (prefill_attention_pays)
        native = ("paged_decode_attention",) + (("paged_prefill_attention",) if cpu_native.prefill_attention_pays()
                                                else ())
        assert {(name, cache_dtype, True) for name in native} == set(calls), \
            "the C kernels did not run on the 16-bit cache"
    forced = float32_llm.generate(
        [{"prompt_token_ids": p + out.outputs[0].token_ids} for p, out in zip(PROMPTS, outputs, strict=True)],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    for prompt, low, reference in zip(PROMPTS, outputs, forced, strict=True):
        got = chosen_logprobs(low.prompt_logprobs) + chosen_logprobs(low.outputs[0].logprobs)
        want = chosen_logprobs(reference.prompt_logprobs)
        assert len(got) == len(want) == len(prompt) - 1 + MAX_TOKENS
        worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
        assert worst < TOLERANCE[kv_cache_dtype], f"{kv_cache_dtype} cache ({paths} paths) is {worst:.4f} off float32"
