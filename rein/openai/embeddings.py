"""OpenAI's /v1/embeddings request and response, mapped onto the engine's embedding requests.

Shared by the API, batch files and `rein run-batch`, so it imports no web framework and no
torch: a request body becomes a list of inputs (token ids) and `PoolingParams`, and the
vectors become exactly the body OpenAI returns:

    {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [...]}, ...],
     "model": ..., "usage": {"prompt_tokens": N, "total_tokens": N}}

Request fields: `input` (a string, a list of strings, a list of token ids, or a list of
lists of token ids), `model`, `dimensions`, `encoding_format` ("float" or "base64": the
little-endian float32 bytes of the vector, base64-encoded, as OpenAI) and `user` (no
effect). Limits follow OpenAI's: at most 2048 inputs, each non-empty and within the model's
context, at most 300,000 tokens in all. Strings are tokenized with the tokenizer's special
tokens, as vLLM does (Qwen3-Embedding's tokenizer appends the end-of-text token its
last-token pooling reads). `dimensions` needs a model that declares Matryoshka support
(rein.model.pooling_config). Every malformed request raises `RequestError` naming the parameter.

A job stores its vectors as floats (`results.response = {"data": [...]}`); the encoding is
applied when the body is built, so the stored result is the same whatever was asked.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from rein.core.input_checks import json_type
from rein.model.pooling_config import (
    PoolingConfig,
    PoolingError,
    PoolingParams,
    read_pooling_config,
)
from rein.openai.endpoints import EMBEDDINGS
from rein.openai.errors import CONTEXT_LENGTH_EXCEEDED, RequestError
from rein.openai.fields import is_int
from rein.openai.limits import MAX_CHARS_PER_TOKEN
from rein.openai.prompts import check_token_ids
from rein.openai.response_shape import ResponseShape

MAX_INPUTS = 2048                # OpenAI's limit on inputs per request
MAX_TOTAL_TOKENS = 300_000       # OpenAI's limit on the tokens of all inputs of a request
# rein's cap on inputs x vector width: a response (and the stored result) of at most ~4M
# floats, about 80 MB of JSON (2,048 inputs of a 4,096-wide model would be ~170 MB from a
# ~10 KB request). 2,048 inputs of a 2,048-wide model, or 1,024 of a 4,096-wide one, fit.
MAX_EMBEDDING_VALUES = 4_194_304
ENCODING_FORMATS = ("float", "base64")
# `priority`: where the job runs in the queue and the engine (rein.openai.priority).
_FIELDS = frozenset({"model", "input", "dimensions", "encoding_format", "user", "priority"})

__all__ = ["EMBEDDINGS", "ENCODING_FORMATS", "MAX_EMBEDDING_VALUES", "MAX_INPUTS", "MAX_TOTAL_TOKENS",
           "ParsedEmbeddings", "embeddings_body", "encode_vector", "job_embeddings_body", "model_pooling",
           "parse_embeddings_request", "split_inputs", "stored_response"]


@dataclass
class ParsedEmbeddings:
    """An embeddings request, checked: one token-id list per input."""

    inputs: list[list[int]]
    params: PoolingParams
    model: str | None
    encoding_format: str = "float"
    # Read like a ParsedRequest where intake and batch validation handle both.
    logprobs_mode: None = None
    stream: bool = False
    shape: ResponseShape = field(default_factory=ResponseShape)   # plain: one body, no choices
    input_lengths: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.input_lengths = [len(ids) for ids in self.inputs]

    @cached_property
    def prompt_token_ids(self) -> list[int]:
        """Every input's tokens, one after the other (what a job row stores; `input_lengths`
        splits them again)."""
        return [token for ids in self.inputs for token in ids]


def split_inputs(token_ids: list[int], lengths: list[int]) -> list[list[int]]:
    """The inputs of an embeddings job, from its concatenated token ids and their lengths."""
    if sum(lengths) != len(token_ids):
        raise ValueError(f"input lengths add up to {sum(lengths)}, but the job holds {len(token_ids)} tokens")
    inputs, start = [], 0
    for length in lengths:
        inputs.append(token_ids[start:start + length])
        start += length
    return inputs


def model_pooling(directory: str | Path | None) -> PoolingConfig:
    """The pooling config of a served model's directory (the default when unknown)."""
    return read_pooling_config(directory) if directory is not None else PoolingConfig()


def parse_embeddings_request(body: dict[str, Any], tokenizer: Any, max_model_len: int,
                             pooling: PoolingConfig | None = None) -> ParsedEmbeddings:
    """Turn an OpenAI embeddings body into token-id inputs and PoolingParams (see the module
    docstring); `pooling` is the model's (for `dimensions`)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}")
    for name in body:
        if name not in _FIELDS:
            raise RequestError(f"Unrecognized request argument supplied: {name} (rein's {EMBEDDINGS} takes "
                               f"{', '.join(sorted(_FIELDS))}; remove it)", name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"model must be a string, got {json_type(model)}", "model")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string, got {json_type(user)}", "user")
    encoding_format = body.get("encoding_format")
    if encoding_format is None:
        encoding_format = "float"
    if encoding_format not in ENCODING_FORMATS:
        shown = encoding_format if isinstance(encoding_format, str) else json_type(encoding_format)
        raise RequestError(f"encoding_format must be \"float\" or \"base64\", got {shown!r}", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not is_int(dimensions) or dimensions < 1):
        raise RequestError(f"dimensions must be a positive integer, got {dimensions!r}", "dimensions")
    params = PoolingParams(dimensions=dimensions)
    try:
        (pooling or PoolingConfig()).check(params, f"Model \"{model}\"" if model else "this model")
    except PoolingError as exc:
        raise RequestError(str(exc), exc.param) from None
    inputs = _inputs(body, tokenizer, max_model_len)
    width = dimensions or (pooling.hidden_size if pooling is not None else None)
    if width is not None and len(inputs) * width > MAX_EMBEDDING_VALUES:
        raise RequestError(
            f"the response would hold {len(inputs)} inputs x {width} dimensions = {len(inputs) * width} values, "
            f"past rein's cap of {MAX_EMBEDDING_VALUES} per request; send at most "
            f"{MAX_EMBEDDING_VALUES // width} inputs per request"
            + ("" if dimensions or pooling is None or not pooling.is_matryoshka else ", or ask for fewer dimensions"),
            "input")
    return ParsedEmbeddings(inputs, params, model, encoding_format)


def _inputs(body: dict[str, Any], tokenizer: Any, max_model_len: int) -> list[list[int]]:
    if "input" not in body:
        raise RequestError("'input' is a required property", "input")
    given = body["input"]
    if isinstance(given, str):
        items: list[Any] = [given]
    elif isinstance(given, list):
        if not given:
            raise RequestError("input is an empty list: give at least one string or token-id list", "input")
        if all(is_int(t) for t in given):
            items = [given]   # one input of token ids
        elif all(isinstance(t, str) for t in given) or all(isinstance(t, list) for t in given):
            items = given
        else:
            raise RequestError("input must be a string, a list of strings, a list of token ids or a list of "
                               "lists of token ids (not a mix)", "input")
    else:
        raise RequestError(f"input must be a string, a list of strings, a list of token ids or a list of lists "
                           f"of token ids, got {json_type(given)}", "input")
    if len(items) > MAX_INPUTS:
        raise RequestError(f"input holds {len(items)} inputs; at most {MAX_INPUTS} are allowed per request: "
                           f"split them into several requests", "input")
    inputs = []
    total = 0
    for index, item in enumerate(items):
        where = f"input[{index}]" if isinstance(given, list) and items is given else "input"
        ids = _one_input(item, where, tokenizer, max_model_len)
        total += len(ids)
        if total > MAX_TOTAL_TOKENS:
            raise RequestError(f"the inputs hold more than {MAX_TOTAL_TOKENS} tokens in all (the limit per "
                               f"request, reached at {where}): split them into several requests", "input")
        inputs.append(ids)
    return inputs


def _one_input(item: Any, where: str, tokenizer: Any, max_model_len: int) -> list[int]:
    if isinstance(item, str):
        if not item:
            raise RequestError(f"{where} is an empty string: each input needs at least one character", "input")
        limit = max_model_len * MAX_CHARS_PER_TOKEN
        if len(item) > limit:   # far too long for the context whatever the tokenizer: not tokenized
            raise RequestError(f"{where} ({len(item)} characters) is far longer than this model's context of "
                               f"{max_model_len} tokens can take; shorten it", "input", CONTEXT_LENGTH_EXCEEDED)
        ids = list(tokenizer.encode(item, add_special_tokens=True))
    elif isinstance(item, list):
        if not item:
            raise RequestError(f"{where} is an empty list of token ids: each input needs at least one token",
                               "input")
        if not all(is_int(t) for t in item):
            raise RequestError(f"{where} must be a list of token ids (integers)", "input")
        ids = list(item)
        check_token_ids(ids, tokenizer, where)
    else:
        raise RequestError(f"{where} must be a string or a list of token ids, got {json_type(item)}", "input")
    if not ids:
        raise RequestError(f"{where} gives no tokens", "input")
    if len(ids) > max_model_len:
        raise RequestError(f"This model's maximum context length is {max_model_len} tokens, however {where} "
                           f"has {len(ids)} tokens. Please shorten it.", "input", CONTEXT_LENGTH_EXCEEDED)
    return ids


# -- responses --------------------------------------------------------------------------------


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the response carries it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embeddings_body(model: str, vectors: list[list[float]], prompt_tokens: int,
                    encoding_format: str = "float") -> dict[str, Any]:
    """OpenAI's embeddings response body."""
    return {"object": "list",
            "data": [{"object": "embedding", "index": index, "embedding": encode_vector(vector, encoding_format)}
                     for index, vector in enumerate(vectors)],
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def stored_response(vectors: list[list[float]]) -> dict[str, Any]:
    """What an embeddings job stores in `results.response`: the `data` list, as floats."""
    return {"data": [{"object": "embedding", "index": index, "embedding": vector}
                     for index, vector in enumerate(vectors)]}


def job_embeddings_body(job: Any, response: dict[str, Any] | None) -> dict[str, Any]:
    """The body of a finished embeddings job (its row and its stored `results.response`),
    exactly as the synchronous endpoint returns it: in the encoding its request asked for."""
    body = (job.params or {}).get("body") or {}
    vectors = [entry["embedding"] for entry in (response or {}).get("data", [])]
    return embeddings_body(job.model, vectors, job.prompt_tokens, body.get("encoding_format") or "float")
