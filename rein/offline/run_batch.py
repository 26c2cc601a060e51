"""The offline batch runner: an OpenAI batch input file in, an output file out.

It drives `LLMEngine.step()` in the calling thread through `rein.offline.driver` (the loop
`rein.LLM` uses too) and streams both files: input lines are read only as requests can be
taken (at most `max_in_flight` requests are in the engine at once, so a file of any length
is never held in memory), and each output line is written and flushed the moment its
request finishes. A bad input line (invalid JSON, missing fields, a malformed body, a
prompt longer than the context) gets an error line naming its line number and never stops
the run; blank lines are skipped. A line longer than REIN_MAX_REQUEST_BYTES (the API's cap on a
request, 16 MiB by default) gets a `line_too_large` error line and is skipped to its newline
unread (rein.openai.batch_lines.read_lines): unbounded, json.loads of a 200 MB line of `[],`
would need some 5 GiB. Every other line gets exactly one answer, success
or error.

Lines are taken in prefix order by default (rein.offline.prefix_order: lines whose prompts
share a prefix run together, within a window of lines read ahead and tokenized), or in the
file's order. Output lines come in the order requests finish, not input order; match them by
custom_id, as with OpenAI's Batch API.

The input may be a path, an s3:// or an https:// URL, the outputs a path or an s3:// URL
(rein.offline.locations): all streamed.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tqdm import tqdm

from rein.core.images import ImageError, open_image
from rein.core.priorities import job_priority
from rein.core.settings import setting_or_default
from rein.engine.errors import EngineRequestError
from rein.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from rein.engine.request_result import RequestResult
from rein.offline.driver import default_max_in_flight, drive
from rein.offline.embed import EmbeddingPart, finish_embeddings_part, take_embeddings_line
from rein.offline.locations import check_output, is_remote, open_input, open_output
from rein.offline.prefix_order import DEFAULT_WINDOW, ORDERS, prefix_ordered
from rein.openai.batch_lines import (
    BatchLine,
    OversizedLine,
    batch_error_line,
    batch_output_line,
    custom_id_of,
    parse_batch_line,
    read_lines,
)
from rein.openai.choices_response import full_response
from rein.openai.endpoints import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES, generated_as
from rein.openai.engine_errors import request_error
from rein.openai.errors import RequestError
from rein.openai.images import image_parts
from rein.openai.priority import parse_priority
from rein.openai.reasoning import ModelReasoning, apply_reasoning, parsers_by_model
from rein.openai.request import ParsedRequest, parse_request
from rein.openai.response import build_response
from rein.openai.responses import chat_body, parse_responses_request
from rein.openai.responses_body import response_from_chat
from rein.openai.tool_call_parsers import detect_tool_call_parser
from rein.openai.tools import apply_tool_calls

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine


@dataclass
class BatchSummary:
    requests_ok: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_seconds: float = 0.0

    @property
    def requests_total(self) -> int:
        return self.requests_ok + self.requests_failed

    @property
    def output_tokens_per_second(self) -> float:
        return self.completion_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0


def format_summary(summary: BatchSummary) -> str:
    return (
        f"requests: {summary.requests_ok} ok, {summary.requests_failed} failed "
        f"({summary.requests_total} total)\n"
        f"tokens: {summary.prompt_tokens} prompt, {summary.completion_tokens} completion\n"
        f"wall time: {summary.wall_seconds:.2f} s, output: {summary.output_tokens_per_second:.1f} tokens/s"
    )


@dataclass
class _ReadLine:
    """An input line read and checked, not yet in the engine."""

    line_number: int
    batch_line: BatchLine
    parsed: ParsedRequest | None    # None: an embeddings line, parsed as it is taken
    # Its `priority` (rein.openai.priority). Every line of an offline run is in one class, the
    # engine's default (interactive: no step budget or batch prefill cap applies among them).
    priority: int = 0
    images: list | None = None      # a chat line's images (rein.core.images.ImageInput), in order

    def prompt_token_ids(self) -> list[int]:
        """What the prefix order sorts by (an embeddings line: nothing, so first)."""
        return self.parsed.prompt_token_ids if self.parsed is not None else []


@dataclass
class _Pending:
    """What a request in the engine needs for its answer line."""

    custom_id: str
    line_number: int
    endpoint: str
    model_name: str
    parsed: ParsedRequest
    request_body: dict[str, Any] | None = None     # for tool calls (rein.openai.tools)


def run_batch(
    engine: LLMEngine,
    input_path: str | Path,
    output_path: str | Path,
    *,
    model_name: str | None = None,
    error_path: str | Path | None = None,
    max_in_flight: int | None = None,
    progress: bool = True,
    generation_defaults: GenerationDefaults | None = None,
    order: str = "prefix",
    order_window: int = DEFAULT_WINDOW,
    max_line_bytes: int | None = None,
    adapters: dict[str, Any] | None = None,
) -> BatchSummary:
    """Answer every non-blank line of `input_path` into `output_path` (errors into `error_path`
    when given, else into the output file too) and return the counts. Sampling fields a line
    leaves out take `generation_defaults` (default: the engine's model's, per its generation_config).
    `order`: "prefix" takes lines sharing a prompt prefix together, within `order_window` lines
    read ahead (rein.offline.prefix_order); "file" takes them in the file's order. A line longer
    than `max_line_bytes` (default REIN_MAX_REQUEST_BYTES) is an error line, never read whole.
    `adapters`: LoRA adapters by name (rein.model.lora.LoRARequest); a line whose model names one runs
    under it (the engine needs enable_lora), a line naming none of them runs on the base model."""
    if generation_defaults is None:
        generation_defaults = load_generation_defaults(engine.model_dir, engine.config.generation_config)
    batch = BatchRun(engine, model_name or default_model_name(engine),
                     max_in_flight or default_max_in_flight(engine), order, order_window, max_line_bytes,
                     adapters)
    batch.generation_defaults = generation_defaults
    check_output(output_path)
    if error_path:
        check_output(error_path)
    # A local file is counted first for the progress bar's total; a remote one is read once.
    total = None if is_remote(input_path) else count_requests(input_path, batch.max_line_bytes)
    with open_input(input_path) as source, open_output(output_path) as out, \
            (open_output(error_path) if error_path else nullcontext()) as err, \
            tqdm(total=total, unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True) as bar:
        batch.out, batch.err, batch.bar = out, err or out, bar
        batch.run(source)
    return batch.summary


def vision_chat(engine: LLMEngine, url: str, body: Any) -> tuple[list | None, list[int] | None]:
    """A chat line's images (image_url data-URL parts, rein.openai.images) and its prompt rendered
    by the chat template and expanded by the model's processor; (None, None) for a line without
    images. RequestError for images the line cannot have (not a data URL, a text-only model, a
    placeholder count that does not match, an image that does not open)."""
    if url != CHAT_COMPLETIONS or not isinstance(body, dict) or not isinstance(body.get("messages"), list):
        return None, None
    try:
        messages, images = image_parts(body["messages"])
        if not images:
            return None, None
        processor = engine.vision_processor
        if processor is None:
            raise ImageError("this model takes text only: the line has image parts; use a vision model",
                             param="messages")
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        opened = [open_image(image.data, max_pixels=engine.max_image_pixels) for image in images]
        ids = processor.expand(text, opened, [image.detail for image in images]).token_ids
    except ImageError as exc:
        raise RequestError(exc.message, exc.param or "messages") from exc
    return images, ids


def default_model_name(engine: LLMEngine) -> str:
    """The model's directory name, a GGUF file's name without .gguf, or the hub id it was given as."""
    given = str(engine.config.model)
    path = Path(given).expanduser()
    if path.is_file():
        return path.stem
    return path.name if path.is_dir() else given


def count_requests(path: str | Path, max_line_bytes: int) -> int:
    """Non-blank lines, in one streaming pass (for the progress bar's total), each read under the cap."""
    with open(path, "rb") as f:
        return sum(1 for line in read_lines(f, max_line_bytes) if isinstance(line, OversizedLine) or line.strip())


class BatchRun:
    """One run over a batch file: takes each line into the engine and writes its answer. The
    embeddings lines (rein.offline.embed) answer through `answer` and `fail`."""

    def __init__(self, engine: LLMEngine, model_name: str, max_in_flight: int, order: str = "prefix",
                 order_window: int = DEFAULT_WINDOW, max_line_bytes: int | None = None,
                 adapters: dict[str, Any] | None = None) -> None:
        if order not in ORDERS:
            raise ValueError(f"order {order!r}: want one of {', '.join(ORDERS)}")
        self.engine = engine
        self.model_name = model_name
        # --reasoning-parser (ReasoningParserError, a ValueError, for a bad name or a model without its tags).
        parser = parsers_by_model(engine.config.reasoning_parser, [model_name]).get(model_name)
        self.reasoning = ModelReasoning.of(parser, engine.tokenizer, f"model {model_name!r}") if parser else None
        # Lines whose model names a LoRA adapter run under it (name -> LoRARequest).
        self.adapters = adapters or {}
        self.max_in_flight = max(1, max_in_flight)
        self.order = order
        self.order_window = order_window
        self.max_line_bytes: int = max_line_bytes or setting_or_default("max_request_bytes")
        self.seen_ids: set[str] = set()
        self.generation_defaults: GenerationDefaults | None = None
        # --tool-call-parser, else the format the model's chat template teaches (rein.openai.tool_call_parsers)
        self.tool_call_parser = getattr(engine.config, "tool_call_parser", None) or detect_tool_call_parser(
            getattr(engine.tokenizer, "chat_template", None))
        self.summary = BatchSummary()
        self.started = time.perf_counter()
        self.out: IO[str]
        self.err: IO[str]
        self.bar: tqdm

    def run(self, source: IO[bytes]) -> None:
        lines: Iterable[_ReadLine] = (read for read in map(self._read, enumerate(read_lines(source, self.max_line_bytes), start=1)) if read is not None)
        if self.order == "prefix":
            lines = prefix_ordered(lines, _ReadLine.prompt_token_ids, self.order_window)
        drive(self.engine, lines, self._take, self._finish, self.max_in_flight)
        self.summary.wall_seconds = time.perf_counter() - self.started

    # -- input -----------------------------------------------------------------------------

    def _read(self, item: tuple[int, bytes | OversizedLine]) -> _ReadLine | None:
        """Read and check one input line (its prompt tokenized), or answer it with an error."""
        line_number, raw = item
        if isinstance(raw, OversizedLine):     # skipped unread: its custom_id is unknown
            self.fail(None, line_number, "line_too_large", raw.message(line_number))
            return None
        if not raw.strip():
            return None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self.fail(None, line_number, "invalid_json_line", f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
            return None
        try:
            batch_line = parse_batch_line(line, line_number)
        except RequestError as exc:
            self.fail(custom_id_of(line), line_number, exc.code, exc.message)
            return None
        custom_id = batch_line.custom_id
        if custom_id in self.seen_ids:
            self.fail(custom_id, line_number, "duplicate_custom_id",
                       f"custom_id {custom_id!r} was already used by an earlier line; each line needs its own")
            return None
        self.seen_ids.add(custom_id)
        if batch_line.url == EMBEDDINGS:   # parsed when taken (rein.offline.embed)
            return _ReadLine(line_number, batch_line, None)
        try:
            if batch_line.url == RESPONSES:   # runs as chat (rein.openai.responses)
                parsed = parse_responses_request(batch_line.body, self.engine.tokenizer, self.engine.max_model_len,
                                                 self.generation_defaults, self.tool_call_parser, self.reasoning)
            else:
                images, chat_ids = vision_chat(self.engine, batch_line.url, batch_line.body)
                parsed = parse_request(batch_line.url, batch_line.body, self.engine.tokenizer,
                                       self.engine.max_model_len, self.generation_defaults, self.tool_call_parser,
                                       self.reasoning, chat_token_ids=chat_ids)
            # service_tier "priority" is refused as on the service's batch lines; the rest only orders.
            priority = job_priority(parse_priority(batch_line.body, batch_line=True).priority)
        except RequestError as exc:
            self.fail(custom_id, line_number, exc.code, exc.message)
            return None
        return _ReadLine(line_number, batch_line, parsed, priority, images)

    def _take(self, read: _ReadLine) -> tuple[str, _Pending] | list[tuple[str, EmbeddingPart]] | None:
        """Add a read line's request to the engine, or answer the line with an error."""
        batch_line, line_number, parsed = read.batch_line, read.line_number, read.parsed
        if parsed is None:   # one engine request per input (rein.offline.embed)
            return take_embeddings_line(self, batch_line, line_number)
        request_id = uuid.uuid4().hex
        try:
            self.engine.add_request(request_id, parsed.prompt_token_ids, parsed.params, priority=read.priority,
                                    lora_request=self.adapters.get(parsed.model) if parsed.model else None,
                                    images=read.images)
        except EngineRequestError as exc:
            refused = request_error(exc)
            self.fail(batch_line.custom_id, line_number, refused.code, refused.message)
            return None
        return request_id, _Pending(batch_line.custom_id, line_number, batch_line.url,
                                    parsed.model or self.model_name, parsed, batch_line.body)

    # -- output ----------------------------------------------------------------------------

    def _finish(self, done: RequestResult) -> None:
        if isinstance(done.state, EmbeddingPart):
            finish_embeddings_part(self, done)
            return
        pending = done.state
        if done.finish_reason == "abort":
            self.fail(pending.custom_id, pending.line_number, "request_aborted",
                       "the request was aborted before it finished")
            return
        parsed = pending.parsed
        prompt_tokens = len(parsed.prompt_token_ids)
        if parsed.shape.plain:
            body = build_response(
                generated_as(pending.endpoint), done.request_id, pending.model_name, prompt_tokens, done.text,
                done.token_ids, done.finish_reason, done.logprobs if parsed.logprobs_mode is not None else None,
                self.engine.tokenizer, parsed.logprobs_mode, int(time.time()), cached_tokens=done.num_cached_tokens)
        else:   # n > 1, best_of, echo, prompt logprobs (rein.openai.choices_response)
            body = full_response(generated_as(pending.endpoint), done.request_id, pending.model_name, done,
                                 parsed.prompt_token_ids, self.engine.tokenizer, parsed.logprobs_mode, parsed.shape,
                                 int(time.time()))
        # The thinking split out first (rein.openai.reasoning): tool calls come from what follows it.
        body = apply_reasoning(body, parsed.reasoning, [c.token_ids for c in done.ordered()])
        if pending.endpoint == RESPONSES:
            chat = apply_tool_calls(body, chat_body(pending.request_body), self.tool_call_parser)
            body = response_from_chat(chat, pending.request_body, done.request_id)
        else:
            body = apply_tool_calls(body, pending.request_body, self.tool_call_parser)
        self.answer(pending.custom_id, done.request_id, body, prompt_tokens, done.completion_tokens)

    def answer(self, custom_id: str, request_id: str, body: dict[str, Any], prompt_tokens: int,
               completion_tokens: int = 0) -> None:
        """Write a line's output and count its tokens."""
        self._write(self.out, batch_output_line(custom_id, request_id, body))
        self.summary.requests_ok += 1
        self.summary.prompt_tokens += prompt_tokens
        self.summary.completion_tokens += completion_tokens
        self._advance()

    def fail(self, custom_id: str | None, line_number: int, code: str, message: str) -> None:
        self._write(self.err, batch_error_line(custom_id, line_number, code, message))
        self.summary.requests_failed += 1
        self._advance()

    def _write(self, stream: IO[str], line: dict[str, Any]) -> None:
        stream.write(json.dumps(line, ensure_ascii=False) + "\n")
        stream.flush()

    def _advance(self) -> None:
        elapsed = time.perf_counter() - self.started
        rate = self.summary.completion_tokens / elapsed if elapsed > 0 else 0.0
        self.bar.set_postfix({"ok": self.summary.requests_ok, "failed": self.summary.requests_failed,
                              "out tok/s": f"{rate:.1f}"}, refresh=False)
        self.bar.update(1)
