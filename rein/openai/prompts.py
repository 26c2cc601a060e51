"""The prompt of a request as token ids: a chat body's messages through the model's chat
template (`chat_prompt`, which rein.LLM.chat shares) or a completions prompt
(`completion_prompt`), with the checks made before tokenizing (the size of the text) and
after (the ids name tokens of the model).
"""

from __future__ import annotations

import json
from typing import Any

from rein.core.input_checks import BadInput, json_type
from rein.openai.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from rein.openai.fields import get_field, is_int
from rein.openai.images import INVALID_IMAGE, PromptImages, image_count, template_content
from rein.openai.limits import MAX_CHARS_PER_TOKEN, MAX_MESSAGES
from rein.openai.tool_request import (
    ToolRequest,
    check_template,
    parse_tools,
    template_chars,
    template_message_fields,
)


def chat_prompt(body: dict[str, Any], tokenizer: Any, max_model_len: int,
                tool_request: ToolRequest | None = None, images: PromptImages | None = None) -> list[int]:
    """The prompt token ids of a chat body's messages, through the model's chat template (the API,
    batch files and `rein.LLM.chat` all build chat prompts here). The body's tools go to the
    template (rein.openai.tool_request; `tool_request`: parse_tools(body) when the caller has it already).

    `images`: a vision model's processor and the request's images, opened, in prompt order; the
    template writes one placeholder per image part and the processor expands each into its
    image's tokens (so the context check and usage count them). None: a text-only model, whose
    image parts are a 400 saying so."""
    if "messages" not in body:
        raise RequestError("'messages' is a required property", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"messages holds at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    if tool_request is None:
        tool_request = parse_tools(body)
    plain = [_plain_message(m, i, images is not None) for i, m in enumerate(messages)]
    count = sum(image_count(m["content"]) for m in plain)
    template_kwargs = _chat_template_kwargs(body, tokenizer)
    # The template may write every variable it is given into the prompt: they count too.
    check_prompt_chars(sum(_content_chars(m["content"]) for m in plain) + template_chars(plain, tool_request)
                       + (len(json.dumps(template_kwargs, ensure_ascii=False)) if template_kwargs else 0),
                       max_model_len, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions with a prompt",
                           "messages")
    check_template(tokenizer.chat_template, tool_request)
    if tool_request is not None and tool_request.template_tools is not None:
        template_kwargs["tools"] = tool_request.template_tools
    if count:
        return _expanded_prompt(plain, tokenizer, template_kwargs, images, count)  # type: ignore[arg-type]
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **template_kwargs)
    except Exception as exc:  # the template may raise anything (jinja errors, raise_exception)
        raise RequestError(f"the model's chat template rejected the messages: {exc}", "messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding despite return_dict=False
        ids = ids["input_ids"]
    ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if not ids:
        raise RequestError("the messages produced an empty prompt", "messages")
    return ids


def _expanded_prompt(plain: list[dict[str, Any]], tokenizer: Any, template_kwargs: dict[str, Any],
                     images: PromptImages, count: int) -> list[int]:
    """A prompt with images: the template's text (one placeholder per image part), tokenized by
    the vision processor with each placeholder expanded to its image's tokens."""
    if count != len(images.images):   # the caller opened the images image_refs listed: the same parts
        raise RuntimeError(f"the messages hold {count} image parts but {len(images.images)} images were opened")
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False, **template_kwargs)
    except Exception as exc:  # the template may raise anything (jinja errors, raise_exception)
        raise RequestError(f"the model's chat template rejected the messages: {exc}", "messages") from exc
    try:
        expanded = images.processor.expand(text, images.images, images.details)
    except (ValueError, BadInput) as exc:   # e.g. the template wrote fewer placeholders than images
        raise RequestError(f"the images could not be placed in the prompt: {exc}", "messages",
                           INVALID_IMAGE) from exc
    ids = [int(t) for t in expanded.token_ids]
    if not ids:
        raise RequestError("the messages produced an empty prompt", "messages")
    return ids


def _content_chars(content: str | list[dict[str, Any]]) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content)


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"})
# What a template reads but a request may not change: the special tokens (transformers passes
# them as variables, and a request's variables would win: eos_token overridden could make the
# prompt end a turn the model never sees end) and the helpers transformers provides.
_TEMPLATE_PROTECTED = frozenset({"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                 "mask_token", "additional_special_tokens", "raise_exception", "strftime_now"})


def _chat_template_kwargs(body: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: extra variables for the template (e.g. enable_thinking)."""
    kwargs = dict(get_field(body, "chat_template_kwargs", dict, {}))   # a copy: tools are added to it
    special = set(getattr(tokenizer, "special_tokens_map", None) or {})
    for name in kwargs:
        if not name.isidentifier() or name in _TEMPLATE_RESERVED:
            raise RequestError(f"chat_template_kwargs may not set {name!r}: it names the template's variables "
                               f"(e.g. enable_thinking), not apply_chat_template's own arguments",
                               f"chat_template_kwargs.{name}")
        if name in _TEMPLATE_PROTECTED or name in special or name.startswith("_"):
            raise RequestError(f"chat_template_kwargs may not set {name!r}: the template takes it from the "
                               f"model (its special tokens and helpers), not from a request",
                               f"chat_template_kwargs.{name}")
    return kwargs


def _plain_message(message: Any, index: int, allow_images: bool = False) -> dict[str, Any]:
    """{role, content} with content as one string (text parts joined), or, when it holds images,
    as template parts (rein.openai.images.template_content); plus what the template needs of
    tool calls and tool results (rein.openai.template_message_fields)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with role and content, got {json_type(message)}", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}",
                           f"{where}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        content = template_content(content, where, allow_images)
    if not isinstance(content, (str, list)):
        raise RequestError(f"{where}.content must be a string or a list of text (and image) parts, got "
                           f"{json_type(content)}", f"{where}.content")
    return {"role": role, "content": content, **template_message_fields(message, role, where)}



def check_prompt_chars(chars: int, max_model_len: int, param: str) -> None:
    """Refuse, before tokenizing it, a text too long for the context whatever the tokenizer."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise RequestError(f"The {param} ({chars} characters) are far longer than this model's context of "
                           f"{max_model_len} tokens can take: at most {limit} characters are tokenized. "
                           f"Shorten them.", param, CONTEXT_LENGTH_EXCEEDED)


def completion_prompt(body: dict[str, Any], tokenizer: Any, max_model_len: int) -> list[int]:
    if "prompt" not in body:
        raise RequestError("'prompt' is a required property", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise RequestError(
                f"the prompt is a list of {len(prompt)} prompts; rein takes one prompt per request: "
                f"send each as its own request (one batch line each)", "prompt")
        prompt = prompt[0]
    if prompt == "":   # refused whatever the tokenizer adds (a BOS) to it: it asks for nothing
        raise RequestError("the prompt is empty: give at least one character or token", "prompt")
    if isinstance(prompt, str):
        check_prompt_chars(len(prompt), max_model_len, "prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, list) and all(is_int(t) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise RequestError("prompt must be a string or a list of token ids (non-negative integers)", "prompt")
    if not ids:
        raise RequestError("the prompt is empty: give at least one token", "prompt")
    return ids


def check_token_ids(ids: list[int], tokenizer: Any, param: str) -> None:
    """Token ids must name tokens of the model's vocabulary: any other id is out of range of
    the embedding (and of the int4 column prompts are stored in)."""
    try:
        vocab_size = len(tokenizer)
    except TypeError:   # a tokenizer that cannot tell: nothing to check against
        return
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            where = f"{param}[{index}]"
            raise RequestError(f"{where} is {token_id}, not a token id of this model: ids run from 0 to "
                               f"{vocab_size - 1} (the tokenizer's vocabulary size is {vocab_size})", param)

