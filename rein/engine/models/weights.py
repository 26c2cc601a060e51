"""Filling a native model from a checkpoint's Hugging Face-named tensors.

Every native model copies tensors in one at a time (a large checkpoint is never held twice
in memory), fuses some on the way (q/k/v, gate/up) and must end with every weight set: the
bookkeeping for that is here, the name mapping stays with each model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

TensorGetter = Callable[[str], "torch.Tensor | None"]


class WeightLoader:
    """`put` model tensors from `get`-able checkpoint tensors; `finish` fails on any left unset."""

    def __init__(self, model: nn.Module, get: TensorGetter) -> None:
        self.own = model.state_dict()
        self.expected = set(self.own)
        self.loaded: set[str] = set()
        self.get = get

    def take(self, name: str) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise ValueError(f"checkpoint is missing weight {name}")
        return tensor

    def put(self, name: str, value: torch.Tensor) -> None:
        target = self.own[name]
        if target.shape != value.shape:
            raise ValueError(f"weight {name}: checkpoint shape {tuple(value.shape)} != model {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(value)
        self.loaded.add(name)

    def fused(self, name: str, sources: list[str]) -> None:
        """One model tensor from several checkpoint tensors stacked on the output dimension."""
        self.put(name, torch.cat([self.take(source) for source in sources]))

    def skip(self, name: str) -> None:
        """A model tensor the checkpoint legitimately lacks (the model drops the module)."""
        self.expected.discard(name)

    def finish(self) -> None:
        missing = self.expected - self.loaded
        if missing:
            raise ValueError(f"weights not found in the checkpoint: {', '.join(sorted(missing))}")
