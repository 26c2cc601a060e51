"""Sampling defaults a model ships in its generation_config.json, as vLLM applies them.

An instruct model often ships `temperature`, `top_p`, `top_k`, `min_p` or
`repetition_penalty` in generation_config.json; vLLM uses them as the defaults of every
request (`--generation-config auto`, its default), and rein does the same: a request's
own values always win, and only the fields a request leaves out take the model's.

`--generation-config` (REIN_GENERATION_CONFIG, `LLM(generation_config=...)`):

* `auto` (default): read generation_config.json from the model's directory (for a GGUF
  file, the cached directory rein made from its metadata); none there, no defaults.
* `vllm`: ignore it; the built-in defaults (temperature 1, top_p 1, no top_k/min_p,
  repetition_penalty 1) apply. `none` is accepted as another spelling of `vllm`.
* a folder path: read generation_config.json from that folder instead (it must exist).

As vLLM (which reads the file through transformers' `GenerationConfig.to_diff_dict()`),
a value equal to transformers' own default is not a model default: a file saying
`"top_k": 50` is transformers' default written out, not the model author's choice.
`max_new_tokens` and `do_sample` are not applied (rein's max_tokens defaults stand).

Torch-free: the API imports it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rein.engine.sampling_params import SamplingParams, SamplingParamsError

AUTO = "auto"
BUILTIN = "vllm"
BUILTIN_ALIASES = (BUILTIN, "none")
FILE_NAME = "generation_config.json"

# The SamplingParams fields a model's generation_config.json may default, with their types.
FIELDS: dict[str, type] = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                           "repetition_penalty": float}
# transformers' GenerationConfig defaults, which to_diff_dict() (and so vLLM) leaves out.
_TRANSFORMERS_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                                                  "repetition_penalty": 1.0}


class GenerationConfigError(ValueError):
    """--generation-config names nothing usable, or the file holds values rein cannot use."""


def check_generation_config(value: str) -> str:
    """`auto`, `vllm` (or `none`), or an existing folder; GenerationConfigError otherwise."""
    if value in (AUTO, *BUILTIN_ALIASES):
        return value
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise GenerationConfigError(
            f"generation_config {value!r} is neither 'auto', 'vllm' nor a folder: use auto (the model's "
            f"{FILE_NAME}), vllm (built-in defaults) or a folder holding a {FILE_NAME}")
    if not (folder / FILE_NAME).is_file():
        raise GenerationConfigError(f"generation_config folder {value} holds no {FILE_NAME}")
    return value


@dataclass(frozen=True)
class GenerationDefaults:
    """The sampling defaults in effect for one model; `values` holds only what the model sets."""

    values: Mapping[str, float | int] = field(default_factory=dict)
    source: str = "built-in defaults"

    def get(self, name: str, builtin: Any) -> Any:
        """The default of SamplingParams field `name`: the model's, else `builtin`."""
        return self.values.get(name, builtin)

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with these defaults (vLLM's `LLM.get_default_sampling_params()`)."""
        return SamplingParams(**{**self.values, **overrides})

    def describe(self) -> str:
        """For the start-up log line: the values in effect and where they come from."""
        builtin = SamplingParams()
        in_effect = {name: self.values.get(name, getattr(builtin, name)) for name in FIELDS}
        return f"{in_effect} ({self.source})"


def load_generation_defaults(model_dir: str | Path, generation_config: str = AUTO) -> GenerationDefaults:
    """The defaults `generation_config` (auto | vllm | none | a folder) gives the model in `model_dir`."""
    check_generation_config(generation_config)
    if generation_config in BUILTIN_ALIASES:
        return GenerationDefaults(source=f"--generation-config {generation_config}: the model's {FILE_NAME} ignored")
    folder = Path(model_dir if generation_config == AUTO else generation_config).expanduser()
    path = folder / FILE_NAME
    if not path.is_file():   # (a folder without one was refused above)
        return GenerationDefaults(source=f"the model has no {FILE_NAME}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}; fix it or use --generation-config vllm") from exc
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object; fix it or use --generation-config vllm")
    return GenerationDefaults(_sampling_values(data, path), source=str(path))


def _sampling_values(data: dict[str, Any], path: Path) -> dict[str, float | int]:
    values: dict[str, float | int] = {}
    for name, kind in FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        number_ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number_ok or (kind is int and value != int(value)):
            raise GenerationConfigError(f"{path}: {name} must be {'an integer' if kind is int else 'a number'}, "
                                        f"got {value!r}; fix it or use --generation-config vllm")
        value = kind(value)
        if value != _TRANSFORMERS_DEFAULTS.get(name):
            values[name] = value
    try:
        SamplingParams(**values)
    except SamplingParamsError as exc:
        raise GenerationConfigError(f"{path}: {exc}; fix it or use --generation-config vllm") from exc
    return values
