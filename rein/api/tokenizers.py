"""The served models as the API needs them: each one's tokenizer and context length.

Loaded once at startup (transformers' AutoTokenizer needs no torch), so a request only
tokenizes. The context length is REIN_MODELS' `@N` when given, otherwise the model's
`config.json` `max_position_embeddings` (or the tokenizer's model_max_length).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rein.core.settings import ServedModel, Settings

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A served model's tokenizer or config could not be loaded; the message says which."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    source: str
    tokenizer: Any
    max_model_len: int


class ModelRegistry:
    """name -> ModelEntry for every served model, in REIN_MODELS order."""

    def __init__(self, entries: list[ModelEntry]) -> None:
        self._entries = {entry.name: entry for entry in entries}

    @classmethod
    def load(cls, settings: Settings) -> ModelRegistry:
        return cls([load_model(model) for model in settings.models])

    def get(self, name: str) -> ModelEntry | None:
        return self._entries.get(name)

    def __iter__(self):
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def default(self) -> ModelEntry | None:
        return next(iter(self._entries.values()), None)


def load_model(model: ServedModel) -> ModelEntry:
    from transformers import AutoTokenizer

    from rein.model_files import resolve_model

    try:
        directory = resolve_model(model.source, weights=False).directory
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:  # a missing path, hub errors offline, no gguf package, ...
        raise ModelLoadError(f"cannot load the tokenizer of model {model.name!r} from {model.source!r}: "
                             f"{exc}") from exc
    max_model_len = model.max_model_len or _config_max_len(directory) or _tokenizer_max_len(tokenizer)
    if not max_model_len:
        raise ModelLoadError(f"model {model.name!r}: cannot tell its context length; add @N to its "
                             f"REIN_MODELS entry (e.g. {model.name}={model.source}@4096)")
    log.info("model %s: tokenizer from %s, max_model_len %d", model.name, model.source, max_model_len)
    return ModelEntry(model.name, model.source, tokenizer, max_model_len)


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
