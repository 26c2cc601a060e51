"""The served models as the API needs them: each one's tokenizer, context length and
sampling defaults; and the LoRA adapters served over them (rein.jobs.adapters).

Loaded once at startup (transformers' AutoTokenizer needs no torch), so a request only
tokenizes. The context length is REIN_MODELS' `@N` when given, else REIN_MAX_MODEL_LEN,
otherwise the model's `config.json` `max_position_embeddings` (or the tokenizer's
model_max_length). The tokenizer and its chat template are chosen as the engine's are
(REIN_TOKENIZER, REIN_CHAT_TEMPLATE, REIN_TRUST_REMOTE_CODE: rein.model.tokenizer_files), so the
API builds the prompts a worker would. The sampling defaults are the model's generation_config.json under
REIN_GENERATION_CONFIG (rein.engine.generation_defaults), passed to parse_request, so a job's
params are fixed, defaults included, when the API accepts it. The tool call parser
(REIN_TOOL_CALL_PARSER, else the chat template's format) is stored with each job that has tools.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rein.core.settings import ServedModel, Settings
from rein.core.tool_call_parser_names import HERMES
from rein.engine.generation_defaults import (
    GenerationConfigError,
    GenerationDefaults,
    load_generation_defaults,
)
from rein.jobs.adapters import AdapterCatalog, AdapterRef
from rein.model.files import resolve_model
from rein.model.tokenizer_files import TokenizerOptions
from rein.openai.reasoning import ModelReasoning, ReasoningParserError, parsers_by_model
from rein.openai.tool_call_parsers import detect_tool_call_parser

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A served model's tokenizer or config could not be loaded; the message says which."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str
    tokenizer: Any
    max_model_len: int
    generation_defaults: GenerationDefaults = GenerationDefaults()
    directory: Path | None = None    # its files (the pooling config of /v1/embeddings)
    lora: AdapterRef | None = None
    """A LoRA adapter's entry: the adapter (its base model's tokenizer, length and defaults)."""
    tool_call_parser: str = HERMES
    """The format of its auto tool answers: REIN_TOOL_CALL_PARSER, else its chat template's
    (rein.openai.tool_call_parsers)."""
    reasoning: ModelReasoning | None = None
    """Its reasoning parser (REIN_REASONING_PARSER, rein.openai.reasoning); None: none."""
    vision_processor: Any = None
    """A vision-language model's image processor (rein.model.vision.processor.VisionProcessor:
    expands a prompt's image placeholders into the images' tokens); None: a text-only model."""

    @property
    def queue_model(self) -> str:
        """The model whose queues its jobs wait on: an adapter's base, else its own name."""
        return self.lora.base if self.lora is not None else self.name


class ModelRegistry:
    """name -> ModelEntry for every served model, in REIN_MODELS order; `get` also finds the
    LoRA adapters of `adapters` (an entry of the base model's, with `lora` set)."""

    def __init__(self, entries: list[ModelEntry], adapters: AdapterCatalog | None = None) -> None:
        self._entries = {entry.name: entry for entry in entries}
        self.adapters = adapters

    @classmethod
    def load(cls, settings: Settings) -> ModelRegistry:
        """The served models; LoRA adapters are REIN_LORA_MODULES' until `adapters` is given a
        catalog that also reads Postgres (the API's)."""
        try:
            parsers = parsers_by_model(settings.reasoning_parser, [model.name for model in settings.models])
        except ReasoningParserError as exc:
            raise ModelLoadError(str(exc)) from None
        return cls([load_model(model, settings.generation_config, settings.max_model_len,
                               TokenizerOptions.of(settings), settings.revision, settings.tool_call_parser,
                               parsers.get(model.name))
                    for model in settings.models], AdapterCatalog.from_settings(settings))

    def get(self, name: str) -> ModelEntry | None:
        entry = self._entries.get(name)
        if entry is not None or self.adapters is None:
            return entry
        adapter = self.adapters.get(name)
        base = self._entries.get(adapter.base) if adapter is not None else None
        return None if base is None else replace(base, name=adapter.name, lora=adapter)  # type: ignore[union-attr]

    def __iter__(self):
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def default(self) -> ModelEntry | None:
        return next(iter(self._entries.values()), None)


def load_model(model: ServedModel, generation_config: str = "auto", max_model_len: int | str | None = None,
               tokenizer_options: TokenizerOptions | None = None, revision: str | None = None,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> ModelEntry:
    """`max_model_len`: REIN_MAX_MODEL_LEN (the entry's @N comes first); `tokenizer_options` (default:
    the model's tokenizer as it is) and `revision`: REIN_TOKENIZER and the rest, REIN_REVISION;
    `tool_call_parser`: REIN_TOOL_CALL_PARSER (None: the one the chat template teaches);
    `reasoning_parser`: its reasoning parser's name (REIN_REASONING_PARSER), None: none."""
    tokenizer_options = tokenizer_options or TokenizerOptions()
    try:
        files = resolve_model(model.source, weights=False, revision=revision)
        directory = files.directory
        tokenizer = files.load_tokenizer(tokenizer_options)
    except Exception as exc:  # a missing path, hub errors offline, no gguf package, ...
        raise ModelLoadError(f"cannot load the tokenizer of model {model.name!r} from {model.source!r}: "
                             f"{exc}") from exc
    try:
        defaults = load_generation_defaults(directory, generation_config)
    except GenerationConfigError as exc:
        raise ModelLoadError(f"model {model.name!r}: {exc}") from exc
    # "auto" is the engine's to fit (rein.engine.model_runner): the API checks the model's own length.
    requested = max_model_len if isinstance(max_model_len, int) else None
    max_model_len = (model.max_model_len or requested or _config_max_len(directory)
                     or _tokenizer_max_len(tokenizer))
    if not max_model_len:
        raise ModelLoadError(f"model {model.name!r}: cannot tell its context length; add @N to its "
                             f"REIN_MODELS entry (e.g. {model.name}={model.source}@4096)")
    log.info("model %s: tokenizer from %s%s, max_model_len %d", model.name, tokenizer_options.tokenizer or model.source,
             ", chat template from --chat-template" if tokenizer_options.chat_template is not None else "",
             max_model_len)
    log.info("generation defaults for model %s: %s", model.name, defaults.describe())
    parser = tool_call_parser or detect_tool_call_parser(getattr(tokenizer, "chat_template", None))
    log.info("model %s: tool calls parsed as %s%s", model.name, parser,
             "" if tool_call_parser else " (from its chat template)")
    reasoning = None
    if reasoning_parser is not None:
        try:
            reasoning = ModelReasoning.of(reasoning_parser, tokenizer, f"model {model.name!r}")
        except ReasoningParserError as exc:
            raise ModelLoadError(str(exc)) from None
        log.info("model %s: reasoning parser %s", model.name, reasoning_parser)
    vision = _vision_processor(directory, model.name, tokenizer)
    return ModelEntry(model.name, model.source, tokenizer, max_model_len, defaults, directory,
                      tool_call_parser=parser, reasoning=reasoning, vision_processor=vision)


def _vision_processor(directory: Path, name: str, tokenizer: Any) -> Any:
    """The model's image processor when its config.json describes a vision-language model (a
    `vision_config`); None otherwise, without importing the vision code (and its torch) at all."""
    path = directory / "config.json"
    if not path.is_file() or "vision_config" not in json.loads(path.read_text()):
        return None
    try:
        from rein.model.vision.processor import load_vision_processor

        processor = load_vision_processor(directory, tokenizer)
    except Exception as exc:   # a processor file missing or malformed, a family rein does not run
        raise ModelLoadError(f"model {name!r} is a vision-language model, but its image processor cannot be "
                             f"loaded: {exc}") from exc
    if processor is not None:
        log.info("model %s: takes images (%s)", name, type(processor).__name__)
    return processor


def _config_max_len(directory: Path) -> int | None:
    path = directory / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    config = config.get("text_config", config)
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def _tokenizer_max_len(tokenizer: Any) -> int | None:
    value = getattr(tokenizer, "model_max_length", None)
    # transformers uses a huge sentinel (1e30) when the length is unknown.
    return int(value) if isinstance(value, int) and 0 < value < 10**7 else None
