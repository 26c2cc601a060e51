"""The model side of LoRA: adapters in slots, their products added inside the step's forward.

`enable_lora(model, max_loras, max_rank, device, dtype)` wraps a loaded native rein model;
`activate(slot, weights)` puts an adapter (rein.model.lora.adapters.LoRAWeights) in one of
`max_loras` slots, `deactivate(slot)` empties it. Inside `with lora_model.step(token_slots):`
every rein `Linear` that an active adapter targets adds, for each adapter that has tokens in
the step, `(x[rows] @ A.T) @ B.T` to its output at those rows (rows of slot -1 run the base
alone). The products are grouped by adapter: one pair of small matmuls per adapter per module,
whatever the number of its tokens; a fused projection's parts (qkv_proj's q, k and v) are one
pair too, their A stacked and their B block-diagonal. The base matmul is untouched, so a
quantized or oneDNN-packed base takes the same float adapters.

The hook is `Linear.lora` (rein.model.architectures.linear), set only on the projections some
active adapter targets and cleared when none does: a model without LoRA runs as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from rein.model.architectures.linear import Linear
from rein.model.lora.adapters import LoRATarget, LoRAWeights


class LoRALinear:
    """One projection's adapters by slot: (start, stop, A [R, in], B [stop - start, R]), where the
    module's targets are stacked along R and B covers the output columns [start, stop)."""

    def __init__(self, owner: LoRAModel) -> None:
        self.owner = owner
        self.slots: dict[int, tuple[int, int, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        groups = self.owner.groups
        if not groups:
            return out
        rows_x = x.reshape(-1, x.shape[-1])
        rows_out = out.view(-1, out.shape[-1])
        if rows_x.shape[0] != self.owner.num_tokens:
            raise RuntimeError(f"a LoRA projection got {rows_x.shape[0]} rows in a step of "
                               f"{self.owner.num_tokens} tokens: LoRA applies to the layers' projections only")
        for slot, rows in groups:
            entry = self.slots.get(slot)
            if entry is None:
                continue
            start, stop, lora_a, lora_b = entry
            if rows is None:   # every token of the step runs this adapter
                rows_out[:, start:stop] += ((rows_x.to(lora_a.dtype) @ lora_a.T) @ lora_b.T).to(out.dtype)
            else:
                delta = (rows_x.index_select(0, rows).to(lora_a.dtype) @ lora_a.T) @ lora_b.T
                rows_out[:, start:stop].index_add_(0, rows, delta.to(out.dtype))
        return out


class LoRAModel:
    """A loaded rein model with `max_loras` adapter slots of rank up to `max_rank` (see the module)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_rank must be at least 1 (got {max_loras} and {max_rank})")
        if not any(isinstance(module, Linear) for module in model.modules()):
            raise ValueError(f"{type(model).__name__} has no rein Linear projections (the Transformers backend "
                             f"runs transformers' own layers): LoRA is served on rein's native architectures only")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.device = torch.device(device)
        self.dtype = dtype
        self.active: dict[int, LoRAWeights] = {}
        self.layers: dict[str, LoRALinear] = {}
        # During a step: (slot, rows of its tokens, None for all of them) per adapter in it.
        self.groups: list[tuple[int, torch.Tensor | None]] = []
        self.num_tokens = 0

    @classmethod
    def enable(cls, model: nn.Module, max_loras: int, max_rank: int, device: torch.device | str,
               dtype: torch.dtype) -> LoRAModel:
        return cls(model, max_loras, max_rank, device, dtype)

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range: there are {self.max_loras} (--max-loras)")

    def activate(self, slot: int, weights: LoRAWeights) -> None:
        """Copy `weights` into `slot` (replacing whatever adapter was there)."""
        self.check_slot(slot)
        if weights.rank > self.max_rank:
            raise ValueError(f"adapter {weights.name} has rank {weights.rank}, above the maximum LoRA rank "
                             f"{self.max_rank}: start the server with --max-lora-rank {weights.rank} or more")
        self.deactivate(slot)
        for path, targets in weights.by_module().items():
            module = self.model.get_submodule(path)
            if not isinstance(module, Linear):
                raise ValueError(f"adapter {weights.name} targets {path}, which is not a projection of this model")
            layer = self.layers.get(path)
            if layer is None:
                layer = self.layers[path] = LoRALinear(self)
                module.lora = layer
            layer.slots[slot] = self.stacked(targets)
        self.active[slot] = weights

    def stacked(self, targets: list[LoRATarget]) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """One module's targets as one A [sum of ranks, in] and a block-diagonal B over their columns."""
        start, stop = min(t.start for t in targets), max(t.stop for t in targets)
        lora_a = torch.cat([t.lora_a for t in targets])
        lora_b = torch.zeros(stop - start, lora_a.shape[0])
        offset = 0
        for t in targets:
            lora_b[t.start - start:t.stop - start, offset:offset + t.rank] = t.lora_b
            offset += t.rank
        return (start, stop, lora_a.to(self.device, self.dtype).contiguous(),
                lora_b.to(self.device, self.dtype).contiguous())

    def deactivate(self, slot: int) -> None:
        """Empty `slot` (nothing to do when it is empty); projections no adapter targets lose the hook."""
        self.check_slot(slot)
        if self.active.pop(slot, None) is None:
            return
        for path in list(self.layers):
            layer = self.layers[path]
            layer.slots.pop(slot, None)
            if not layer.slots:
                self.model.get_submodule(path).lora = None
                del self.layers[path]

    @contextmanager
    def step(self, token_slots: torch.Tensor) -> Iterator[None]:
        """Run the forward inside this block with token t under the adapter in slot
        token_slots[t] (an int tensor [T]; -1: the base model alone)."""
        slots = torch.as_tensor(token_slots).reshape(-1)
        present = [int(s) for s in torch.unique(slots).tolist() if s >= 0]
        missing = [s for s in present if s not in self.active]
        if missing:
            raise ValueError(f"the step's tokens use LoRA slots {missing}, which hold no adapter "
                             f"(active: {sorted(self.active)})")
        groups: list[tuple[int, torch.Tensor | None]] = []
        if len(present) == 1 and bool((slots == present[0]).all()):
            groups.append((present[0], None))
        else:
            for slot in present:
                rows = torch.nonzero(slots == slot).reshape(-1).to(self.device)
                groups.append((slot, rows))
        self.groups, self.num_tokens = groups, slots.numel()
        try:
            yield
        finally:
            self.groups, self.num_tokens = [], 0


def enable_lora(model: nn.Module, max_loras: int, max_rank: int, device: torch.device | str,
                dtype: torch.dtype) -> LoRAModel:
    """`model` (a loaded native rein model) with `max_loras` LoRA slots of rank up to `max_rank`,
    the adapters kept on `device` in `dtype`."""
    return LoRAModel(model, max_loras, max_rank, device, dtype)
