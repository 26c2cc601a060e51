"""An adapter cut for one tensor-parallel rank, as the loader cuts the base weights it adds to.

rein shards its projections Megatron's way (rein.model.parallel.layers), the loader cutting
each checkpoint tensor into N equal parts (llama.py's load_attention / load_mlp):

* column-parallel, `qkv_proj` and `gate_up_proj`: rank r holds part r of each fused part's
  output rows (its query heads, its KV heads, its value heads; its gate rows, its up rows),
  one after another. An adapter's A stays whole and B keeps the rows of the rank's outputs,
  its [start, stop) moved to the rank's own columns;
* row-parallel, `o_proj` and `down_proj`: rank r holds part r of the input columns and its
  output is a partial sum, which the layer all-reduces after the projection -- after its LoRA
  hook too, which runs inside `Linear.forward`. So A keeps the rank's input columns and B stays
  whole: the ranks' (x_r A_r^T) B^T add up to (x A^T) B^T in that all-reduce;
* anything else an adapter may target (a MoE router `gate`, `shared_expert_gate`) is whole on
  every rank, and so is its adapter.

A k or v part splits by KV heads like q by query heads, into N parts -- or, where the ranks
outnumber the KV heads and replicate them (rein.model.parallel.layers), into num_kv_heads
parts, rank r holding part r // (N / num_kv_heads): the ranks sharing a KV head all keep its
adapter rows.

`load_peft_adapter` (rein.model.lora.adapters) maps an adapter onto the whole model's widths
(`whole_parts`, `whole_in_features`: this rank's times N where the loader split them) and
then calls `shard_adapter`; on one rank both change nothing.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from rein.model.parallel.layers import kv_replicas

if TYPE_CHECKING:
    from rein.model.lora.adapters import LoRATarget, LoRAWeights

COLUMN_PARALLEL = frozenset({"qkv_proj", "gate_up_proj"})
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def ranks_of(model: nn.Module) -> tuple[int, int]:
    """(this rank, number of ranks) of the group `model` was built with ((0, 1) without one)."""
    group = getattr(model, "group", None)
    if group is None:
        return 0, 1
    return group.rank, group.world_size


def split_of(path: str) -> Literal["column", "row"] | None:
    """How the ranks split the projection at `path`: by output rows, by input columns, or not."""
    leaf = path.rpartition(".")[2]
    if leaf in COLUMN_PARALLEL:
        return "column"
    if leaf in ROW_PARALLEL:
        return "row"
    return None


def fused_sizes(parent: nn.Module, fused: str, module: nn.Linear) -> list[int]:
    """This rank's output widths of a fused projection's parts: [q, k, v] or [gate, up]."""
    if fused == "qkv_proj":
        return [parent.q_size, parent.kv_size, parent.kv_size]
    half = module.out_features // 2
    return [half, half]


def part_splits(model: nn.Module, path: str) -> list[tuple[int, int]]:
    """For each part of the projection at `path` (as `local_parts`), (which part of the whole
    this rank holds, into how many parts the ranks split it): a k or v part of replicated KV
    heads splits into fewer parts than there are ranks."""
    rank, world_size = ranks_of(model)
    splits = [(rank, world_size)] * len(local_parts(model, path))
    if path.rpartition(".")[2] == "qkv_proj" and world_size > 1:
        replicas = kv_replicas(model.spec, world_size)
        splits[1:] = [(rank // replicas, world_size // replicas)] * 2
    return splits


def local_parts(model: nn.Module, path: str) -> list[int]:
    """This rank's output widths of the parts of the projection at `path` ([out] if not fused)."""
    module = model.get_submodule(path)
    parent, _, leaf = path.rpartition(".")
    if leaf in COLUMN_PARALLEL:
        return fused_sizes(model.get_submodule(parent) if parent else model, leaf, module)
    return [module.out_features]


def whole_parts(model: nn.Module, path: str) -> list[int]:
    """The output widths of the projection's parts over all ranks (an adapter's B rows)."""
    if split_of(path) != "column":
        return local_parts(model, path)
    return [width * count for width, (_, count) in zip(local_parts(model, path), part_splits(model, path),
                                                        strict=True)]


def whole_in_features(model: nn.Module, path: str) -> int:
    """The projection's input width over all ranks (an adapter's A columns)."""
    _, world_size = ranks_of(model)
    return model.get_submodule(path).in_features * (world_size if split_of(path) == "row" else 1)


def column_rows(model: nn.Module, path: str) -> torch.Tensor:
    """For each output column this rank holds of a column-parallel projection, the row of the
    whole projection it is (the loader's Shard(0) of each part, parts one after another)."""
    rows, offset = [], 0
    for width, (index, count) in zip(local_parts(model, path), part_splits(model, path), strict=True):
        first = offset + index * width
        rows.append(torch.arange(first, first + width))
        offset += width * count
    return torch.cat(rows)


def shard_target(target: LoRATarget, model: nn.Module) -> LoRATarget | None:
    """`target` (on the whole projection's widths) for this rank; None when none of its output
    columns are on this rank."""
    rank, world_size = ranks_of(model)
    split = split_of(target.module)
    if world_size == 1 or split is None:
        return target
    module = model.get_submodule(target.module)
    if split == "row":
        width = module.in_features
        return dataclasses.replace(target, lora_a=target.lora_a[:, rank * width:(rank + 1) * width].contiguous())
    rows = column_rows(model, target.module)
    columns = torch.nonzero((rows >= target.start) & (rows < target.stop)).reshape(-1)
    if columns.numel() == 0:
        return None
    start, stop = int(columns[0]), int(columns[-1]) + 1
    if stop - start != columns.numel():   # a target is one part or whole parts: never happens
        raise ValueError(f"{target.module}: the output rows [{target.start}, {target.stop}) are not contiguous on "
                         f"tensor-parallel rank {rank}")
    lora_b = target.lora_b.index_select(0, rows[columns] - target.start).contiguous()
    return dataclasses.replace(target, start=start, stop=stop, lora_b=lora_b)


def shard_adapter(weights: LoRAWeights, model: nn.Module) -> LoRAWeights:
    """`weights` (mapped onto the whole model's widths) cut for the rank `model` is a shard of
    (see the module docstring); unchanged on one rank. The rank stays the adapter's largest, so
    every rank's slots take it alike."""
    if ranks_of(model)[1] == 1:
        return weights
    targets = [shard_target(target, model) for target in weights.targets]
    return dataclasses.replace(weights, targets=[target for target in targets if target is not None])
