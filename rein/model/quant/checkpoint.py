"""How a checkpoint's tensors reach the model quantized: the getters that hand out
`QuantizedWeight`s (AWQ/GPTQ checkpoints, weights quantized at load), and what the load log
reports about the result. The `--quantization` names are rein.model.quant.names'.

A model's projections ask their getter for `quantized=True` tensors (rein.model.architectures.weights);
every other tensor is asked for as float. The getters here wrap the checkpoint's own:

* `packed_checkpoint`: an AWQ or GPTQ checkpoint stores `X.qweight`, `X.qzeros`, `X.scales` (and
  `X.g_idx`) for a projection `X.weight`; they are repacked (rein.model.quant.methods), or
  dequantized for a caller that wants float.
* `quantized_at_load`: `--quantization int8 | int4[-gN]` quantizes each float projection
  weight as it is read, so the float checkpoint is never held whole.

GGUF files' blocks are repacked by the GGUF getter itself (rein.model.loader, with
rein.model.quant.gguf_blocks).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from rein.kernels.quantized import CpuPanels, Int8Panels, QuantizedWeight
from rein.kernels.quantized_experts import QuantizedExperts
from rein.model.architectures.weights import Shard, TensorGetter
from rein.model.quant.methods import (
    QuantizationConfig,
    awq_weight,
    gptq_weight,
    quantize_int4,
    quantize_int8,
)
from rein.model.quant.names import int4_group

log = logging.getLogger(__name__)

UNQUANTIZED = ("embed_tokens.weight", "lm_head.weight")   # never quantized at load


@dataclass
class LoadReport:
    """What a load kept quantized and what it had to dequantize, for the load log."""

    quantized: Counter = field(default_factory=Counter)      # source format -> tensors
    dequantized: Counter = field(default_factory=Counter)    # source format -> tensors (no kernel / shape)
    # source format -> stacked expert tensors (a GGUF file's ffn_{gate,up,down}_exps) kept quantized
    experts: Counter = field(default_factory=Counter)

    def describe(self, resident: int) -> str:
        parts = [f"weights: {resident / 2**20:.1f} MiB resident"]
        if self.quantized:
            parts.append("kept quantized: " + ", ".join(f"{k} x{v}" for k, v in sorted(self.quantized.items())))
        if self.experts:
            parts.append("MoE experts kept quantized: "
                         + ", ".join(f"{k} x{v}" for k, v in sorted(self.experts.items())))
        if self.dequantized:
            parts.append("dequantized (no kernel for the type or shape): "
                         + ", ".join(f"{k} x{v}" for k, v in sorted(self.dequantized.items())))
        return "; ".join(parts)


def resident_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: parameters, buffers and quantized weights (a Linear's
    `quantized`, a MoE block's QuantizedExperts)."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()) if not t.is_meta)
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (QuantizedWeight, CpuPanels, Int8Panels, QuantizedExperts)):
                total += value.nbytes()
    return total


def shard_of(weight: QuantizedWeight, shard: Shard | None, name: str) -> QuantizedWeight | None:
    """`shard` of a quantized weight; None where the cut splits a group (dequantize instead)."""
    if shard is None:
        return weight
    cut = shard.slices(weight.shape, name)[shard.dim]
    if shard.dim == 0:
        return weight.narrow_rows(cut.start, cut.stop - cut.start)
    return weight.narrow_cols(cut.start, cut.stop - cut.start)


def packed_checkpoint(get: TensorGetter, config: QuantizationConfig, dtype: torch.dtype,
                      report: LoadReport) -> TensorGetter:
    """A getter over an AWQ / GPTQ checkpoint: `X.weight` of a packed projection comes from its
    qweight, qzeros, scales (and g_idx)."""

    def lookup(name: str, shard: Shard | None = None, quantized: bool = False):
        tensor = get(name, shard)
        if tensor is not None or not name.endswith(".weight"):
            return tensor
        stem = name.removesuffix(".weight")
        qweight = get(stem + ".qweight")
        if qweight is None:
            return None
        qzeros, scales = get(stem + ".qzeros"), get(stem + ".scales")
        if config.method == "awq":
            weight = awq_weight(qweight, qzeros, scales, config.group_size, config.bits)
        else:
            weight = gptq_weight(qweight, qzeros, scales, get(stem + ".g_idx"), config.group_size, config.bits,
                                 config.checkpoint_format)
        part = shard_of(weight, shard, name)
        if quantized and part is not None:
            report.quantized[weight.source] += 1
            return part
        dense = weight.dequantize(dtype)
        if shard is not None:
            dense = dense[shard.slices(dense.shape, name)]
        if quantized:
            report.dequantized[weight.source] += 1
        return dense

    return lookup


def quantized_at_load(get: TensorGetter, method: str, report: LoadReport) -> TensorGetter:
    """A getter that quantizes each float projection weight it is asked for quantized
    (`method`: int8, int4, int4-gN); tensors already quantized pass through. The embedding and
    the LM head stay as they are, as AWQ and GPTQ checkpoints keep them: the logits are the
    most sensitive to rounding, and a table lookup reads a few rows only."""

    def lookup(name: str, shard: Shard | None = None, quantized: bool = False):
        if not quantized or name.endswith(UNQUANTIZED):
            return get(name, shard)
        tensor = get(name, shard, True)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:   # absent, already quantized, not a matrix
            return tensor
        try:
            weight = quantize_int8(tensor) if method == "int8" else quantize_int4(tensor, int4_group(method))
        except ValueError as exc:   # a shape the group does not fit: keep it float, say so
            log.warning("%s stays %s: %s", name, str(tensor.dtype).removeprefix("torch."), exc)
            report.dequantized[method] += 1
            return tensor
        report.quantized[weight.source] += 1
        return weight

    return lookup


# GGUF types kept quantized -> (bits, group, has an offset): rein.model.quant.gguf_blocks. The
# 5- and 6-bit forms hold GGUF's float16 x int8 scales, not float32 ones, so their bytes come
# from gguf_blocks.held_bytes rather than `quantized_bytes`.
GGUF_FORMS = {"Q4_0": (4, 32, True), "Q4_1": (4, 32, True), "Q4_K": (4, 32, True), "Q5_0": (5, 32, False),
              "Q5_1": (5, 32, True), "Q8_0": (8, 32, False), "Q5_K": (5, 32, True), "Q6_K": (6, 16, False)}


def quantized_bytes(rows: int, cols: int, bits: int, group: int, offset: bool) -> int:
    """Bytes of a QuantizedWeight of that shape and form (integers, float32 scales and offsets)."""
    return rows * cols * bits // 8 + rows * (cols // group) * 4 * (2 if offset else 1)


def projection_shapes(spec) -> list[tuple[int, int]]:
    """(rows, cols) of every projection a native model holds quantized when the checkpoint or
    --quantization has it so (attention's q, k, v, o; the dense MLPs' and shared experts' gate,
    up, down; and each routed expert's, rein.kernels.quantized_experts)."""
    q, kv, hidden = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.hidden_size
    shapes = []
    for sparse in spec.sparse_layers:
        shapes += [(q, hidden), (kv, hidden), (kv, hidden), (hidden, q)]
        inter = spec.shared_expert_intermediate_size if sparse else spec.intermediate_size
        if inter:
            shapes += [(inter, hidden), (inter, hidden), (hidden, inter)]
        if sparse:
            expert = spec.moe_intermediate_size
            shapes += [(expert, hidden), (expert, hidden), (hidden, expert)] * spec.num_experts
    return shapes


def estimated_weight_bytes(spec, directory, element_size: int, quantization: str = "auto") -> tuple[int, str]:
    """The weights' resident bytes as rein would load them, and how they were counted: a GGUF
    file's blocks as repacked, an AWQ/GPTQ checkpoint's or --quantization's projections at their
    integer width; everything else at `element_size` bytes per parameter."""
    import json
    from pathlib import Path

    from rein.model.files import TENSOR_INDEX
    from rein.model.quant.methods import read_quantization_config

    directory = Path(directory)
    float_bytes = spec.num_parameters() * element_size
    index_path = directory / TENSOR_INDEX
    if index_path.is_file():
        if quantization == "none":
            return float_bytes, ""
        return _gguf_bytes(json.loads(index_path.read_text())["tensors"], element_size)
    config_path = directory / "config.json"
    packed = read_quantization_config(json.loads(config_path.read_text())) if config_path.is_file() else None
    if packed is not None and quantization != "none":
        method, bits, group = packed.method.upper(), 4, packed.group_size
    elif quantization == "int8":
        method, bits, group = "int8", 8, None
    elif quantization.startswith("int4"):
        method, bits, group = quantization, 4, int4_group(quantization)
    else:
        return float_bytes, ""
    shapes = projection_shapes(spec)
    held = sum(quantized_bytes(r, c, bits, group if group and group > 0 and c % group == 0 else c, True)
               for r, c in shapes)
    return float_bytes - sum(r * c for r, c in shapes) * element_size + held, f"projections {method}"


def _gguf_bytes(tensors: dict, element_size: int) -> tuple[int, str]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from rein.model.quant.gguf_blocks import held_bytes

    total, kinds = 0, Counter()
    for entry in tensors.values():
        qtype = GGMLQuantizationType(entry["type"])
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        shape = entry["shape"]
        numel = 1
        for size in shape[:-1]:
            numel *= size
        cols = shape[-1] // type_bytes * block if block > 1 else shape[-1]   # quantized rows are bytes
        form = GGUF_FORMS.get(qtype.name)
        if form is not None and len(shape) in (2, 3):   # 3-D: a MoE layer's stacked experts
            total += held_bytes(qtype.name, numel, cols)
            kinds[qtype.name] += 1
        else:
            total += numel * cols * element_size
    return total, "GGUF kept quantized: " + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items()))
