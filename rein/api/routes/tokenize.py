"""POST /tokenize and /detokenize, vLLM's routes and shapes (also SGLang's and llama.cpp's idea):
a prompt or chat messages as the model's token ids, as rein would run them, and token ids back to
text. What a client needs to count tokens or fit a prompt to the context before sending it.

The prompt is built exactly as a request's is (rein.openai.prompts: the chat template with the
body's tools and chat_template_kwargs, add_generation_prompt), by the model's own tokenizer in
this API process; no job is made and no worker is involved. A LoRA adapter's name tokenizes with
its base model's tokenizer. `max_model_len` in the answer is the context requests are checked
against: a prompt longer than it is still tokenized (up to the usual size cap on the text). A
vision model's messages may hold images (rein.openai.images): each is loaded and checked as a
request's, and its tokens are in the answer.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rein.api.checked_route import CheckedRoute
from rein.api.deps import InferenceKey, RegistryDep
from rein.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from rein.jobs.prepare import request_images, resolve_model
from rein.openai.endpoints import CHAT_COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.prompts import chat_prompt, check_prompt_chars, check_token_ids

router = APIRouter(tags=["tokenize"], route_class=CheckedRoute)

_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404)}


@router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
def tokenize(payload: TokenizeRequest, request: Request, key: InferenceKey, registry: RegistryDep
             ) -> TokenizeResponse:
    """A `prompt` (completions) or `messages` (chat, through the model's chat template) as token ids.
    A vision model's messages may hold images: their tokens are counted as a request's would be
    (loaded and checked as rein.jobs.image_sources does for requests; nothing is stored)."""
    entry = resolve_model(registry, payload.model)
    body = payload.model_dump(exclude_none=True)
    if (payload.prompt is None) == (payload.messages is None):
        raise RequestError("give either prompt (text, as /v1/completions tokenizes it) or messages (a chat, "
                           "through the model's chat template), not both or neither", "prompt")
    tokenizer = entry.tokenizer
    if payload.messages is not None:
        images, _ = request_images(entry, CHAT_COMPLETIONS, body, request.app.state.intake.images.for_request(
            key.tenant))
        ids = chat_prompt(body, tokenizer, entry.max_model_len, images=images)
    else:
        check_prompt_chars(len(payload.prompt or ""), entry.max_model_len, "prompt")
        ids = list(tokenizer.encode(payload.prompt, add_special_tokens=payload.add_special_tokens))
    strings = tokenizer.convert_ids_to_tokens(ids) if payload.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=entry.max_model_len, tokens=ids, token_strs=strings)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
def detokenize(payload: DetokenizeRequest, key: InferenceKey, registry: RegistryDep) -> DetokenizeResponse:
    """Token ids back to text (special tokens kept, as vLLM's)."""
    entry = resolve_model(registry, payload.model)
    check_token_ids(payload.tokens, entry.tokenizer, "tokens")
    return DetokenizeResponse(prompt=entry.tokenizer.decode(payload.tokens))
