"""Embeddings offline: `rein.LLM.embed` and the /v1/embeddings lines of `rein run-batch`.

Both drive the engine through `rein.offline.driver` like generation does, so embedding
requests and generation requests of one batch file share its steps. An embeddings batch
line with several inputs makes one engine request per input (`<line id>#<i>`); its output
line is written once every input is done, with OpenAI's embeddings body
(rein.openai.embeddings). `LLM.embed(prompts)` returns vLLM's shape: one
`EmbeddingRequestOutput` per prompt, the vector in `.outputs.embedding`.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from rein.engine.errors import EngineRequestError
from rein.engine.request_result import RequestResult
from rein.model.pooling_config import PoolingError, PoolingParams
from rein.offline.driver import drive
from rein.offline.prompts import as_prompt_list, read_prompt
from rein.openai.batch_lines import BatchLine
from rein.openai.embeddings import ParsedEmbeddings, embeddings_body, parse_embeddings_request
from rein.openai.engine_errors import request_error
from rein.openai.errors import RequestError

if TYPE_CHECKING:
    from rein.offline.llm import LLM
    from rein.offline.run_batch import BatchRun


# -- LLM.embed --------------------------------------------------------------------------------


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: the vector of one prompt."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: one prompt's result of `LLM.embed`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


def embed(llm: LLM, prompts: Any, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
          use_tqdm: bool | Callable[..., tqdm] = True) -> list[EmbeddingRequestOutput]:
    """`LLM.embed`: every prompt's embedding, in input order (see LLM.embed)."""
    engine = llm.engine
    prepared = [read_prompt(index, prompt, engine.tokenizer, engine.spec.vocab_size)
                for index, prompt in enumerate(as_prompt_list(prompts))]
    if pooling_params is None or isinstance(pooling_params, PoolingParams):
        params = [pooling_params or PoolingParams()] * len(prepared)
    else:
        params = list(pooling_params)
        if len(params) != len(prepared):
            raise ValueError(f"got {len(params)} PoolingParams for {len(prepared)} prompts: give one for all "
                             f"or one per prompt")
    for index, (prompt, p) in enumerate(zip(prepared, params, strict=True)):
        if not isinstance(p, PoolingParams):
            raise TypeError(f"pooling_params[{index}] must be a PoolingParams, got {type(p).__name__}")
        if len(prompt.token_ids) > engine.max_model_len:
            raise ValueError(f"prompt {index} is too long: {len(prompt.token_ids)} tokens, but max_model_len is "
                             f"{engine.max_model_len}. Shorten it, or raise max_model_len.")
        try:
            engine.pooling_config.check(p)
        except PoolingError as exc:
            raise ValueError(f"prompt {index}: {exc}") from None
    results: list[EmbeddingRequestOutput | None] = [None] * len(prepared)
    progress = use_tqdm if callable(use_tqdm) else tqdm

    def admit(index: int) -> tuple[str, int]:
        request_id = str(next(llm.request_counter))
        try:
            engine.add_request(request_id, prepared[index].token_ids, params[index])
        except EngineRequestError as exc:   # the checks above should have caught it
            raise ValueError(f"prompt {index}: {exc}") from exc
        return request_id, index

    def finish(done: RequestResult) -> None:
        if done.embedding is None:
            raise RuntimeError(f"prompt {done.state}: the engine ended it without a vector ({done.finish_reason})")
        results[done.state] = EmbeddingRequestOutput(done.request_id, prepared[done.state].token_ids,
                                                     EmbeddingOutput(done.embedding))
        bar.update(1)

    with progress(total=len(prepared), desc="Embedded prompts", unit="prompt", file=sys.stderr,
                  dynamic_ncols=True, disable=not use_tqdm) as bar:
        drive(engine, range(len(prepared)), admit, finish, llm.max_in_flight)
    return results  # type: ignore[return-value]  # every slot is filled by finish


# -- run-batch lines --------------------------------------------------------------------------


@dataclass
class EmbeddingLine:
    """An embeddings batch line in the engine: its inputs' vectors as they come."""

    custom_id: str
    line_number: int
    request_id: str
    model_name: str
    parsed: ParsedEmbeddings
    vectors: list[list[float] | None] = field(default_factory=list)
    remaining: int = 0
    aborted: bool = False


@dataclass
class EmbeddingPart:
    """One input of an embeddings line (the driver's state of its engine request)."""

    line: EmbeddingLine
    index: int


def take_embeddings_line(run: BatchRun, batch_line: BatchLine, line_number: int) -> list[tuple[str, EmbeddingPart]] | None:
    """Add an embeddings line's inputs to the engine, or answer the line with an error."""
    engine = run.engine
    try:
        parsed = parse_embeddings_request(batch_line.body, engine.tokenizer, engine.max_model_len,
                                          engine.pooling_config)
    except RequestError as exc:
        run.fail(batch_line.custom_id, line_number, exc.code, exc.message)
        return None
    request_id = uuid.uuid4().hex
    line = EmbeddingLine(batch_line.custom_id, line_number, request_id, parsed.model or run.model_name, parsed,
                         [None] * len(parsed.inputs), len(parsed.inputs))
    added: list[tuple[str, EmbeddingPart]] = []
    for index, token_ids in enumerate(parsed.inputs):
        part_id = f"{request_id}#{index}"
        try:
            engine.add_request(part_id, token_ids, parsed.params)
        except EngineRequestError as exc:
            for other, _ in added:
                engine.abort(other)
            refused = request_error(exc)
            where = f"input[{index}]: " if len(parsed.inputs) > 1 else ""
            run.fail(batch_line.custom_id, line_number, refused.code, f"{where}{refused.message}")
            return None
        added.append((part_id, EmbeddingPart(line, index)))
    return added


def finish_embeddings_part(run: BatchRun, done: RequestResult) -> None:
    """One input is done; the line's output is written with its last input."""
    line = done.state.line
    if done.embedding is None:
        line.aborted = True
    else:
        line.vectors[done.state.index] = done.embedding
    line.remaining -= 1
    if line.remaining:
        return
    if line.aborted:
        run.fail(line.custom_id, line.line_number, "request_aborted", "the request was aborted before it finished")
        return
    prompt_tokens = len(line.parsed.prompt_token_ids)
    body = embeddings_body(line.model_name, line.vectors, prompt_tokens,  # type: ignore[arg-type]
                           line.parsed.encoding_format)
    run.answer(line.custom_id, line.request_id, body, prompt_tokens)
