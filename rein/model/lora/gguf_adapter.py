"""A LoRA adapter in llama.cpp's GGUF form read and mapped onto a loaded rein model.

llama.cpp's convert_lora_to_gguf.py turns a PEFT adapter into one GGUF file whose metadata
says `general.type` = "adapter", `adapter.type` = "lora", `adapter.lora.alpha` (float32) and
`general.architecture` (llama.cpp's name for the base, e.g. "llama" for Llama, Mistral and
Mixtral). Each adapted projection has two tensors named after llama.cpp's base tensor plus a
suffix, `blk.3.attn_q.weight.lora_a` and `blk.3.attn_q.weight.lora_b`. GGUF lists a tensor's
dimensions fastest first, so lora_a's ne is [in, r] and lora_b's [r, out]: read as arrays they
are PEFT's own A [r, in] and B [out, r]. Two things differ from PEFT's files:

* the scaling: llama.cpp applies alpha / r with r taken from each lora_b (alpha 0: 1). The
  converter writes lora_alpha alone, so rsLoRA's alpha / sqrt(r) and an alpha_pattern do not
  survive conversion (rank_pattern does: r is read per tensor); rein applies what llama.cpp
  applies to the file.
* the row order of B for the attention's q and k: the converter reorders the rows of the base's
  q/k weights (llama.cpp's rotary layout) and, since it goes through the same code, of their
  LoRA B matrices (A is untouched). rein's GGUF loader undoes that reordering for the base
  (transformers' tensor processors, rein.model.loader.gguf_tensors); the same processor undoes
  it here for B, so that B's rows meet the base's rows in Hugging Face order, whichever file
  the base came from.

Tensor names are mapped back with the gguf package's name table, through the Hugging Face
module names that adapters.py maps onto rein's (fused) modules; the rank, shape and target
checks are adapters.py's, so both formats refuse the same things with the same messages.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rein.model.architectures.linear import Linear
from rein.model.lora.adapters import (
    FUSED,
    AdapterError,
    LoRATarget,
    LoRAWeights,
    check_rank,
    check_shapes,
    locate,
)
from rein.model.lora.sharding import whole_in_features
from rein.model.spec import ModelSpec

SUFFIXES = {".lora_a": "A", ".lora_b": "B"}
# rein's family -> the general.architecture convert_hf_to_gguf writes for its Hugging Face
# architecture (Mistral and Mixtral are converted as "llama").
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                      "gemma3": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
# What llama.cpp's converter names the tensors rein never adapts (embedding, LM head).
EMBEDDING_TENSORS = ("token_embd.weight", "output.weight")


def is_gguf_adapter(path: Path) -> Path | None:
    """The GGUF file to read for an adapter `path`: the path itself if it is a .gguf file, or a
    directory's only .gguf file when it has no adapter_config.json (a PEFT directory); else None."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "adapter_config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            raise AdapterError(f"adapter directory {path} holds {len(ggufs)} GGUF files "
                               f"({', '.join(g.name for g in ggufs)}): give the path of the adapter's own file")
        if ggufs:
            return ggufs[0]
    return None


def load_gguf_adapter(path: Path, model: nn.Module, spec: ModelSpec, max_rank: int) -> LoRAWeights:
    """Read the llama.cpp GGUF LoRA adapter file `path` for the loaded rein `model` of `spec`
    (the served-model checks common to both formats are load_peft_adapter's, done before).
    Returns CPU float32 tensors, the scaling folded into B."""
    from rein.model.files import DamagedGGUFFile, checked_gguf_reader

    name = path.stem
    try:
        reader = checked_gguf_reader(path)
    except DamagedGGUFFile as exc:
        raise AdapterError(f"adapter {name}: {exc}") from exc
    architecture = check_metadata(name, path, reader, spec)
    alpha = float_field(reader, "adapter.lora.alpha") or 0.0
    pairs = read_pairs(name, path, reader)
    base_names = gguf_to_hf_names(architecture, model, spec)
    row_order = row_reordering(architecture, spec)

    targets: list[LoRATarget] = []
    for base_name, pair in sorted(pairs.items()):
        if base_name in EMBEDDING_TENSORS:
            raise AdapterError(f"adapter {name} adapts {base_name} (the embedding or the LM head), which rein does "
                               f"not adapt: train with target_modules on the attention and MLP projections only")
        hf_module = base_names.get(base_name)
        if hf_module is None:
            raise AdapterError(f"adapter {name} has LoRA weights for {base_name}, which the served model "
                               f"({type(model).__name__}, {spec.num_layers} layers) has no projection for: the "
                               f"adapter was converted from another base model; serve it with its own base")
        if set(pair) != {"A", "B"}:
            missing = ".lora_b" if "A" in pair else ".lora_a"
            raise AdapterError(f"adapter {name}: {base_name} has no {missing} tensor; the file is incomplete, "
                               f"convert the adapter again")
        lora_a, lora_b = pair["A"], pair["B"]
        if lora_a.ndim != 2 or lora_b.ndim != 2 or lora_a.shape[0] != lora_b.shape[1]:
            raise AdapterError(f"adapter {name}: {base_name}.lora_a {tuple(lora_a.shape)} and .lora_b "
                               f"{tuple(lora_b.shape)} (as [r, in] and [out, r]) do not share a rank: the file is "
                               f"damaged or not written by convert_lora_to_gguf; convert the adapter again")
        rank = lora_a.shape[0]
        check_rank(name, hf_module, rank, max_rank)
        layer, module_path, start, stop = locate(name, hf_module, model)
        check_shapes(name, hf_module, tuple(lora_a.shape), tuple(lora_b.shape),
                     whole_in_features(model, module_path), stop - start)
        order = row_order(base_name, lora_b.shape[0])
        if order is not None:
            lora_b = lora_b[order]
        scaling = alpha / rank if alpha else 1.0
        targets.append(LoRATarget(layer, module_path, start, stop, torch.from_numpy(np.array(lora_a, copy=True)),
                                  torch.from_numpy(np.array(lora_b * scaling, copy=True))))
    if not targets:
        raise AdapterError(f"adapter {name} ({path}) has no LoRA weights: convert the adapter again")
    return LoRAWeights(name, max(t.rank for t in targets), targets)


def string_field(reader: Any, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (UnicodeDecodeError, TypeError, IndexError):
        return None


def float_field(reader: Any, key: str) -> float | None:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    try:
        return float(field.parts[field.data[0]][0])
    except (TypeError, ValueError, IndexError):
        return None


def check_metadata(name: str, path: Path, reader: Any, spec: ModelSpec) -> str:
    """Refuse a GGUF that is not a LoRA adapter, or one for another architecture; return its
    general.architecture."""
    general_type = string_field(reader, "general.type")
    if general_type != "adapter":
        what = "a model" if general_type in (None, "model") else f"of general.type {general_type!r}"
        raise AdapterError(f"adapter {name}: {path} is {what}, not a LoRA adapter (general.type is "
                           f"{general_type!r}, an adapter's is 'adapter'): give a file written by llama.cpp's "
                           f"convert_lora_to_gguf.py, or serve this file as a model")
    adapter_type = string_field(reader, "adapter.type")
    if adapter_type != "lora":
        raise AdapterError(f"adapter {name}: {path} is a {adapter_type!r} adapter (adapter.type); rein serves LoRA "
                           f"adapters only")
    architecture = string_field(reader, "general.architecture")
    expected = GGUF_ARCHITECTURES.get(spec.family)
    if architecture != expected:
        raise AdapterError(f"adapter {name} was converted for llama.cpp architecture {architecture!r} "
                           f"(general.architecture), but the served model ({spec.architecture}) is "
                           f"{expected!r}: serve the adapter with the base it was trained on")
    return architecture


def read_pairs(name: str, path: Path, reader: Any) -> dict[str, dict[str, np.ndarray]]:
    """llama.cpp's base tensor name -> {"A": [r, in], "B": [out, r]} as float32 arrays."""
    from gguf import GGMLQuantizationType, dequantize

    pairs: dict[str, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        suffix = next((s for s in SUFFIXES if tensor.name.endswith(s)), None)
        if suffix is None:
            # mergekit-extract-lora adds norm vectors, which llama.cpp skips without a word;
            # rein refuses rather than serve less than the adapter holds.
            raise AdapterError(f"adapter {name} has a tensor rein does not know how to apply ({tensor.name}): "
                               f"rein serves plain LoRA .lora_a / .lora_b weights only")
        try:
            values = dequantize(tensor.data, GGMLQuantizationType(tensor.tensor_type))
        except (NotImplementedError, ValueError) as exc:
            kind = GGMLQuantizationType(tensor.tensor_type).name
            raise AdapterError(f"adapter {name}: {tensor.name} is stored as {kind}, which rein cannot read for an "
                               f"adapter ({exc}): convert the adapter with --outtype f32, f16, bf16 or q8_0") from exc
        pairs.setdefault(tensor.name.removesuffix(suffix), {})[SUFFIXES[suffix]] = np.asarray(values, np.float32)
    return pairs


def gguf_to_hf_names(architecture: str, model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """llama.cpp's tensor name ("blk.3.attn_q.weight") -> the Hugging Face module name
    ("model.layers.3.self_attn.q_proj") of every projection rein's model can adapt."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    names = get_tensor_name_map(arch, spec.num_layers)
    parts = {}
    for fused, (rein_leaf, _) in FUSED.items():
        parts.setdefault(rein_leaf, []).append(fused)
    mapped: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        parent, _, leaf = path.rpartition(".")
        for hf_leaf in parts.get(leaf, [leaf]):
            hf_module = f"model.{parent}.{hf_leaf}" if parent else f"model.{hf_leaf}"
            gguf_name = names.get_name(hf_module)
            if gguf_name is not None:
                mapped[f"{gguf_name}.weight"] = hf_module
    return mapped


def row_reordering(architecture: str, spec: ModelSpec) -> Callable[[str, int], np.ndarray | None]:
    """A function (base tensor name, rows) -> the row order that undoes what the converter did
    to that tensor's rows (None: nothing), from the tensor processor rein's GGUF loader uses."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = {"num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
              "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size}
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)

    def order(base_name: str, rows: int) -> np.ndarray | None:
        probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        result = np.asarray(processor.process(weights=probe, name=base_name).weights).reshape(-1)
        if result.shape != (rows,) or not np.array_equal(np.sort(result), probe[:, 0]):
            raise AdapterError(f"{base_name}: llama.cpp's converter transforms this tensor in a way other than "
                               f"reordering rows, which rein cannot undo for a LoRA B matrix")
        if np.array_equal(result, probe[:, 0]):
            return None
        return result.astype(np.int64)

    return order

