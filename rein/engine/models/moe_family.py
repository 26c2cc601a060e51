"""Mixture-of-experts models natively: Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE.

All four are the Llama layer with the MLP of some layers replaced by the sparse MoE block
(rein.engine.models.moe); attention, norms, rope and the head are llama.py's, with the
families' switches read from the ModelSpec:

- Qwen3-MoE: per-head q/k RMSNorm as Qwen3; layers listed in `mlp_only_layers` (or off the
  `decoder_sparse_step`) keep a dense MLP.
- Qwen2-MoE: q/k/v bias, and a shared expert beside the routed ones, gated by a sigmoid.
- Mixtral: Mistral's attention; every layer sparse, top-k weights always renormalised.
- OLMoE: q/k RMSNorm over the whole q and k projections (before they are split into heads).

Checkpoints name each expert's projections separately (`mlp.experts.{e}.gate_proj.weight`;
Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`), which is also what transformers 5's
save_pretrained writes; they are stacked at load. A checkpoint saved with transformers' fused
names (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`) loads as well.
"""

from __future__ import annotations

import torch
from torch import nn

from rein.engine.attention import AttentionMetadata, LayerCache, paged_attention
from rein.engine.model_spec import ModelSpec
from rein.engine.models.linear import Linear
from rein.engine.models.llama import (
    MLP,
    Attention,
    DecoderLayer,
    LlamaFamilyModel,
    RMSNorm,
    load_attention,
    load_embeddings,
)
from rein.engine.models.moe import SparseMoeBlock
from rein.engine.models.rope import RotaryEmbedding, apply_rotary
from rein.engine.models.weights import TensorGetter, WeightLoader

# Checkpoint names of an expert's (gate, up, down) projections and of the block, per family
# (Mixtral's checkpoints say block_sparse_moe, transformers 5's in-memory model mlp).
EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2")}
BLOCK_NAMES = {"mixtral": ("block_sparse_moe", "mlp")}


class OlmoeAttention(Attention):
    """Llama's attention with OLMoE's q/k RMSNorm over the whole projections, not per head."""

    def __init__(self, spec: ModelSpec, window: int | None = None) -> None:
        super().__init__(spec, window)
        self.q_norm = RMSNorm(self.q_size, spec.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, spec.rms_norm_eps)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :self.q_size]).view(tokens, self.num_heads, self.head_dim)
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]).view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = paged_attention(q, k, v, cache, meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(tokens, self.q_size))


class MoeDecoderLayer(DecoderLayer):
    """DecoderLayer's forward over the family's attention and a sparse or dense MLP."""

    def __init__(self, spec: ModelSpec, window: int | None, sparse: bool) -> None:
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = (OlmoeAttention if spec.family == "olmoe" else Attention)(spec, window)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = SparseMoeBlock(spec) if sparse else MLP(spec)


class MoeFamilyModel(LlamaFamilyModel):
    """LlamaFamilyModel's forward, logits and packing over MoE decoder layers."""

    def __init__(self, spec: ModelSpec, max_positions: int) -> None:
        nn.Module.__init__(self)
        self.spec = spec
        self.rope = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(MoeDecoderLayer(spec, window, sparse)
                                    for window, sparse in zip(spec.layer_windows, spec.sparse_layers, strict=True))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def load_hf_weights(self, get: TensorGetter) -> None:
        weights = WeightLoader(self, get)
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


def load_mlp(weights: WeightLoader, src: str, dst: str) -> None:
    weights.fused(dst + "gate_up_proj.weight", [src + "gate_proj.weight", src + "up_proj.weight"])
    weights.put(dst + "down_proj.weight", weights.take(src + "down_proj.weight"))


def load_sparse_block(weights: WeightLoader, spec: ModelSpec, layer: str, dst: str) -> None:
    """The router, the experts stacked into [E, 2I, H] and [E, H, I], the shared expert and its gate."""
    blocks = BLOCK_NAMES.get(spec.family, ("mlp",))
    for block in blocks:
        src = f"{layer}{block}."
        router = weights.get(src + "gate.weight")
        if router is not None:
            break
    else:
        raise ValueError(f"checkpoint is missing weight {layer}{blocks[0]}.gate.weight")
    weights.put(dst + "gate.weight", router)
    fused = weights.get(src + "experts.gate_up_proj")
    if fused is not None:   # already stacked (saved with transformers' in-memory names)
        weights.put(dst + "gate_up_proj", fused)
        weights.put(dst + "down_proj", weights.take(src + "experts.down_proj"))
    else:
        gate, up, down = EXPERT_NAMES.get(spec.family, ("gate_proj", "up_proj", "down_proj"))
        for e in range(spec.num_experts):
            expert = f"{src}experts.{e}."
            put_expert(weights, dst + "gate_up_proj", e, torch.cat([weights.take(f"{expert}{gate}.weight"),
                                                                    weights.take(f"{expert}{up}.weight")]))
            put_expert(weights, dst + "down_proj", e, weights.take(f"{expert}{down}.weight"))
    if spec.shared_expert_intermediate_size:
        load_mlp(weights, src + "shared_expert.", dst + "shared_expert.")
        weights.put(dst + "shared_expert_gate.weight", weights.take(src + "shared_expert_gate.weight"))


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
