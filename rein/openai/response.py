"""OpenAI response bodies: a finished request's completion or chat body, its usage and its
logprobs, with token texts as OpenAI shows them.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any

from rein.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS

if TYPE_CHECKING:
    from rein.engine.step_outputs import TokenLogprob

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's `usage` object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def build_response(endpoint: str, request_id: str, model_name: str, prompt_tokens: int, text: str,
                   token_ids: list[int], finish_reason: str | None, logprobs: list[TokenLogprob] | None,
                   tokenizer: Any, logprobs_mode: int | None, created: int | None = None,
                   cached_tokens: int = 0) -> dict[str, Any]:
    """The body OpenAI returns for a finished, non-streamed request."""
    created = int(time.time()) if created is None else created
    finish = _FINISH_REASONS.get(finish_reason, finish_reason) if finish_reason else None
    usage = usage_body(prompt_tokens, len(token_ids), cached_tokens)
    want_logprobs = logprobs_mode is not None and logprobs is not None
    if endpoint == CHAT_COMPLETIONS:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": _chat_logprobs_body(logprobs, tokenizer) if want_logprobs else None,
            "finish_reason": finish,
        }
        return {"id": _with_prefix("chatcmpl-", request_id), "object": "chat.completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage}
    if endpoint == COMPLETIONS:
        choice = {
            "text": text,
            "index": 0,
            "logprobs": _completion_logprobs_body(logprobs, tokenizer) if want_logprobs else None,
            "finish_reason": finish,
        }
        return {"id": _with_prefix("cmpl-", request_id), "object": "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage}
    raise ValueError(f"unknown endpoint {endpoint!r}")


def _with_prefix(prefix: str, request_id: str) -> str:
    return request_id if request_id.startswith(prefix) else prefix + request_id


def _chat_logprobs_body(logprobs: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    texts = _TokenTexts(tokenizer)

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.bytes(token_id))}

    return {"content": [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in logprobs
    ]}


def _completion_logprobs_body(logprobs: list[TokenLogprob], tokenizer: Any) -> dict[str, Any]:
    texts = _TokenTexts(tokenizer)
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for lp in logprobs:
        token = texts.text(lp.token_id)
        tokens.append(token)
        token_logprobs.append(lp.logprob)
        # OpenAI: the chosen token is always among the top logprobs, so up to logprobs + 1.
        top = {texts.text(t): v for t, v in lp.top}
        top.setdefault(token, lp.logprob)
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


_SENTENCEPIECE_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the byte each byte-level vocabulary character means."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


_BYTE_LEVEL = _byte_level_table()


class _TokenTexts:
    """Token id -> its text and its exact bytes, cached for one response."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._text[token_id]

    def bytes(self, token_id: int) -> bytes:
        text = self.text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        # Part of a multi-byte character: the decoded text lost the bytes, the vocabulary has them.
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            match = _SENTENCEPIECE_BYTE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            if _is_byte_level(self.tokenizer) and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode("utf-8")


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"
