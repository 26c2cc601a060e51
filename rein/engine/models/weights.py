"""Filling a native model from a checkpoint's Hugging Face-named tensors.

Every native model copies tensors in one at a time (a large checkpoint is never held twice
in memory), fuses some on the way (q/k/v, gate/up) and must end with every weight set: the
bookkeeping for that is here, the name mapping stays with each model.

Under tensor parallelism each rank asks for its `Shard` of a tensor (a range of one
dimension), and the getter reads only that range where the format allows (safetensors'
slices), so no rank holds the full checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rein.engine.parallel.group import SINGLE_RANK, ParallelGroup


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
    def __call__(self, name: str, shard: Shard | None = None) -> torch.Tensor | None:
        """The checkpoint tensor `name` (only `shard` of it, when given), or None if absent."""


class WeightLoader:
    """`put` model tensors from `get`-able checkpoint tensors; `finish` fails on any left unset."""

    def __init__(self, model: nn.Module, get: TensorGetter, group: ParallelGroup = SINGLE_RANK) -> None:
        self.own = model.state_dict()
        self.expected = set(self.own)
        self.loaded: set[str] = set()
        self.get = get
        self.group = group

    def shard(self, dim: int, uneven: bool = False) -> Shard | None:
        """This rank's part of dimension `dim`; None (the whole tensor) on a single rank."""
        if self.group.world_size == 1:
            return None
        return Shard(dim, self.group.rank, self.group.world_size, uneven)

    def take(self, name: str, shard: Shard | None = None) -> torch.Tensor:
        tensor = self.get(name, shard)
        if tensor is None:
            raise ValueError(f"checkpoint is missing weight {name}")
        return tensor

    def put(self, name: str, value: torch.Tensor, padded: bool = False) -> None:
        """Copy `value` into the model tensor `name`. `padded`: `value` may have fewer rows
        (a vocabulary shard past the end of the vocabulary); the rows it lacks are zeroed."""
        target = self.own[name]
        if padded and value.shape[1:] == target.shape[1:] and value.shape[0] < target.shape[0]:
            with torch.no_grad():
                target[value.shape[0]:].zero_()
            target = target[:value.shape[0]]
        if target.shape != value.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
        self.loaded.add(name)

    def fused(self, name: str, sources: list[str], shard: Shard | None = None) -> None:
        """One model tensor from several checkpoint tensors (`shard` of each) stacked on the
        output dimension."""
        self.put(name, torch.cat([self.take(source, shard) for source in sources]))

    def skip(self, name: str) -> None:
        """A model tensor the checkpoint legitimately lacks (the model drops the module)."""
        self.expected.discard(name)

    def finish(self) -> None:
        missing = self.expected - self.loaded
        if missing:
            raise ValueError(f"weights not found in the checkpoint: {', '.join(sorted(missing))}")
