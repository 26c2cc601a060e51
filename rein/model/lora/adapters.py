"""A PEFT LoRA adapter directory read and mapped onto a loaded rein model.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` (older versions
`adapter_model.bin`), whose tensors are named after the Hugging Face model's modules:
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r]. rein fuses some of those modules (llama.py's `qkv_proj` = [q | k | v] and
`gate_up_proj` = [gate | up]), so a PEFT q_proj becomes the rows [0, q_size) of rein's
`layers.3.self_attn.qkv_proj`. The scaling PEFT applies at run time (lora_alpha / r, rsLoRA's
lora_alpha / sqrt(r), per module through rank_pattern / alpha_pattern) is folded into B here.

Everything that rein cannot run as PEFT would raises `AdapterError`, naming what is wrong and
what to change; nothing is silently dropped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rein.model.architectures.linear import Linear
from rein.model.implementation import TRANSFORMERS_FAMILY
from rein.model.lora.config import (
    BIN_FILE,
    CONFIG_FILE,
    SAFETENSORS_FILE,
    AdapterError,
    check_base_model,
    check_config,
    read_config,
)
from rein.model.lora.sharding import shard_adapter, whole_in_features, whole_parts
from rein.model.spec import ModelSpec

# PEFT module name -> (rein module name, which part of the fused output it is, of how many).
FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
EMBEDDINGS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")
# Prefixes of the Hugging Face module names that rein's native models drop (the causal LM's
# `model.`; Gemma 3's multimodal checkpoints' `model.language_model.`).
HF_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.(?P<adapter>[^.]+))?"
                         r"\.weight$")


@dataclass
class LoRATarget:
    """One PEFT module's adapter on a rein Linear: `lora_a` [r, in] and `lora_b` [stop - start, r]
    (the scaling folded in) adding to the output columns [start, stop) of `module`."""

    layer: int | None    # the decoder layer's index (None outside the layers)
    module: str          # rein's module path, e.g. "layers.3.self_attn.qkv_proj"
    start: int
    stop: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAWeights:
    """An adapter ready for `LoRAModel.activate`: its name, its largest rank and its targets."""

    name: str
    rank: int
    targets: list[LoRATarget] = field(default_factory=list)

    def by_module(self) -> dict[str, list[LoRATarget]]:
        grouped: dict[str, list[LoRATarget]] = {}
        for target in self.targets:
            grouped.setdefault(target.module, []).append(target)
        return grouped


def load_peft_adapter(path: str | Path, model: nn.Module, spec: ModelSpec, max_rank: int,
                      expected_base: str | None, check_base: bool = True) -> LoRAWeights:
    """Read the PEFT LoRA adapter in directory `path` for the loaded rein `model` of `spec`
    (or llama.cpp's GGUF form of one: a .gguf file, or a directory holding only that; see
    rein.model.lora.gguf_adapter).

    `max_rank`: the largest rank the server's slots hold (--max-lora-rank). `expected_base`:
    the base model the adapter must have been trained on (compared with the config's
    `base_model_name_or_path` when `check_base`; by whole name, or by its last path component
    so that a local copy of `org/name` matches). Returns CPU float32 tensors; under tensor
    parallelism (`model` one rank's shard) only that rank's part of them (rein.model.lora.sharding)."""
    directory = Path(path)
    name = directory.name
    if spec.family == TRANSFORMERS_FAMILY:
        raise AdapterError(f"adapter {name}: {spec.architecture} runs on the Transformers backend, whose layers "
                           f"are transformers' own nn.Linear modules, not rein's: LoRA is served only on rein's "
                           f"native architectures for now (serve the adapter merged into the base instead, "
                           f"e.g. PEFT's merge_and_unload)")
    from rein.model.lora.gguf_adapter import is_gguf_adapter, load_gguf_adapter

    gguf_file = is_gguf_adapter(directory)
    if gguf_file is not None:   # llama.cpp's form (convert_lora_to_gguf.py): no config, no base name
        return shard_adapter(load_gguf_adapter(gguf_file, model, spec, max_rank), model)
    config = read_config(directory)
    check_config(name, config)
    if check_base:
        check_base_model(name, config.get("base_model_name_or_path"), expected_base)
    tensors = read_tensors(directory)
    # Mapped onto the whole model's widths, then cut as this rank's shard of the base is.
    return shard_adapter(map_tensors(name, config, tensors, model, max_rank), model)


def read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = directory / SAFETENSORS_FILE, directory / BIN_FILE
    try:
        if safetensors_path.is_file():
            from safetensors.torch import load_file

            return load_file(str(safetensors_path))
        if bin_path.is_file():
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict):
                raise AdapterError(f"{bin_path} holds no state dict: save the adapter again with PEFT")
            return tensors
    except AdapterError:
        raise
    except Exception as exc:   # safetensors and pickle raise many types for a damaged file
        which = safetensors_path if safetensors_path.is_file() else bin_path
        raise AdapterError(f"{which} could not be read ({type(exc).__name__}: {exc}): the file is damaged or "
                           f"incomplete; save or download the adapter again") from exc
    raise AdapterError(f"{directory} has no {SAFETENSORS_FILE} (nor {BIN_FILE}): save the adapter with "
                       f"PeftModel.save_pretrained")


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key
    `k` for which `(.*\\.)?(k)$` matches the module's full name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def map_tensors(name: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], model: nn.Module,
                max_rank: int) -> LoRAWeights:
    embeddings = [key for key in tensors if "lora_embedding" in key]
    if embeddings:
        raise AdapterError(f"adapter {name} adapts an embedding ({embeddings[0]}), which rein does not: train "
                           f"with target_modules on the attention and MLP projections only")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in tensors.items():
        match = TENSOR_NAME.match(key)
        if match is None:
            unknown.append(key)
        else:
            pairs.setdefault(match["module"], {})[match["which"]] = tensor
    for hf_module in pairs:
        check_target(name, hf_module)   # an embedding or head target first: PEFT saves their base weights too
    for key in unknown:
        if "lora_magnitude" in key:
            raise AdapterError(f"adapter {name} has {key}: DoRA magnitudes are not served by rein; train "
                               f"with use_dora=False")
        raise AdapterError(f"adapter {name} has a tensor rein does not know how to apply ({key}): rein "
                           f"serves plain LoRA A/B weights only")
    if not pairs:
        raise AdapterError(f"adapter {name} has no LoRA weights: save it again with PEFT")

    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    targets: list[LoRATarget] = []
    for hf_module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"adapter {name}: {hf_module} has no {missing} weight; the file is incomplete, "
                               f"save the adapter again")
        rank = int(pattern_value(rank_pattern, hf_module, config["r"]))
        alpha = float(pattern_value(alpha_pattern, hf_module, config["lora_alpha"]))
        check_rank(name, hf_module, rank, max_rank)
        lora_a, lora_b = pair["A"], pair["B"]
        if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != rank or lora_b.shape[1] != rank:
            raise AdapterError(f"adapter {name}: {hf_module}'s lora_A {tuple(lora_a.shape)} and lora_B "
                               f"{tuple(lora_b.shape)} do not have the rank {rank} its {CONFIG_FILE} gives "
                               f"(r / rank_pattern): the files disagree, save the adapter again")
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        layer, path, start, stop = locate(name, hf_module, model)
        check_shapes(name, hf_module, tuple(lora_a.shape), tuple(lora_b.shape), whole_in_features(model, path),
                     stop - start)
        targets.append(LoRATarget(layer, path, start, stop, lora_a.float().contiguous(),
                                  (lora_b.float() * scaling).contiguous()))
    return LoRAWeights(name, max(t.rank for t in targets), targets)


def check_rank(name: str, hf_module: str, rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise AdapterError(f"adapter {name} has rank {rank} on {hf_module}, above the server's maximum LoRA "
                           f"rank {max_rank}: start the server with --max-lora-rank {rank} or more")


def check_shapes(name: str, hf_module: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...], in_features: int,
                 out_features: int) -> None:
    """A [r, in] and B [out, r] must fit the served model's module (its slice of a fused one)."""
    if a_shape[1] != in_features or b_shape[0] != out_features:
        raise AdapterError(f"adapter {name}: {hf_module} has lora_A {a_shape} and lora_B {b_shape}, but the served "
                           f"model's module takes {in_features} inputs and gives {out_features} outputs: the "
                           f"adapter was trained on another base model; serve it with its own base")


def check_target(name: str, hf_module: str) -> None:
    """Refuse the modules rein never adapts: embeddings, the LM head, MoE experts."""
    leaf = hf_module.rsplit(".", 1)[-1]
    if leaf in EMBEDDINGS:
        raise AdapterError(f"adapter {name} targets {hf_module} (an embedding or the LM head), which rein does not "
                           f"adapt: train with target_modules on the attention and MLP projections only")
    if ".experts." in hf_module + "." or leaf == "experts":
        raise AdapterError(f"adapter {name} targets the MoE experts ({hf_module}), which rein runs as grouped "
                           f"expert matmuls without LoRA: target the attention (and shared-expert) projections only")


def locate(name: str, hf_module: str, model: nn.Module) -> tuple[int | None, str, int, int]:
    """(layer index, rein module path, output start, stop) of a Hugging Face module name; the
    columns are the whole projection's (all tensor-parallel ranks' together)."""
    check_target(name, hf_module)
    path = hf_module
    for prefix in HF_PREFIXES:
        if path.startswith(prefix):
            path = path[len(prefix):]
            break
    parent, _, leaf = path.rpartition(".")
    fused, part = FUSED.get(leaf, (leaf, None))
    rein_path = f"{parent}.{fused}" if parent else fused
    try:
        module = model.get_submodule(rein_path)
    except AttributeError:
        module = None
    if not isinstance(module, Linear):
        raise AdapterError(f"adapter {name} targets {hf_module}, which the served model "
                           f"({type(model).__name__}) has no projection for: the adapter was trained on another "
                           f"architecture, or targets a module rein does not adapt; retrain with target_modules "
                           f"among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
    sizes = whole_parts(model, rein_path)
    start, stop = 0, sum(sizes)
    if part is not None:
        start = sum(sizes[:part])
        stop = start + sizes[part]
    numbers = re.search(r"(?:^|\.)layers\.(\d+)\.", rein_path)
    return (int(numbers[1]) if numbers else None), rein_path, start, stop
