"""The auto-mode tool call formats by name (`--tool-call-parser`, REIN_TOOL_CALL_PARSER, vLLM's
names): hermes, llama3_json, mistral, qwen3_coder; and the format a chat template teaches its
model, for a model served without the setting (`detect_tool_call_parser`).

Detection reads the template's text, most specific first: ``<function=`` (Qwen3-Coder's XML)
-> qwen3_coder, ``[TOOL_CALLS]`` -> mistral, ``<|python_tag|>`` or Llama 3's ``ipython`` role
-> llama3_json, ``<tool_call>`` -> hermes; anything else -> hermes, rein's default.

The parser a request is answered with is chosen when the request is accepted and stored with
the job (`params["tool_parser"]`), so a body rebuilt later from Postgres parses the same way
even if the setting changed since. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rein.core.tool_call_parser_names import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    QWEN3_CODER,
    TOOL_CALL_PARSERS,
)
from rein.openai.tool_parser_qwen3_coder import Qwen3CoderParser
from rein.openai.tool_parsers import TOOL_CALL_END, AnswerParser, HermesParser
from rein.openai.tool_parsers_json import Llama3JsonParser, MistralParser

PARSERS: dict[str, type[AnswerParser]] = {
    HERMES: HermesParser,
    LLAMA3_JSON: Llama3JsonParser,
    MISTRAL: MistralParser,
    QWEN3_CODER: Qwen3CoderParser,
}
assert tuple(PARSERS) == TOOL_CALL_PARSERS

# What ends one call, for parallel_tool_calls false (a stop string); formats with no closing
# tag have none, and their answers keep the calls the model wrote (as vLLM's).
CALL_END: dict[str, str | None] = {HERMES: TOOL_CALL_END, QWEN3_CODER: TOOL_CALL_END, LLAMA3_JSON: None, MISTRAL: None}

# Formats whose marker is a special token the answer must keep (skip_special_tokens false by default).
KEEPS_SPECIAL_TOKENS = frozenset({MISTRAL})


def check_tool_call_parser(name: str) -> str:
    """`name` if rein has that parser; else ValueError naming them."""
    if name not in PARSERS:
        raise ValueError(f"tool call parser {name!r} is not supported: use one of {', '.join(TOOL_CALL_PARSERS)}")
    return name


def new_parser(name: str | None, names: frozenset[str], seed: str,
               parameters: Mapping[str, dict[str, Any]] | None = None) -> AnswerParser:
    """A fresh parser of format `name` (None or one rein does not know: hermes)."""
    return PARSERS.get(name or HERMES, HermesParser)(names, seed, parameters)


def detect_tool_call_parser(chat_template: Any) -> str:
    """The format a chat template (a string, or transformers' named templates) teaches; hermes
    when it shows none of the known ones."""
    if isinstance(chat_template, dict):
        chat_template = " ".join(v for v in chat_template.values() if isinstance(v, str))
    elif isinstance(chat_template, list):    # [{"name": ..., "template": ...}] as in tokenizer_config.json
        chat_template = " ".join(t.get("template", "") for t in chat_template if isinstance(t, dict))
    if not isinstance(chat_template, str):
        return HERMES
    if "<function=" in chat_template:
        return QWEN3_CODER
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return LLAMA3_JSON
    return HERMES
