"""Validating a batch input file, every line, before anything is enqueued.

Each non-blank line must be JSON in OpenAI's batch line format with a `custom_id` unique in
the file, `method` "POST", a `url` equal to the batch's endpoint, and a body the endpoint
accepts: a served model (the same on every line, as OpenAI requires), valid sampling
parameters, and a prompt + max_tokens within the model's context. The body is checked by
the same `prepare` the synchronous endpoints use, so it tokenizes each prompt once and
the token ids are kept for the jobs. A file with more than the batch limit of requests,
or none, is refused as a whole; so is an embeddings batch whose lines hold more embedding
inputs in all than its limit (OpenAI's 50,000: a string input counts 1, a list counts each of its
strings or token-id lists, a single token-id list counts 1).

The file is read line by line (never whole), each line under a length cap
(rein.openai.batch_lines.read_lines, REIN_MAX_REQUEST_BYTES): a longer line is that line's
error (`line_too_large`), skipped to its newline without being held or parsed, so checking a
file holds at most one line of the cap's size and its parse (bounded before it starts,
rein.core.json_budget) per validator thread, whatever the file holds. Each valid line is handed to `on_valid`
as soon as it is checked (the batch manager spools its job row to a temporary file at once
and COPYs them all into the jobs table once every line passed, so a 50,000-line batch's token
ids are never all held in memory). Errors are listed as OpenAI's batch `errors`
are: `{"code", "line", "message", "param"}`, up to MAX_REPORTED_ERRORS of them; once a line
is bad, the others are still checked (to report them) but no longer handed on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rein.core.priorities import PRIORITY_BATCH
from rein.jobs.errors import APIError
from rein.jobs.image_sources import RequestImages
from rein.jobs.prepare import Prepared, prepare, resolve_model
from rein.jobs.registry import ModelRegistry
from rein.openai.batch_lines import OversizedLine, parse_batch_line
from rein.openai.embeddings import ParsedEmbeddings
from rein.openai.errors import RequestError
from rein.openai.images import INVALID_IMAGE, without_image_data

MAX_REPORTED_ERRORS = 1000


@dataclass
class ValidLine:
    line: int
    custom_id: str
    prepared: Prepared

    def job_values(self) -> dict[str, Any]:
        """The jobs-table values this line's request needs (as JobIntake stores a job)."""
        parsed = self.prepared.parsed
        params = {"body": without_image_data(self.prepared.body), "sampling": dataclasses.asdict(parsed.params),
                  "logprobs_mode": parsed.logprobs_mode, "stream": False}
        shape = parsed.shape.to_dict()
        if shape is not None:   # n > 1, best_of, echo, prompt logprobs (rein.openai.response_shape)
            params["shape"] = shape
        reasoning = getattr(parsed, "reasoning", None)
        if reasoning is not None:   # the thinking split out of its body (rein.openai.reasoning)
            params["reasoning"] = reasoning.to_dict()
        if isinstance(parsed, ParsedEmbeddings):   # an embeddings line's inputs (rein.store.messages)
            params["input_lengths"] = parsed.input_lengths
        if self.prepared.tool_parser is not None:   # how its tool calls are read (rein.openai.tool_call_parsers)
            params["tool_parser"] = self.prepared.tool_parser
        if self.prepared.lora is not None:   # a LoRA adapter's line (rein.jobs.adapters)
            params["lora"] = self.prepared.lora
        if self.prepared.images:   # stored by sha256 in the file store (rein.jobs.image_sources)
            params["images"] = self.prepared.image_refs
        return {
            "model": self.prepared.entry.name, "endpoint": self.prepared.endpoint,
            "params": params,
            "prompt_token_ids": list(parsed.prompt_token_ids),
            "prompt_tokens": len(parsed.prompt_token_ids),
            "custom_id": self.custom_id, "batch_line": self.line,
            "priority": self.prepared.priority,   # the batch class, moved back by the line's `priority`
            # what the per-tenant cap on queued batch tokens counts (rein.batches.manager)
            "requested_tokens": self.prepared.requested_tokens,
        }


@dataclass
class FailedLine:
    """A line whose image cannot be taken (rein.jobs.image_sources): it fails alone, as a job
    stored failed with this error, and the rest of the batch runs (a batch of a thousand image
    links is not thrown away for one dead link)."""

    line: int
    custom_id: str
    model: str
    endpoint: str
    body: dict[str, Any]
    error: dict[str, Any]

    def job_values(self) -> dict[str, Any]:
        """Its job row, as ValidLine.job_values (no prompt: it never runs); the manager marks it failed."""
        return {"model": self.model, "endpoint": self.endpoint, "params": {"body": without_image_data(self.body)},
                "prompt_token_ids": [], "prompt_tokens": 0, "custom_id": self.custom_id, "batch_line": self.line,
                "priority": PRIORITY_BATCH, "requested_tokens": 0}


@dataclass
class Validation:
    errors: list[dict[str, Any]] = field(default_factory=list)
    model: str | None = None
    requests: int = 0
    valid: int = 0
    embedding_inputs: int = 0
    failed_lines: int = 0
    """Lines that fail alone (a bad image: FailedLine), counted in the batch's requests."""

    @property
    def ok(self) -> bool:
        return not self.errors

    def fail(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            if line is not None and not message.startswith(f"line {line}:"):
                message = f"line {line}: {message}"
            self.errors.append({"code": code, "line": line, "message": message, "param": param})


def validate_lines(raw_lines: Iterable[bytes | OversizedLine], endpoint: str, registry: ModelRegistry,
                   max_requests: int, on_valid: Callable[[ValidLine], None] = lambda line: None,
                   before_line: Callable[[int], None] = lambda number: None,
                   max_embedding_inputs: int | None = None, images: RequestImages | None = None,
                   on_failed: Callable[[FailedLine], None] | None = None) -> Validation:
    """Check every line of a batch input file (see the module docstring): `raw_lines` as
    `read_lines` gives them (an OversizedLine is that line's error). `before_line(number)`
    runs before each line, valid or not: the batch manager's deadline and stop checks raise from
    it, so a file whose first line is bad cannot run for hours checking the rest.
    `max_embedding_inputs`: the most embedding inputs all lines may hold together (None: no cap).
    `images`: how the lines' images are loaded (the batch tenant's; None: image lines are refused);
    `on_failed`: takes each line whose image is bad (FailedLine), which then fails alone; None:
    such a line is an error of the file, as any other."""
    result = Validation()
    seen: set[str] = set()
    for number, raw in enumerate(raw_lines, start=1):
        before_line(number)
        if not isinstance(raw, OversizedLine) and not raw.strip():
            continue
        result.requests += 1
        if result.requests > max_requests:
            result.fail("too_many_requests",
                        f"the file holds more than {max_requests} requests, this deployment's limit per "
                        "batch (REIN_BATCH_MAX_REQUESTS): split it into several batches", number)
            return result
        if isinstance(raw, OversizedLine):      # skipped unread (rein.openai.batch_lines.read_lines)
            result.fail("line_too_large", raw.message(number), number)
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            result.fail("invalid_json_line", f"not UTF-8 text (byte {exc.start})", number)
            continue
        try:
            line = parse_batch_line(text, number)
        except RequestError as exc:
            result.fail(exc.code if exc.code != "invalid_request_error" else "invalid_request",
                        exc.message, number, exc.param)
            continue
        if line.custom_id in seen:
            result.fail("duplicate_custom_id", f"custom_id {line.custom_id!r} appears on an earlier line; "
                                               "each request needs its own", number, "custom_id")
            continue
        seen.add(line.custom_id)
        if line.url != endpoint:
            result.fail("invalid_url", f"url {line.url!r} differs from the batch's endpoint {endpoint!r}",
                        number, "url")
            continue
        try:
            prepared = prepare(registry, endpoint, line.body, batch_line=True, images=images)
        except (RequestError, APIError) as exc:
            param = f"body.{exc.param}" if exc.param else "body"
            if on_failed is not None and exc.code in LINE_FAILURES:
                failed = _failed_line(registry, endpoint, number, line.custom_id, line.body, exc, result)
                if failed is not None:
                    result.failed_lines += 1
                    if result.ok:
                        on_failed(failed)
                    continue
            code = exc.code if exc.code != "invalid_request_error" else "invalid_request"
            result.fail(code or "invalid_request", exc.message, number, param)
            continue
        # A batch runs over one base model; its lines may name the base or any of its LoRA
        # adapters (their jobs share the base model's queues).
        model = prepared.entry.queue_model
        if result.model is None:
            result.model = model
        elif model != result.model:
            named = prepared.entry.name if prepared.entry.lora is None else \
                f"{prepared.entry.name} (a LoRA adapter of {model})"
            result.fail("mismatched_model", f"model {named!r} differs from {result.model!r} on the earlier "
                                            "lines: a batch runs one model (and its LoRA adapters)", number,
                        "body.model")
            continue
        if isinstance(prepared.parsed, ParsedEmbeddings):
            result.embedding_inputs += len(prepared.parsed.inputs)
            if max_embedding_inputs is not None and result.embedding_inputs > max_embedding_inputs:
                result.fail("too_many_embedding_inputs",
                            f"the batch's embedding inputs pass {max_embedding_inputs} at this line, this "
                            "deployment's limit per batch (REIN_BATCH_MAX_EMBEDDING_INPUTS; a string input "
                            "counts 1, a list counts each of its items): split the file into several batches",
                            number, "body.input")
                return result
        if result.ok:
            on_valid(ValidLine(number, line.custom_id, prepared))
            result.valid += 1
    if result.requests == 0 and result.ok:   # (a file of failed lines alone still runs: they are its errors)
        result.fail("empty_file", "the input file holds no requests (one JSON request per line)")
    return result


# The refusals that fail a line alone: its image (rein.openai.images.INVALID_IMAGE: corrupt, too
# large, a bomb, a fetch refused or timed out, too many images) or the file it names.
LINE_FAILURES = frozenset({INVALID_IMAGE, "file_not_found"})


def _failed_line(registry: ModelRegistry, endpoint: str, number: int, custom_id: str, body: dict[str, Any],
                 exc: RequestError | APIError, result: Validation) -> FailedLine | None:
    """The FailedLine of a line refused for its image; None when its model does not match the
    batch's (then that is its error, as for any line)."""
    entry = resolve_model(registry, body.get("model"))   # resolved before its images were looked at
    if result.model is None:
        result.model = entry.queue_model
    elif entry.queue_model != result.model:
        return None
    error = {"message": exc.message, "type": "invalid_request_error", "code": exc.code,
             "param": f"body.{exc.param}" if exc.param else "body"}
    return FailedLine(number, custom_id, entry.name, endpoint, body, error)
