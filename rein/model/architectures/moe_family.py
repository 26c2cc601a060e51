"""Mixture-of-experts models natively: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE.

All four are the Llama layer with the MLP of some layers replaced by the sparse MoE block
(rein.model.architectures.moe); attention, norms, rope and the head are llama.py's, with the
families' switches read from the ModelSpec:

- Qwen3-MoE: per-head q/k RMSNorm as Qwen3; layers listed in `mlp_only_layers` (or off the
  `decoder_sparse_step`) keep a dense MLP.
- Qwen2-MoE: q/k/v bias, and a shared expert beside the routed ones, gated by a sigmoid.
- Mixtral: Mistral's attention; every layer sparse, top-k weights always renormalised.
- OLMoE: q/k RMSNorm over the whole q and k projections (before they are split into heads).

A GGUF file holds each projection of a layer's experts as one 3-D tensor (llama.cpp's
blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps, gguf's tensor map naming them
`mlp.experts.gate_proj`, Mixtral's `block_sparse_moe.experts.w1`), kept in its quantized blocks
(`load_gguf_experts`); the router is ffn_gate_inp, Qwen2-MoE's shared expert ffn_*_shexp.

Checkpoints name each expert's projections separately (`mlp.experts.{e}.gate_proj.weight`;
Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`), which is also what transformers 5's
save_pretrained writes; they are stacked at load. A checkpoint saved with transformers' fused
names (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`) loads as well.

Tensor parallelism as llama.py's, with every expert split by its intermediate dimension: each
rank holds a slice of all experts (and of the shared expert), routes every token the same way
(the router is whole on every rank and sees the same all-reduced input) and the block ends in
one all-reduce. OLMoE's q/k norms span all heads, so under tensor parallelism each rank
gathers q and k whole for the norm and keeps its heads (one copy of each KV head where the
ranks replicate them).
"""

from __future__ import annotations

import torch
from torch import nn

from rein.kernels.quantized import QuantizedWeight
from rein.kernels.quantized_experts import QuantizedExperts
from rein.model.architectures.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaFamilyModel,
    RMSNorm,
    load_attention,
    load_embeddings,
    load_mlp,
)
from rein.model.architectures.moe import SparseMoeBlock
from rein.model.architectures.rope import apply_rotary
from rein.model.architectures.weights import Shard, TensorGetter, WeightLoader, dropped
from rein.model.attention import AttentionMetadata, LayerCache, paged_attention, rotary_store_kv
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.parallel.layers import kv_replicas
from rein.model.spec import ModelSpec

# Checkpoint names of an expert's (gate, up, down) projections and of the block, per family
# (Mixtral's checkpoints say block_sparse_moe, transformers 5's in-memory model mlp).
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
BLOCK_NAMES = {"mixtral": ("block_sparse_moe", "mlp")}


class OlmoeAttention(Attention):
    """Llama's attention with OLMoE's q/k RMSNorm over the whole projections, not per head."""

    def __init__(self, spec: ModelSpec, window: int | None = None, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__(spec, window, group)
        self.q_norm = RMSNorm(spec.num_heads * spec.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.num_kv_heads * spec.head_dim, spec.rms_norm_eps)
        self.kv_replicas = kv_replicas(spec, group.world_size)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.norm_whole(qkv[:, :self.q_size], self.q_norm).view(tokens, self.num_heads, self.head_dim)
        k = self.norm_whole(qkv[:, self.q_size:self.q_size + self.kv_size], self.k_norm, self.kv_replicas)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        kv_stored = rotary_store_kv(q, k, v, rotary, cache, meta, self.window)   # one kernel (CUDA; C on the CPU)
        if not kv_stored:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = paged_attention(q, k, v, cache, meta, self.scale, window=self.window, kv_stored=kv_stored)
        return self.group.all_reduce_(self.o_proj(out.reshape(tokens, self.q_size)))

    def norm_whole(self, part: torch.Tensor, norm: RMSNorm, replicas: int = 1) -> torch.Tensor:
        """`norm` over all ranks' heads of this rank's projection `part`; this rank's columns of it.
        `replicas`: that many consecutive ranks hold the same heads (replicated KV heads), of
        which the gathered whole keeps one copy."""
        if self.group.world_size == 1:
            return norm(part)
        tokens, width = part.shape
        whole = self.group.all_gather(part)
        if replicas > 1:
            whole = whole.view(tokens, -1, replicas, width)[:, :, 0].reshape(tokens, -1)
        start = self.group.rank // replicas * width
        return norm(whole)[:, start:start + width]


class MoeDecoderLayer(DecoderLayer):
    """DecoderLayer's forward over the family's attention and a sparse or dense MLP."""

    def __init__(self, spec: ModelSpec, window: int | None, sparse: bool, group: ParallelGroup = SINGLE_RANK) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = (OlmoeAttention if spec.family == "olmoe" else Attention)(spec, window, group)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SparseMoeBlock(spec, group) if sparse else MLP(spec, group)


class MoeFamilyModel(LlamaFamilyModel):
    """LlamaFamilyModel's forward, logits and packing over MoE decoder layers."""

    def make_layers(self, spec: ModelSpec, group: ParallelGroup) -> list[nn.Module]:
        return [MoeDecoderLayer(spec, window, sparse, group)
                for window, sparse in zip(spec.layer_windows, spec.sparse_layers, strict=True)]

    def load_hf_weights(self, get: TensorGetter) -> None:
        weights = WeightLoader(self, get, self.group)
        load_embeddings(self, weights)
        for i, sparse in enumerate(self.spec.sparse_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            load_attention(weights, self.spec, src + "self_attn.", dst + "self_attn.")
            if sparse:
                load_sparse_block(weights, self.spec, src, dst + "mlp.")
            else:
                load_mlp(weights, src + "mlp.", dst + "mlp.")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                weights.put(f"{dst}{norm}.weight", weights.take(f"{src}{norm}.weight"))
        weights.finish()


def load_sparse_block(weights: WeightLoader, spec: ModelSpec, layer: str, dst: str) -> None:
    """The router, the experts stacked into [E, 2I, H] and [E, H, I] (this rank's slice of I),
    the shared expert (sliced likewise) and its gate."""
    blocks = BLOCK_NAMES.get(spec.family, ("mlp",))
    for block in blocks:
        src = f"{layer}{block}."
        router = weights.get(src + "gate.weight")
        if router is not None:
            break
    else:
        raise ValueError(f"checkpoint is missing weight {layer}{blocks[0]}.gate.weight")
    weights.put(dst + "gate.weight", router)
    names = EXPERT_NAMES.get(spec.family, ("gate_proj", "up_proj", "down_proj"))
    if load_gguf_experts(weights, src, dst, names):
        pass
    elif (fused := stacked_gate_up(weights, src + "experts.gate_up_proj")) is not None:
        # already stacked (saved with transformers' in-memory names)
        weights.put(dst + "gate_up_proj", fused)
        weights.put(dst + "down_proj", weights.take(src + "experts.down_proj", weights.shard(2)))
    else:
        load_separate_experts(weights, spec, src, dst, names)
    if spec.shared_expert_intermediate_size:
        load_mlp(weights, src + "shared_expert.", dst + "shared_expert.")
        weights.put(dst + "shared_expert_gate.weight", weights.take(src + "shared_expert_gate.weight"))


def load_separate_experts(weights: WeightLoader, spec: ModelSpec, src: str, dst: str,
                          names: tuple[str, str, str]) -> None:
    """Experts saved one by one (`experts.{e}.gate_proj.weight`, ...). They stay quantized
    where every expert's three projections come quantized (an AWQ / GPTQ checkpoint's, or
    --quantization int8 | int4 made at load): collected, then stacked into QuantizedExperts.
    Otherwise each is copied into the float stacked tensors as it comes (an expert that comes
    float sends the ones collected before it there too, dequantized)."""
    gate, up, down = names
    rows, columns = weights.shard(0), weights.shard(1)
    held: list[list[QuantizedWeight]] | None = []

    def put_float(e: int, parts: list) -> None:
        dtype = weights.own[dst + "gate_up_proj"].dtype
        g, u, d = (p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts)
        put_expert(weights, dst + "gate_up_proj", e, torch.cat([g, u]))
        put_expert(weights, dst + "down_proj", e, d)

    for e in range(spec.num_experts):
        expert = f"{src}experts.{e}."
        parts = [weights.take(f"{expert}{gate}.weight", rows, quantized=True),
                 weights.take(f"{expert}{up}.weight", rows, quantized=True),
                 weights.take(f"{expert}{down}.weight", columns, quantized=True)]
        if held is not None and all(isinstance(p, QuantizedWeight) for p in parts):
            held.append(parts)
            continue
        for i, earlier in enumerate(held or []):
            put_float(i, earlier)
        held = None
        put_float(e, parts)
    if held:
        put_quantized_experts(weights, dst, QuantizedExperts.of([p for parts in held for p in parts[:2]]),
                              QuantizedExperts.of([parts[2] for parts in held]), interleaved=True)


def put_quantized_experts(weights: WeightLoader, dst: str, gate_up: QuantizedExperts, down: QuantizedExperts,
                          interleaved: bool = False) -> None:
    """Hand the sparse block at `dst` its experts quantized (on its device; the CPU kernel's
    panels on the CPU) in place of its float gate_up_proj and down_proj, which are dropped.
    `interleaved`: gate_up holds 2E matrices, expert e's gate then its up, regrouped here."""
    if interleaved:
        gate_up = QuantizedExperts(down.num_experts, 2 * gate_up.rows, gate_up.cols, stacked=gate_up.stacked)
    block = weights.modules[dst.removesuffix(".")]
    gate_up_target, down_target = weights.own[dst + "gate_up_proj"], weights.own[dst + "down_proj"]
    for name, value, target in (("gate_up_proj", gate_up, gate_up_target), ("down_proj", down, down_target)):
        if value.shape != tuple(target.shape):
            raise ValueError(f"weight {dst}{name}: checkpoint experts {value.shape} != model {tuple(target.shape)}")
    block.quantized_gate_up = gate_up.to(gate_up_target.device)
    block.quantized_down = down.to(down_target.device)
    block.gate_up_proj, block.down_proj = dropped(gate_up_target), dropped(down_target)
    weights.loaded.update((dst + "gate_up_proj", dst + "down_proj"))


def load_gguf_experts(weights: WeightLoader, src: str, dst: str, names: tuple[str, str, str]) -> bool:
    """A GGUF file's experts, one 3-D tensor per projection (gguf's tensor map names them
    `{block}.experts.{gate_proj|w1}`: llama.cpp's blk.N.ffn_gate_exps, ffn_up_exps [E, I, H],
    ffn_down_exps [E, H, I]); False where the checkpoint has none. Kept quantized when all
    three come as QuantizedExperts (the model's float gate_up_proj / down_proj are then
    dropped), else dequantized into them. This rank's slice of I, as the other layouts."""
    gate_name, up_name, down_name = (f"{src}experts.{name}.weight" for name in names)
    rows, columns = weights.shard(1), weights.shard(2)
    gate = weights.get(gate_name, rows, True)
    if gate is None:
        return False
    up = weights.take(up_name, rows, quantized=True)
    down = weights.take(down_name, columns, quantized=True)
    if all(isinstance(t, QuantizedExperts) for t in (gate, up, down)):
        put_quantized_experts(weights, dst, QuantizedExperts.gate_up(gate, up), down)
        return True
    dtype = weights.own[dst + "gate_up_proj"].dtype
    gate, up, down = (t.dequantize(dtype) if isinstance(t, QuantizedExperts) else t for t in (gate, up, down))
    weights.put(dst + "gate_up_proj", torch.cat([gate, up], dim=1))
    weights.put(dst + "down_proj", down)
    return True


def stacked_gate_up(weights: WeightLoader, name: str) -> torch.Tensor | None:
    """This rank's slice of a stacked [E, 2I, H] gate/up tensor, or None if the checkpoint has
    none. Its gate rows come before its up rows, so of 2N equal parts along 2I, rank r's gate
    slice is part r and its up slice part N + r."""
    group = weights.group
    if group.world_size == 1:
        return weights.get(name)
    parts = 2 * group.world_size
    gate = weights.get(name, Shard(1, group.rank, parts))
    if gate is None:
        return None
    return torch.cat([gate, weights.take(name, Shard(1, group.world_size + group.rank, parts))], dim=1)


def put_expert(weights: WeightLoader, name: str, expert: int, value: torch.Tensor) -> None:
    """Copy one expert's tensor into its slot of the stacked model tensor: the experts come in
    one at a time, so a layer's experts are never held twice (Qwen3-30B-A3B's: 1.2 GB a layer
    in bfloat16). The stacked tensor counts as loaded once its first expert is in; a missing
    expert fails in `take` before that matters."""
    target = weights.own[name][expert]
    if target.shape != value.shape:
        raise ValueError(f"weight {name}[{expert}]: checkpoint shape {tuple(value.shape)} "
                         f"!= model {tuple(target.shape)}")
    with torch.no_grad():
        target.copy_(value)
    weights.loaded.add(name)
