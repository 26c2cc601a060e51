"""Request preparation: resolve the served model, tokenize and check the body (the API's intake and batch validation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rein.core.images import ImageInput
from rein.jobs.errors import APIError
from rein.jobs.image_sources import RequestImages, image_refs_of
from rein.jobs.registry import ModelEntry, ModelRegistry
from rein.openai.embeddings import ParsedEmbeddings, model_pooling, parse_embeddings_request
from rein.openai.endpoints import CHAT_COMPLETIONS, EMBEDDINGS, RESPONSES
from rein.openai.errors import RequestError
from rein.openai.images import PromptImages, image_refs
from rein.openai.priority import RequestedPriority, parse_priority
from rein.openai.request import ParsedRequest, parse_request
from rein.openai.responses import parse_responses_request


@dataclass
class Prepared:
    entry: ModelEntry
    endpoint: str
    body: dict[str, Any]
    parsed: ParsedRequest | ParsedEmbeddings
    requested: RequestedPriority = RequestedPriority()
    """Its `priority` and `service_tier` (rein.openai.priority)."""
    batch_line: bool = False
    images: list[ImageInput] = field(default_factory=list)
    """Its images in prompt order (a vision model's chat request), to store before its job is
    queued (rein.jobs.image_sources.store_images); the job names them by sha256."""

    @property
    def image_refs(self) -> list[dict[str, str]] | None:
        """What the job's params and message hold of its images; None: it has none."""
        return image_refs_of(self.images) if self.images else None

    @property
    def priority(self) -> int:
        """The priority its job runs at (rein.core.priorities)."""
        return self.requested.job_priority(self.batch_line)

    @property
    def lora(self) -> dict[str, Any] | None:
        """The LoRA adapter the request runs under, as jobs store it (params["lora"]); None: the base."""
        return self.entry.lora.to_dict() if self.entry.lora is not None else None

    @property
    def tool_parser(self) -> str | None:
        """The tool call parser its answer is read with, as jobs store it (params["tool_parser"]):
        the model's, for a chat request with tools; None otherwise."""
        tools = self.body.get("tools") if isinstance(self.body, dict) else None
        return self.entry.tool_call_parser if tools else None

    @property
    def requested_tokens(self) -> int:
        """Prompt + max_tokens per generated choice: the most the request may cost (embeddings:
        their inputs)."""
        if isinstance(self.parsed, ParsedEmbeddings):
            return len(self.parsed.prompt_token_ids)
        return len(self.parsed.prompt_token_ids) + self.parsed.params.n * self.parsed.params.max_tokens

    def charged_tokens(self, completion_estimate: int) -> int:
        """What the request is charged against its key's TPM when admitted: prompt +
        max_tokens when the body gives max_tokens (or max_completion_tokens), as OpenAI
        charges; otherwise prompt + the completion estimate, capped by the default max_tokens
        (what the context leaves). The worker settles it against the real usage. Embeddings:
        their input tokens, all they cost."""
        if isinstance(self.parsed, ParsedEmbeddings):
            return len(self.parsed.prompt_token_ids)
        explicit = any(self.body.get(name) is not None
                       for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"))
        completion = self.parsed.params.max_tokens
        if not explicit:
            completion = min(completion, completion_estimate)
        # The prompt is computed once, every generated choice (n, best_of) costs its own completion.
        return len(self.parsed.prompt_token_ids) + self.parsed.params.n * completion


def resolve_model(registry: ModelRegistry, name: Any) -> ModelEntry:
    """The served model (or LoRA adapter) a body's `model` names, the default when None
    (RequestError 400 for a non-string, APIError 404 for an unknown name)."""
    if name is not None and not isinstance(name, str):
        raise RequestError("model must be a string", "model")
    entry = registry.get(name) if name is not None else registry.default
    if entry is None:
        if name is None:
            raise APIError(404, "No model is served by this deployment.", param="model",
                           code="model_not_found")
        served = ", ".join(e.name for e in registry) or "none"
        raise APIError(404, f"The model '{name}' does not exist or you do not have access to it "
                            f"(served: {served}).", param="model", code="model_not_found")
    return entry


def prepare(registry: ModelRegistry, endpoint: str, body: dict[str, Any], batch_line: bool = False,
            images: RequestImages | None = None) -> Prepared:
    """Resolve the model and tokenize + validate the body (APIError 404 / RequestError 400);
    `batch_line`: the body of a batch line (its priority is the batch class's). `images`: how
    this caller's image parts become images (rein.jobs.image_sources; None: a request with
    images is refused)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", "body")
    name = body.get("model")
    entry = resolve_model(registry, name)
    prompt_images, inputs = request_images(entry, endpoint, body, images)
    if endpoint == EMBEDDINGS:
        if entry.lora is not None:
            raise RequestError(f"'{name}' is a LoRA adapter of {entry.lora.base!r}: adapters serve completions, "
                               f"not embeddings; embed with model {entry.lora.base!r}", "model",
                               code="model_not_supported")
        parsed: ParsedRequest | ParsedEmbeddings = parse_embeddings_request(
            body, entry.tokenizer, entry.max_model_len, model_pooling(entry.directory))
    elif endpoint == RESPONSES:
        # Runs as the chat body it translates to; the job keeps the Responses body (`body`).
        parsed = parse_responses_request(body, entry.tokenizer, entry.max_model_len, entry.generation_defaults,
                                         entry.tool_call_parser, entry.reasoning, prompt_images)
    else:
        parsed = parse_request(endpoint, body, entry.tokenizer, entry.max_model_len, entry.generation_defaults,
                               entry.tool_call_parser, entry.reasoning, prompt_images)
    return Prepared(entry, endpoint, body, parsed, parse_priority(body, batch_line), batch_line, inputs)


def request_images(entry: ModelEntry, endpoint: str, body: dict[str, Any], loader: RequestImages | None
                    ) -> tuple[PromptImages | None, list[ImageInput]]:
    """A chat (or Responses) request's images, loaded and opened, with the model's processor to
    expand them; (None, []) for a request without images (a text-only model's prompt then
    refuses any image part itself, rein.openai.prompts)."""
    processor = entry.vision_processor
    if processor is None or endpoint not in (CHAT_COMPLETIONS, RESPONSES):
        return None, []     # the prompt says "this model takes no images" at the first image part
    # Responses: from its input items, whose image parts the chat body keeps in the same order
    # (rein.openai.responses), so each error names the item the user wrote.
    refs = image_refs(body.get("messages")) if endpoint == CHAT_COMPLETIONS else image_refs(body.get("input"), "input")
    if not refs:
        return PromptImages(processor, [], []), []
    if loader is None:
        raise RequestError("images are not taken on this path: send them through the API", refs[0].param)
    inputs, opened = loader.load(refs)
    return PromptImages(processor, opened, [ref.detail for ref in refs]), inputs
