"""Embedding requests: how a model pools its hidden states, and what a request asks of it.

No torch here (the API validates `dimensions` with it); the tensor side is
`rein.engine.pooler`.

How a model pools is read from its files, as vLLM and sentence-transformers do:

* `modules.json` (sentence-transformers) names a `sentence_transformers.models.Pooling`
  module whose `config.json` (e.g. `1_Pooling/config.json`) sets one `pooling_mode_*` flag
  true: `pooling_mode_lasttoken` (Qwen3-Embedding, most decoder embedders),
  `pooling_mode_mean_tokens` or `pooling_mode_cls_token`. A `Normalize` module in
  `modules.json` means the vectors are L2-normalized.
* Without `modules.json`, a decoder model embeds as vLLM's default for them: the last
  token's hidden state, L2-normalized.

Matryoshka (`dimensions`): as vLLM, only a model that declares it in config.json
(`is_matryoshka: true`, or a `matryoshka_dimensions` list of the sizes it was trained for)
may be asked for fewer dimensions; the vector is cut to the first `dimensions` values and
normalized again. Other models are refused: their cut vectors would be poor.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LAST, MEAN, CLS = "last", "mean", "cls"
POOLING_TYPES = (LAST, MEAN, CLS)

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' pooling_mode_* flags -> rein's pooling types.
_ST_MODES = {
    "pooling_mode_lasttoken": LAST,
    "pooling_mode_mean_tokens": MEAN,
    "pooling_mode_cls_token": CLS,
}
# Modes sentence-transformers has that rein does not compute.
_ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")


class PoolingError(ValueError):
    """An embedding request this model cannot answer; `param` names the parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class PoolingParams:
    """What an embedding request asks beyond its tokens (vLLM's PoolingParams).

    `dimensions`: keep the first this many values (Matryoshka), normalized again;
    None: the model's full hidden size. `normalize`: None follows the model's files.
    Passing PoolingParams instead of SamplingParams to `LLMEngine.add_request` makes the
    request an embedding request.
    """

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise PoolingError(f"dimensions must be a positive integer, got {self.dimensions!r}", "dimensions")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise PoolingError(f"normalize must be a boolean, got {self.normalize!r}", "normalize")


@dataclass(frozen=True)
class PoolingConfig:
    """How a model turns hidden states into one vector (read by `read_pooling_config`)."""

    pooling_type: str = LAST
    normalize: bool = True
    hidden_size: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default"         # where pooling_type came from, for logs and errors
    unsupported_mode: str | None = None   # a sentence-transformers mode rein cannot compute

    def check(self, params: PoolingParams, model: str = "this model") -> None:
        """Raise PoolingError if the model cannot answer `params` (dimensions, pooling mode)."""
        if self.unsupported_mode is not None:
            raise PoolingError(
                f"{model} pools with sentence-transformers' {self.unsupported_mode} ({self.source}), which rein "
                f"does not compute; rein pools with {', '.join(_ST_MODES)}", "model")
        dimensions = params.dimensions
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise PoolingError(
                f"{model} does not support matryoshka representation (its config.json declares neither "
                f"is_matryoshka nor matryoshka_dimensions), so changing its output dimensions would give "
                f"poor embeddings; leave out dimensions", "dimensions")
        if self.hidden_size is not None and dimensions > self.hidden_size:
            raise PoolingError(f"dimensions must be at most {self.hidden_size} (the model's embedding size), "
                               f"got {dimensions}", "dimensions")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise PoolingError(f"{model} supports dimensions {', '.join(map(str, self.matryoshka_dimensions))} "
                               f"only, got {dimensions}", "dimensions")

    def resolve(self, params: PoolingParams) -> tuple[bool, int | None]:
        """(normalize, dimensions) for a request: its own, else the model's."""
        normalize = self.normalize if params.normalize is None else params.normalize
        dimensions = params.dimensions
        if dimensions is not None and self.hidden_size is not None and dimensions >= self.hidden_size:
            dimensions = None
        return normalize, dimensions


def read_pooling_config(model_dir: str | Path) -> PoolingConfig:
    """The model's pooling, from its sentence-transformers files and config.json (see the
    module docstring). Unreadable files count as absent, with a warning."""
    return _read(str(Path(model_dir).resolve()))


@lru_cache(maxsize=16)
def _read(model_dir: str) -> PoolingConfig:
    directory = Path(model_dir)
    config = _json(directory / "config.json") or {}
    config = config.get("text_config", config)
    hidden = config.get("hidden_size") if isinstance(config.get("hidden_size"), int) else None
    dims = config.get("matryoshka_dimensions")
    dims = tuple(int(d) for d in dims) if isinstance(dims, list) and dims else None
    matryoshka = bool(config.get("is_matryoshka")) or dims is not None
    common: dict[str, Any] = {"hidden_size": hidden, "is_matryoshka": matryoshka, "matryoshka_dimensions": dims}

    modules = _json(directory / "modules.json")
    if not isinstance(modules, list):
        return PoolingConfig(**common)
    normalize = any(isinstance(m, dict) and m.get("type") == _ST_NORMALIZE for m in modules)
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return PoolingConfig(normalize=normalize, source="modules.json (no Pooling module)", **common)
    where = f"{pooling.get('path') or '.'}/config.json"
    settings = _json(directory / where) or {}
    chosen = [name for name, value in settings.items() if name.startswith("pooling_mode_") and value is True]
    known = [_ST_MODES[name] for name in chosen if name in _ST_MODES]
    if known:
        return PoolingConfig(pooling_type=known[0], normalize=normalize, source=where, **common)
    other = next((name for name in chosen if name in _ST_OTHER_MODES), None)
    if other is not None:
        return PoolingConfig(normalize=normalize, source=where, unsupported_mode=other, **common)
    return PoolingConfig(normalize=normalize, source=f"{where} (no pooling_mode set)", **common)


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s (%s): ignored", path, exc)
        return None
