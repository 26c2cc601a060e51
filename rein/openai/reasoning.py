"""Reasoning models: their thinking split out of the answer, as vLLM's `--reasoning-parser` does.

A reasoning model (Qwen3, the DeepSeek-R1 distills) writes ``<think>…</think>`` before its
answer. With a reasoning parser set for the model (REIN_REASONING_PARSER, `--reasoning-parser`),
a chat answer's thinking goes to `message.reasoning_content` (streamed: `delta.reasoning_content`;
both also as `reasoning`, newer vLLM's name) and the rest to `content`; tool calls are parsed from the content alone, and
`usage.completion_tokens_details.reasoning_tokens` counts the thinking's tokens. The parsers,
by vLLM's names (vllm/reasoning/):

* ``deepseek_r1``: the chat template has already opened ``<think>`` (a ``<think>`` the model
  writes first anyway is dropped), so everything before the first ``</think>`` is reasoning, and
  an answer that never writes ``</think>`` (cut by max_tokens) is all reasoning.
  Also the parser for templates that open the think block themselves, such as Qwen3's
  thinking-2507 models'.
* ``qwen3``: the model opens its own ``<think>``: there is reasoning only when the answer begins
  with ``<think>`` (after whitespace); otherwise (``enable_thinking: false``) it is all content.
  A ``<think>`` never closed makes the rest reasoning.

A prompt that already closed the thinking (the last think tag in it is ``</think>``, as in
Qwen3's template with ``enable_thinking: false``, vLLM's `is_reasoning_end`) has no thinking to
split: its answer is all content, and a structured output applies from the first token.

What travels with a request is a `Reasoning` (a job's params["reasoning"]): the parser's name,
the token ids of its tags and whether the prompt ended the thinking, so bodies rebuilt from
Postgres need no tokenizer. Structured outputs wait for the end-of-think token
(SamplingParams.structured_after_token_id, set by rein.openai.request).

Torch-free: the API imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParserError(ValueError):
    """An unknown parser name, or a model whose vocabulary lacks the parser's tags."""


@dataclass(frozen=True)
class ReasoningParser:
    """One of vLLM's reasoning parsers. `opened_by_template`: the template opened the think block,
    so text before the end tag is reasoning even without a start tag (deepseek_r1)."""

    name: str
    opened_by_template: bool
    start: str = THINK_START
    end: str = THINK_END


PARSERS = {
    "deepseek_r1": ReasoningParser("deepseek_r1", opened_by_template=True),
    "qwen3": ReasoningParser("qwen3", opened_by_template=False),
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ReasoningParserError listing the choices otherwise."""
    parser = PARSERS.get(name)
    if parser is None:
        raise ReasoningParserError(f"unknown reasoning parser {name!r}: choose one of {', '.join(sorted(PARSERS))} "
                                   f"(--reasoning-parser / REIN_REASONING_PARSER)")
    return parser


@dataclass(frozen=True)
class Reasoning:
    """The reasoning parser as one request runs under it (plain JSON in a job's params)."""

    parser: str
    start_token_id: int
    end_token_id: int
    # The prompt closed the think block itself: the answer is all content.
    ended_in_prompt: bool = False

    @property
    def spec(self) -> ReasoningParser:
        return reasoning_parser(self.parser)

    def to_dict(self) -> dict[str, Any]:
        return {"parser": self.parser, "start_token_id": self.start_token_id, "end_token_id": self.end_token_id,
                "ended_in_prompt": self.ended_in_prompt}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Reasoning | None:
        if not data:
            return None
        return cls(str(data["parser"]), int(data["start_token_id"]), int(data["end_token_id"]),
                   bool(data.get("ended_in_prompt", False)))


def think_token_ids(parser: ReasoningParser, tokenizer: Any, model: str = "the model") -> tuple[int, int]:
    """The token ids of the parser's start and end tags in `tokenizer`'s vocabulary; each must be
    one token (ReasoningParserError naming the model otherwise: checked when a model is loaded)."""
    ids = []
    for tag in (parser.start, parser.end):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise ReasoningParserError(
                f"reasoning parser {parser.name!r} needs {tag!r} to be one token of {model}'s vocabulary, but the "
                f"tokenizer makes it {len(encoded)} tokens: set the reasoning parser only for reasoning models "
                f"(REIN_REASONING_PARSER=name=parser for one of several models)")
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


def reasoning_for_prompt(parser: ReasoningParser, start_token_id: int, end_token_id: int,
                         prompt_token_ids: Sequence[int]) -> Reasoning:
    """The Reasoning of a request whose prompt is `prompt_token_ids` (vLLM's is_reasoning_end:
    the last think tag of the prompt decides whether the thinking is over already)."""
    ended = False
    for token in reversed(prompt_token_ids):
        if token == start_token_id:
            break
        if token == end_token_id:
            ended = True
            break
    return Reasoning(parser.name, start_token_id, end_token_id, ended)


@dataclass(frozen=True)
class ModelReasoning:
    """A served model's reasoning parser with its tags' token ids (set when the model is loaded)."""

    parser: ReasoningParser
    start_token_id: int
    end_token_id: int

    @classmethod
    def of(cls, parser_name: str, tokenizer: Any, model: str = "the model") -> ModelReasoning:
        parser = reasoning_parser(parser_name)
        start, end = think_token_ids(parser, tokenizer, model)
        return cls(parser, start, end)

    def for_prompt(self, prompt_token_ids: Sequence[int]) -> Reasoning:
        return reasoning_for_prompt(self.parser, self.start_token_id, self.end_token_id, prompt_token_ids)


def check_parser_names(value: str | None) -> None:
    """Refuse (ReasoningParserError) a REIN_REASONING_PARSER naming an unknown parser, before any
    model is loaded (which models it names is checked against the served ones later)."""
    if value and value.strip():
        for entry in value.split(","):
            name = entry.partition("=")[2] if "=" in entry else entry
            if name.strip() or "=" not in entry:
                reasoning_parser(name.strip())


def parsers_by_model(value: str | None, model_names: Sequence[str]) -> dict[str, str]:
    """REIN_REASONING_PARSER / --reasoning-parser as {model name: parser name}: one parser name for
    every model, or `name=parser,...` for some of them (ReasoningParserError for an unknown
    parser or model name)."""
    if not value or not value.strip():
        return {}
    if "=" not in value:
        reasoning_parser(value.strip())
        return dict.fromkeys(model_names, value.strip())
    chosen: dict[str, str] = {}
    for entry in value.split(","):
        name, sep, parser = (part.strip() for part in entry.partition("="))
        if not entry.strip():
            continue
        if not sep or not name or not parser:
            raise ReasoningParserError(f"reasoning parser entry {entry.strip()!r} is not model=parser: give one "
                                       f"parser name for every model, or model=parser,... (e.g. "
                                       f"{(list(model_names) or ['qwen'])[0]}=qwen3)")
        if name not in model_names:
            raise ReasoningParserError(f"reasoning parser entry {entry.strip()!r} names model {name!r}, which is not "
                                       f"served (served: {', '.join(model_names) or 'none'})")
        reasoning_parser(parser)
        chosen[name] = parser
    return chosen


def split_reasoning(reasoning: Reasoning | ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A finished answer as (reasoning, content), each None when empty (see the module docstring)."""
    if isinstance(reasoning, Reasoning):
        if reasoning.ended_in_prompt:
            return None, text
        parser = reasoning.spec
    else:
        parser = reasoning
    if not text:
        return None, text
    stripped = text.lstrip()
    if stripped.startswith(parser.start):
        body = stripped[len(parser.start):]
    elif parser.opened_by_template:
        body = text
    else:
        return None, text
    thinking, _, content = body.partition(parser.end)
    return thinking or None, content or None


def reasoning_token_count(reasoning: Reasoning | None, token_ids: Sequence[int]) -> int:
    """How many of the generated `token_ids` are thinking: up to and including the first end tag,
    or all of them when the thinking never ended (0 without a parser, or when the prompt ended it)."""
    if reasoning is None or reasoning.ended_in_prompt:
        return 0
    end = next((i for i, t in enumerate(token_ids) if t == reasoning.end_token_id), None)
    if not reasoning.spec.opened_by_template:
        start = next((i for i, t in enumerate(token_ids) if t == reasoning.start_token_id), None)
        if start is None or (end is not None and end < start):
            return 0
    return len(token_ids) if end is None else end + 1


def apply_reasoning(response: dict[str, Any], reasoning: Reasoning | None,
                    token_ids: Sequence[Sequence[int]] | None = None,
                    reasoning_tokens: int | None = None) -> dict[str, Any]:
    """Split the thinking out of a chat.completion body's messages (in place; returned) and put
    `usage.completion_tokens_details.reasoning_tokens` in it (without a parser, `reasoning` None,
    the body is left as it is: no reasoning_content, no completion_tokens_details). `token_ids`: each choice's generated
    ids, by position, where known (a body rebuilt from Postgres has choice 0's alone); a choice
    without them is not counted. `reasoning_tokens`: the count the worker recorded over every
    choice (the job's usage row), used instead when given. Bodies of other endpoints are left as they are."""
    if reasoning is None or response.get("object") != "chat.completion":
        return response
    counted = 0
    for position, choice in enumerate(response.get("choices") or []):
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        thinking, content = split_reasoning(reasoning, message.get("content") or "")
        message["content"] = content
        message["reasoning_content"] = thinking
        message["reasoning"] = thinking   # newer vLLM's name for the same text
        if token_ids is not None and position < len(token_ids):
            counted += reasoning_token_count(reasoning, token_ids[position])
    usage = response.get("usage")
    if isinstance(usage, dict):
        usage["completion_tokens_details"] = {"reasoning_tokens": counted if reasoning_tokens is None
                                              else reasoning_tokens}
    return response


class ReasoningStream:
    """One streamed choice's text deltas in, its `reasoning_content` / `content` deltas out.

    Concatenated, the deltas equal split_reasoning of the whole text. A tag split across deltas
    is held back until it is whole (or turns out not to be a tag), so the reasoning never shows
    a partial ``</think>``; `finish` releases what was held. Each delta is looked at once (a long
    thinking is not scanned again per delta). `reasoning_tokens` counts the thinking as token
    ids come in."""

    _UNDECIDED, _THINKING, _CONTENT = "undecided", "thinking", "content"

    def __init__(self, reasoning: Reasoning) -> None:
        self.reasoning = reasoning
        self.parser = reasoning.spec
        self._state = self._CONTENT if reasoning.ended_in_prompt else self._UNDECIDED
        self._held = ""      # text not released yet: the start of the answer, or a partial end tag
        self._token_ids: list[int] = []

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[dict[str, str]]:
        """The deltas `text` releases ({"reasoning_content": ...} and/or {"content": ...})."""
        self._token_ids.extend(token_ids)
        if not text:
            return []
        if self._state == self._CONTENT:
            return [{"content": text}]
        if self._state == self._THINKING:
            return self._think(text)
        self._held += text
        stripped = self._held.lstrip()
        start = self.parser.start
        if len(stripped) < len(start) and start.startswith(stripped):
            return []   # it may yet begin with the start tag (whose leading whitespace is dropped)
        held, self._held = self._held, ""
        if stripped.startswith(start):
            self._state = self._THINKING
            return self._think(stripped[len(start):])
        if self.parser.opened_by_template:
            self._state = self._THINKING
            return self._think(held)
        self._state = self._CONTENT
        return [{"content": held}]

    def finish(self) -> list[dict[str, str]]:
        """The deltas held back until the end."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state == self._THINKING or (self._state == self._UNDECIDED and self.parser.opened_by_template):
            return [{"reasoning_content": held}]
        return [{"content": held}]

    @property
    def reasoning_tokens(self) -> int:
        return reasoning_token_count(self.reasoning, self._token_ids)

    def _think(self, text: str) -> list[dict[str, str]]:
        """Release thinking text (and what follows its end tag) in the thinking state."""
        text = self._held + text
        end = self.parser.end
        at = text.find(end)
        if at >= 0:
            self._held = ""
            self._state = self._CONTENT
            after = text[at + len(end):]
            return [d for d in ({"reasoning_content": text[:at]}, {"content": after}) if next(iter(d.values()))]
        keep = _partial_tag(text, end)
        self._held = text[len(text) - keep:] if keep else ""
        thinking = text[:len(text) - keep]
        return [{"reasoning_content": thinking}] if thinking else []


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (0: none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
