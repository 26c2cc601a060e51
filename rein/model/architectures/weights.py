"""Filling a native model from a checkpoint's Hugging Face-named tensors.

Every native model copies tensors in one at a time (a large checkpoint is never held twice
in memory), fuses some on the way (q/k/v, gate/up) and must end with every weight set: the
bookkeeping for that is here, the name mapping stays with each model.

Under tensor parallelism each rank asks for its `Shard` of a tensor (a range of one
dimension), and the getter reads only that range where the format allows (safetensors'
slices), so no rank holds the full checkpoint.

A projection's weight (`WeightLoader.linear`) and the embedding may come as a
`QuantizedWeight` (a GGUF file's blocks, an AWQ/GPTQ checkpoint, --quantization at load):
the module then keeps it quantized (`Linear.quantized`) and its float weight is dropped.
Every other tensor is asked for as float, which a getter gives by dequantizing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rein.kernels.quantized import CpuPanels, QuantizedWeight, stack_rows
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup


@dataclass(frozen=True)
class Shard:
    """Part `index` of `count` of dimension `dim` of a checkpoint tensor.

    Parts are equal; a size that does not divide is refused unless `uneven` (the vocabulary:
    parts of ceil(size / count), so the last ones are shorter or empty)."""

    dim: int
    index: int
    count: int
    uneven: bool = False

    def slices(self, shape: list[int] | tuple[int, ...], name: str) -> tuple[slice, ...]:
        """The index of this part in a tensor of `shape` (for torch, numpy and safetensors' slices)."""
        size = shape[self.dim]
        if size % self.count and not self.uneven:
            raise ValueError(f"weight {name}: dimension {self.dim} of size {size} does not split "
                             f"into {self.count} equal parts")
        part = -(-size // self.count)
        start = min(size, self.index * part)
        return (slice(None),) * self.dim + (slice(start, min(size, start + part)),)


class TensorGetter(Protocol):
    def __call__(self, name: str, shard: Shard | None = None,
                 quantized: bool = False) -> torch.Tensor | QuantizedWeight | None:
        """The checkpoint tensor `name` (only `shard` of it, when given), or None if absent.
        `quantized`: the caller takes a QuantizedWeight where the checkpoint has one (else a
        float tensor, dequantized if need be)."""


def dropped(tensor: torch.Tensor) -> nn.Parameter:
    """The empty stand-in for a float weight a module holds quantized instead (same dtype and
    device, no memory)."""
    return nn.Parameter(torch.empty(0, dtype=tensor.dtype, device=tensor.device), requires_grad=False)


class WeightLoader:
    """`put` model tensors from `get`-able checkpoint tensors; `finish` fails on any left unset."""

    def __init__(self, model: nn.Module, get: TensorGetter, group: ParallelGroup = SINGLE_RANK) -> None:
        self.modules = dict(model.named_modules())
        self.own = model.state_dict()
        self.expected = set(self.own)
        self.loaded: set[str] = set()
        self.get = get
        self.group = group

    def shard(self, dim: int, uneven: bool = False, replicas: int = 1) -> Shard | None:
        """This rank's part of dimension `dim`; None (the whole tensor) on a single rank.
        `replicas`: that many consecutive ranks hold the same part (KV heads replicated past
        their count, rein.model.parallel.layers), so the tensor splits into world_size / replicas."""
        if self.group.world_size == 1:
            return None
        return Shard(dim, self.group.rank // replicas, self.group.world_size // replicas, uneven)

    def take(self, name: str, shard: Shard | None = None, quantized: bool = False) -> torch.Tensor | QuantizedWeight:
        tensor = self.get(name, shard, quantized) if quantized else self.get(name, shard)
        if tensor is None:
            raise ValueError(f"checkpoint is missing weight {name}")
        return tensor

    def linear(self, name: str, sources: list[str], shard: Shard | list[Shard | None] | None = None) -> None:
        """A projection's weight `name` from checkpoint tensors stacked on the output rows (one,
        or q/k/v, gate/up), kept quantized when every part comes quantized. `shard`: one for
        every source, or a list with each source's own (q's heads and replicated KV heads)."""
        shards = shard if isinstance(shard, list) else [shard] * len(sources)
        self.put(name, self._stacked([self.take(source, part, quantized=True)
                                      for source, part in zip(sources, shards, strict=True)], name))

    def _stacked(self, parts: list[torch.Tensor | QuantizedWeight], name: str) -> torch.Tensor | QuantizedWeight:
        if all(isinstance(part, QuantizedWeight) for part in parts):
            return parts[0] if len(parts) == 1 else stack_rows(parts)
        dtype = self.own[name].dtype
        floats = [part.dequantize(dtype) if isinstance(part, QuantizedWeight) else part for part in parts]
        return floats[0] if len(floats) == 1 else torch.cat(floats)

    def put(self, name: str, value: torch.Tensor | QuantizedWeight, padded: bool = False) -> None:
        """Copy `value` into the model tensor `name`. `padded`: `value` may have fewer rows
        (a vocabulary shard past the end of the vocabulary); the rows it lacks are zeroed."""
        target = self.own[name]
        if isinstance(value, QuantizedWeight):
            return self._put_quantized(name, value, padded)
        if padded and value.shape[1:] == target.shape[1:] and value.shape[0] < target.shape[0]:
            with torch.no_grad():
                target[value.shape[0]:].zero_()
            target = target[:value.shape[0]]
        if target.shape != value.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
        self.loaded.add(name)

    def _put_quantized(self, name: str, value: QuantizedWeight, padded: bool) -> None:
        """Hand the module owning weight `name` the quantized weight (on its device); a module
        that cannot hold one gets it dequantized."""
        owner, _, attribute = name.rpartition(".")
        module = self.modules.get(owner)
        target = self.own[name]
        if attribute != "weight" or not hasattr(module, "quantized") or target.dim() != 2:
            return self.put(name, value.dequantize(target.dtype), padded)
        if padded and value.rows < target.shape[0]:
            value = value.padded_rows(target.shape[0])
        if value.shape != tuple(target.shape):
            raise ValueError(f"weight {name}: checkpoint shape {value.shape} != model {tuple(target.shape)}")
        # On the CPU, the C kernel's panels right away: one weight's row-major copy at a time.
        module.quantized = CpuPanels.from_weight(value) if target.device.type == "cpu" else value.to(target.device)
        module.weight = dropped(target)
        self.loaded.add(name)

    def fused(self, name: str, sources: list[str], shard: Shard | list[Shard | None] | None = None) -> None:
        """One model tensor from several checkpoint tensors (`shard` of each, or each its own
        from a list, as `linear`) stacked on the output dimension."""
        shards = shard if isinstance(shard, list) else [shard] * len(sources)
        self.put(name, torch.cat([self.take(source, part) for source, part in zip(sources, shards, strict=True)]))

    def skip(self, name: str) -> None:
        """A model tensor the checkpoint legitimately lacks (the model drops the module)."""
        self.expected.discard(name)

    def finish(self) -> None:
        missing = self.expected - self.loaded
        if missing:
            raise ValueError(f"weights not found in the checkpoint: {', '.join(sorted(missing))}")
