"""The model side of LoRA: adapters in slots, their products added inside the step's forward.

`enable_lora(model, max_loras, max_rank, device, dtype)` wraps a loaded native rein model;
`activate(slot, weights)` puts an adapter (rein.model.lora.adapters.LoRAWeights) in one of
`max_loras` slots, `deactivate(slot)` empties it. Inside `with lora_model.step(token_slots):`
every rein `Linear` that an active adapter targets adds, to the output row of each token t whose
slot s = token_slots[t] is not -1, `B[s] @ (A[s] @ x[t])` (rows of slot -1 run the base alone).
The base matmul is untouched, so a quantized or oneDNN-packed base takes the same float adapters.

Layout: each targeted projection holds one `LoRAPart` per output range an adapter targets (a
plain projection has one; a fused one, qkv_proj or gate_up_proj, one per PEFT module it fuses:
q, k and v each add to their own columns), allocated the first time an adapter targets it, so an
untargeted projection costs nothing. A part is two stacks over the slots, the layout of
rein.kernels.triton_lora's lora_shrink / lora_expand:

    lora_a [max_loras, max_rank, in]          lora_b [max_loras, N, max_rank]

adding to the output columns [offset, offset + N). On the CPU the memory holds each slot's A.T
[in, R] and B.T [R, N], the operands of (x @ A.T) @ B.T, and the two stacks are transposed views
of it (same shapes): the C kernel's products then run along vectors of ranks and of output
columns. (With B's rows [R] contiguous it transposed tiles of B per chunk of tokens, which cost
more than the products at decode's 8 tokens an adapter.) An adapter of a smaller rank is zero-padded
to max_rank (the padding adds zeros; the work is that of max_rank). `activate` copies an adapter
into its slot of each part it targets, `deactivate` zeroes the slot; `live` [max_loras] marks the
slots a part holds an adapter in, so the kernels skip the others' tokens.

Per step, `step` sorts the tokens by slot once (`TokensBySlot`); each part is then one call:
csrc/lora_cpu.c on a float32 CPU model (each adapter's A and B read once for its tokens, not once
per token), else the grouped torch path (one gather of the sorted rows, one pair of small matmuls
per adapter on its run of rows, one scatter back): under REIN_CPU_FAST_PATHS=0, without a C
compiler, and for bfloat16 or float16. On CUDA each part is rein.kernels.triton_lora's shrink and
expand (grouped GEMMs over the tokens sorted by slot on the device, `LoRABatch`, made once a
step beside TokensBySlot).

The hook is `Linear.lora` (rein.model.architectures.linear), set only on the projections some
active adapter targets and cleared when none does: a model without LoRA runs as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rein.kernels import cpu_native
from rein.model.architectures.linear import Linear
from rein.model.lora.adapters import LoRATarget, LoRAWeights

# Tokens of one slot the C kernel handles together (its A and B read once for them): enough to
# amortize the read, few enough that a step's chunks spread over the threads.
CHUNK_TOKENS = 16


@dataclass
class TokensBySlot:
    """One step's tokens by adapter slot, worked out once for every projection of the step.

    `order`: the tokens of slots >= 0 sorted by slot (stable), int64 on the adapters' device;
    `runs`: (slot, begin, end) per slot present, its tokens order[begin:end]; `chunks`: the runs
    cut to at most CHUNK_TOKENS, int64 [C, 3] on the CPU (the C kernel's work list); `everyone`:
    the slot every token runs under, or None when the step mixes slots or has base tokens."""

    num_tokens: int
    order: torch.Tensor
    runs: list[tuple[int, int, int]]
    chunks: torch.Tensor
    everyone: int | None
    kernel: Any = None
    """On CUDA: the step's rein.kernels.triton_lora.LoRABatch (its tokens sorted on the device)."""

    @classmethod
    def prepare(cls, token_slots: torch.Tensor, device: torch.device) -> TokensBySlot:
        slots = torch.as_tensor(token_slots).reshape(-1).to("cpu", torch.int64)
        adapted = torch.nonzero(slots >= 0).reshape(-1)
        by_slot = torch.sort(slots[adapted], stable=True)
        order = adapted[by_slot.indices]
        present, counts = torch.unique_consecutive(by_slot.values, return_counts=True)
        runs, chunks, begin = [], [], 0
        for slot, count in zip(present.tolist(), counts.tolist(), strict=True):
            runs.append((slot, begin, begin + count))
            chunks.extend((slot, b, min(b + CHUNK_TOKENS, begin + count)) for b in range(begin, begin + count,
                                                                                         CHUNK_TOKENS))
            begin += count
        everyone = runs[0][0] if len(runs) == 1 and runs[0][2] == slots.numel() else None
        return cls(slots.numel(), order.to(device), runs, torch.tensor(chunks, dtype=torch.int64).reshape(-1, 3),
                   everyone)


class LoRAPart:
    """One output range [offset, offset + N) of a projection: its per-slot stacks (see the module)."""

    def __init__(self, offset: int, cols: int, in_features: int, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.offset = offset
        if device.type == "cpu":   # views of A.T [S, in, R] and B.T [S, R, N]: see the module
            self.lora_a = torch.zeros(max_loras, in_features, max_rank, dtype=dtype).transpose(1, 2)
            self.lora_b = torch.zeros(max_loras, max_rank, cols, dtype=dtype).transpose(1, 2)
        else:
            self.lora_a = torch.zeros(max_loras, max_rank, in_features, device=device, dtype=dtype)
            self.lora_b = torch.zeros(max_loras, cols, max_rank, device=device, dtype=dtype)
        self.live = torch.zeros(max_loras, dtype=torch.uint8)   # the C kernel's copy of `held`
        self.held: set[int] = set()

    def fill(self, slot: int, target: LoRATarget) -> None:
        rank = target.rank
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.lora_a[slot, :rank].copy_(target.lora_a)
        self.lora_b[slot, :, :rank].copy_(target.lora_b)
        self.live[slot] = 1
        self.held.add(slot)

    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.live[slot] = 0
        self.held.discard(slot)


class LoRALinear:
    """One projection's adapter parts, keyed by their output range (start, stop)."""

    def __init__(self, owner: LoRAModel, in_features: int) -> None:
        self.owner = owner
        self.in_features = in_features
        self.parts: dict[tuple[int, int], LoRAPart] = {}

    def part(self, start: int, stop: int) -> LoRAPart:
        found = self.parts.get((start, stop))
        if found is None:
            owner = self.owner
            found = self.parts[(start, stop)] = LoRAPart(start, stop - start, self.in_features, owner.max_loras,
                                                         owner.max_rank, owner.device, owner.dtype)
        return found

    @property
    def holds_any(self) -> bool:
        return any(part.held for part in self.parts.values())

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.owner.batch
        if batch is None or not batch.runs:
            return out
        rows_x = x.reshape(-1, x.shape[-1])
        rows_out = out.view(-1, out.shape[-1])
        if rows_x.shape[0] != batch.num_tokens:
            raise RuntimeError(f"a LoRA projection got {rows_x.shape[0]} rows in a step of "
                               f"{batch.num_tokens} tokens: LoRA applies to the layers' projections only")
        if out.device.type == "cuda":
            _apply_cuda(rows_x, rows_out, self.parts.values(), batch)
            return out
        for part in self.parts.values():
            if not cpu_native.lora_apply(rows_x, rows_out, part.offset, part.lora_a, part.lora_b, batch.order,
                                         batch.chunks, part.live):
                _apply_torch(rows_x, rows_out, part, batch)
        return out


def _apply_cuda(x: torch.Tensor, out: torch.Tensor, parts: Iterable[LoRAPart], batch: TokensBySlot) -> None:
    """The CUDA path: per part, rein.kernels.triton_lora's shrink (x @ A.T for each token's slot,
    into a float32 [T, R]) and expand (its B product added to the part's columns of `out`). A
    part's slots that hold no adapter are zeros, so their tokens add nothing; a part none of the
    step's adapters holds is skipped. Without the step's LoRABatch, the grouped torch products."""
    if batch.kernel is None:
        for part in parts:
            _apply_torch(x, out, part, batch)
        return
    from rein.kernels.triton_lora import lora_expand, lora_shrink

    present = {slot for slot, _, _ in batch.runs}
    for part in parts:
        if part.held & present:
            lora_expand(lora_shrink(x, part.lora_a, batch.kernel), part.lora_b, out, part.offset, batch.kernel)


def _apply_torch(x: torch.Tensor, out: torch.Tensor, part: LoRAPart, batch: TokensBySlot) -> None:
    """One part's products in torch, grouped by adapter: the step's adapted rows gathered in slot
    order once, a pair of small matmuls per adapter on its run of them, one scatter back."""
    runs = [run for run in batch.runs if run[0] in part.held]
    if not runs:
        return
    lora_a, lora_b = part.lora_a, part.lora_b
    cols = slice(part.offset, part.offset + lora_b.shape[1])
    if batch.everyone is not None:
        slot = batch.everyone
        out[:, cols] += ((x.to(lora_a.dtype) @ lora_a[slot].T) @ lora_b[slot].T).to(out.dtype)
        return
    gathered = x.index_select(0, batch.order).to(lora_a.dtype)
    delta = torch.zeros(gathered.shape[0], lora_b.shape[1], device=out.device, dtype=lora_a.dtype)
    for slot, begin, end in runs:
        delta[begin:end] = (gathered[begin:end] @ lora_a[slot].T) @ lora_b[slot].T
    out[:, cols].index_add_(0, batch.order, delta.to(out.dtype))


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
        # Every projection an adapter has targeted (its buffers stay, hooked or not).
        self.layers: dict[str, LoRALinear] = {}
        # During a step: its tokens by slot, worked out once for every projection.
        self.batch: TokensBySlot | None = None

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
                layer = self.layers[path] = LoRALinear(self, module.in_features)
            for target in targets:
                layer.part(target.start, target.stop).fill(slot, target)
            module.lora = layer
        self.active[slot] = weights

    def deactivate(self, slot: int) -> None:
        """Empty `slot` (nothing to do when it is empty); projections no adapter targets lose the hook."""
        self.check_slot(slot)
        if self.active.pop(slot, None) is None:
            return
        for path, layer in self.layers.items():
            for part in layer.parts.values():
                if slot in part.held:
                    part.clear(slot)
            if not layer.holds_any:
                self.model.get_submodule(path).lora = None

    @contextmanager
    def step(self, token_slots: torch.Tensor) -> Iterator[None]:
        """Run the forward inside this block with token t under the adapter in slot
        token_slots[t] (an int tensor [T]; -1: the base model alone)."""
        batch = TokensBySlot.prepare(token_slots, self.device)
        if self.device.type == "cuda" and batch.runs:
            from rein.kernels.triton_lora import LoRABatch

            batch.kernel = LoRABatch.prepare(torch.as_tensor(token_slots, device=self.device).reshape(-1),
                                             self.max_loras)
        missing = [slot for slot, _, _ in batch.runs if slot not in self.active]
        if missing:
            raise ValueError(f"the step's tokens use LoRA slots {missing}, which hold no adapter "
                             f"(active: {sorted(self.active)})")
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None


def enable_lora(model: nn.Module, max_loras: int, max_rank: int, device: torch.device | str,
                dtype: torch.dtype) -> LoRAModel:
    """`model` (a loaded native rein model) with `max_loras` LoRA slots of rank up to `max_rank`,
    the adapters kept on `device` in `dtype`."""
    return LoRAModel(model, max_loras, max_rank, device, dtype)
