"""Gemma 3 (text), natively: Llama's projections and paged attention with Gemma's differences.

- Five of every six layers attend over a sliding window (512 positions on the small models)
  with their own rope base (10k against the global layers' 1M); the window is the attention
  kernels' (rein.kernels), so a windowed layer reads only the blocks inside it.
- RMSNorm scales by (1 + w): the stored weights get their 1 added once at load, after which
  they are ordinary RMSNorm weights and run on the same fused kernels as Llama's.
- Norms before and after both attention and the MLP ("sandwich" norms), q/k RMSNorm per head,
  a GeLU-tanh gated MLP, embeddings scaled by sqrt(hidden), the softmax scaled by
  query_pre_attn_scalar ** -0.5, and tied embeddings.
Gemma 2's logit soft-capping is not here (ModelSpec refuses it). Tensor parallelism as
llama.py's: the sandwich norms see the all-reduced outputs of attention and the MLP.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rein.kernels import elementwise
from rein.kernels.cpu_decode_layers import LayerParts
from rein.model.architectures.linear import Linear
from rein.model.architectures.llama import (
    Attention,
    LlamaFamilyModel,
    RMSNorm,
    load_attention,
    load_embeddings,
    load_mlp,
    run_decode_layers,
)
from rein.model.architectures.rope import RotaryEmbedding
from rein.model.architectures.weights import TensorGetter, WeightLoader
from rein.model.attention import AttentionMetadata, LayerCache
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.parallel.layers import split_evenly
from rein.model.spec import ModelSpec

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class GeluMLP(nn.Module):
    """Gated GeLU-tanh MLP over this rank's slice of the intermediate dimension."""

    def __init__(self, spec: ModelSpec, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        if spec.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"activation {spec.hidden_act!r} is not supported (Gemma 3 uses gelu_pytorch_tanh)")
        self.group = group
        self.intermediate = split_evenly(spec.intermediate_size, group.world_size, "MLP intermediate size")
        self.gate_up_proj = Linear(spec.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        hidden = elementwise.gelu_tanh_and_mul(gate_up)   # one pass on CUDA (Triton)
        if hidden is None:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = nn.functional.gelu(gate, approximate="tanh").mul_(up)
        return self.group.all_reduce_(self.down_proj(hidden))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, window: int | None, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.window = window
        self.self_attn = Attention(spec, window, group)
        self.mlp = GeluMLP(spec, group)
        for name in NORMS:
            setattr(self, name, RMSNorm(spec.hidden_size, spec.rms_norm_eps))

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata, *attention_args: Any) -> torch.Tensor:
        """`attention_args`: more for the attention (Gemma 3 with vision: the step's image blocks)."""
        attended = self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rotary, cache, meta, *attention_args))
        norm = self.pre_feedforward_layernorm
        # x += attended and the pre-MLP norm in one pass where the fused kernel runs.
        normed = elementwise.add_rms_norm(x, attended, norm.weight, norm.eps)
        if normed is None:
            x = x + attended
            normed = norm(x)
        return x + self.post_feedforward_layernorm(self.mlp(normed))

    def decode_parts(self) -> LayerParts | None:
        """This layer for rein.kernels.cpu_decode_layers; None on several ranks, or for a subclass's
        other attention or MLP (the vision model's attention over image blocks)."""
        att = self.self_attn
        if att.group.world_size != 1 or type(att) is not Attention or type(self.mlp) is not GeluMLP:
            return None
        return LayerParts(att.qkv_proj, att.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj, self.input_layernorm,
                          self.pre_feedforward_layernorm, att.num_heads, att.num_kv_heads, att.head_dim,
                          self.mlp.intermediate, att.scale, "gelu_tanh", window=att.window,
                          local_rope=self.window is not None, post_attention_norm=self.post_attention_layernorm,
                          post_mlp_norm=self.post_feedforward_layernorm, q_norm=att.q_norm, k_norm=att.k_norm)


class Gemma3Model(LlamaFamilyModel):
    """The step's forward and the logits as LlamaFamilyModel's; Gemma's layers and two ropes."""

    def __init__(self, spec: ModelSpec, max_positions: int, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__(spec, max_positions, group)
        self.local_rope = RotaryEmbedding(spec.head_dim, max_positions, spec.local_rope_theta or spec.rope_theta,
                                          None)

    def make_layers(self, spec: ModelSpec, group: ParallelGroup) -> list[nn.Module]:
        return [Gemma3DecoderLayer(spec, window, group) for window in spec.layer_windows]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # As transformers: sqrt(hidden) rounded to the weights' dtype, then multiplied in.
        x = x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)
        full, local = self.rope(positions), self.local_rope(positions)
        if not run_decode_layers(self, x, full, local, caches, meta):
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, local if layer.window is not None else full, cache, meta)
        return self.norm(x)

    def load_hf_weights(self, get: TensorGetter) -> None:
        weights = WeightLoader(self, get, self.group)
        load_embeddings(self, weights)
        for i in range(self.spec.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            load_attention(weights, self.spec, src + "self_attn.", dst + "self_attn.")
            load_mlp(weights, src + "mlp.", dst + "mlp.")
            for norm in NORMS:
                weights.put(f"{dst}{norm}.weight", weights.take(f"{src}{norm}.weight"))
        weights.finish()
        with torch.no_grad():   # Gemma's RMSNorm scales by (1 + w)
            for module in self.modules():
                if isinstance(module, RMSNorm):
                    module.weight.add_(1.0)
