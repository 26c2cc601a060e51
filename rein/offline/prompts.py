"""The prompts `rein.LLM` takes, as vLLM's: text, token ids, {"prompt"} or {"prompt_token_ids"}
dicts, one or a list; each read into token ids and checked (`read_prompt`) before any request
runs, so a bad one raises ValueError naming its index and nothing has started.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# One prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
PromptType = str | Sequence[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]


@dataclass
class Prompt:
    """A prompt read: its text (None for token ids) and its token ids."""

    text: str | None
    token_ids: list[int]
    images: list | None = None   # rein.core.images.ImageInput, for a vision model (token ids expanded)


def read_prompt(index: int, prompt: PromptType, tokenizer: Any, vocab_size: int) -> Prompt:
    """One prompt of `generate` or `embed` as token ids, checked; ValueError names its index."""
    if isinstance(prompt, Mapping):
        extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
        if extra:
            raise ValueError(f"prompt {index}: unsupported keys {extra}; a prompt dict holds 'prompt' "
                             f"(text) or 'prompt_token_ids'")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise ValueError(f"prompt {index}: 'prompt' must be text, got {type(prompt).__name__}")
        else:
            raise ValueError(f"prompt {index}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if not prompt:   # refused whatever the tokenizer adds (a BOS): it asks for nothing
            raise ValueError(f"prompt {index}: the prompt is empty: give at least one character or token")
        found = Prompt(prompt, list(tokenizer.encode(prompt, add_special_tokens=True)))
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        bad = next((t for t in prompt if not is_int(t)), None)
        if bad is not None:
            raise ValueError(f"prompt {index}: token ids must be integers, got {bad!r}")
        found = Prompt(None, [int(t) for t in prompt])
    else:
        raise ValueError(f"prompt {index}: expected text, a list of token ids or a prompt dict, "
                         f"got {type(prompt).__name__}")
    return checked_prompt(index, found, vocab_size, "prompt")


def checked_prompt(index: int, prompt: Prompt, vocab_size: int, what: str) -> Prompt:
    """The checks `LLMEngine.add_request` would make later (`what`: "prompt" or "conversation"),
    made now so nothing has run."""
    if not prompt.token_ids:
        raise ValueError(f"{what} {index}: the prompt is empty: give at least one token")
    for position, token_id in enumerate(prompt.token_ids):
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{what} {index}: token id {token_id} (at position {position}) is outside "
                             f"the vocabulary: ids run from 0 to {vocab_size - 1}")
    return prompt


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of them -> a list (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(f"prompts must be text, token ids, a prompt dict or a list of these, "
                         f"got {type(prompts).__name__}")
    if prompts and all(is_int(t) for t in prompts):
        return [prompts]
    return list(prompts)


def is_conversation(messages: Any) -> bool:
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
