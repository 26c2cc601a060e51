"""The Llama family as one native model: Llama (incl. llama3 rope), Mistral, Qwen2, Qwen3.

The variants differ only in switches read from the ModelSpec: qkv bias (Qwen2), per-head
q/k RMSNorm (Qwen3), tied embeddings, rope scaling. Tokens of all requests in a step
are flattened into one [T, hidden] batch; only attention looks at request boundaries
(through the paged cache), so every projection is one matmul for the whole step.
Q, K and V (and gate and up) are fused into one weight at load time for the same reason.

Built with a tensor-parallel `group` (rein.model.parallel), every layer holds its rank's
share: the query and KV heads (one KV head, replicated, where the ranks outnumber them;
rein.model.parallel.layers), the MLP's intermediate slice, the vocabulary slice; o_proj and
down_proj end in the layer's one all-reduce each, the logits are all-gathered. With the
default single-rank group the layers are full width and the collectives return their input.
"""

from __future__ import annotations

import torch
from torch import nn

from rein.kernels import elementwise
from rein.kernels.cpu_decode_layers import LayerParts, decode_layers
from rein.kernels.cpu_paths import packed_dtypes
from rein.kernels.quantized import quantized_linear
from rein.model.architectures.linear import (
    PACK_ROWS_HINT,
    Linear,
    linear,
    pack_weights,
    silu_and_mul_linear,
)
from rein.model.architectures.rope import RotaryEmbedding, apply_rotary
from rein.model.architectures.weights import TensorGetter, WeightLoader
from rein.model.attention import AttentionMetadata, LayerCache, paged_attention, rotary_store_kv
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.parallel.layers import (
    VocabParallelEmbedding,
    attention_heads,
    gather_vocab,
    kv_replicas,
    split_evenly,
    vocab_rows,
)
from rein.model.spec import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = elementwise.rms_norm(x, self.weight, self.eps)   # one pass: C on CPU (float32), Triton on CUDA
        if fused is not None:
            return fused
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps))
        if dtype == torch.float32:
            return x.mul_(self.weight)   # in place: the same products as weight * x, one tensor fewer
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """This rank's query and KV heads (all of them on one rank) over the paged cache."""

    def __init__(self, spec: ModelSpec, window: int | None = None, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.window = window   # sliding-window attention over the last `window` positions
        self.group = group
        self.num_heads, self.num_kv_heads = attention_heads(spec, group.world_size)
        self.head_dim = spec.head_dim
        self.q_size = self.num_heads * spec.head_dim
        self.kv_size = self.num_kv_heads * spec.head_dim
        self.scale = spec.attention_scale
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=False)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = qkv[:, :self.q_size + self.kv_size].view(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
            q, k = self.q_norm(q), self.k_norm(k)
        # On CUDA one kernel rotates q and k in place and writes k and v into the cache.
        kv_stored = rotary_store_kv(q, k, v, rotary, cache, meta, self.window)
        if not kv_stored and self.q_norm is None:
            # Q's and K's heads sit side by side in the fused projection: one rotary call for
            # both (half the element-wise calls of a layer's attention; same arithmetic).
            if not elementwise.rotary_(qk, *rotary):   # rotated in place: C on CPU (float32)
                qk = apply_rotary(qk, *rotary)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        elif not kv_stored:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = paged_attention(q, k, v, cache, meta, self.scale, window=self.window, kv_stored=kv_stored)
        return self.group.all_reduce_(self.o_proj(out.reshape(tokens, self.q_size)))


class MLP(nn.Module):
    """Gated SiLU MLP over this rank's slice of the intermediate dimension. `reduce=False`
    leaves the partial sum to the caller (a MoE block adds it to its experts' before its one
    all-reduce)."""

    def __init__(self, spec: ModelSpec, group: ParallelGroup = SINGLE_RANK, reduce: bool = True) -> None:
        super().__init__()
        if spec.hidden_act != "silu":
            raise ValueError(f"activation {spec.hidden_act!r} is not supported (Llama-family models use silu)")
        self.group = group if reduce else SINGLE_RANK
        self.intermediate = split_evenly(spec.intermediate_size, group.world_size, "MLP intermediate size")
        self.gate_up_proj = Linear(spec.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        out = silu_and_mul_linear(gate_up, self.down_proj)   # decode rows, REIN_CUDA_SMALL_GEMM=triton: one kernel
        if out is None:
            hidden = elementwise.silu_and_mul(gate_up)   # one pass: C on CPU (float32), Triton on CUDA
            if hidden is None:
                gate, up = gate_up.split(self.intermediate, dim=-1)
                hidden = nn.functional.silu(gate) * up
            out = self.down_proj(hidden)
        return self.group.all_reduce_(out)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, window: int | None, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, window, group)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, group)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), rotary, cache, meta)
        norm = self.post_attention_layernorm
        # x += attended and the norm in one pass, in C on CPU (float32) or Triton on CUDA (x is
        # this layer's own: the embedding's output or the previous layer's sum).
        normed = elementwise.add_rms_norm(x, attended, norm.weight, norm.eps)
        if normed is None:
            x = x + attended
            normed = norm(x)
        return x + self.mlp(normed)

    def decode_parts(self) -> LayerParts | None:
        """This layer for rein.kernels.cpu_decode_layers; None on several ranks, or for a subclass's
        other attention or MLP (a MoE block, attention over image blocks)."""
        att = self.self_attn
        if att.group.world_size != 1 or type(att) is not Attention or type(self.mlp) is not MLP:
            return None
        return LayerParts(att.qkv_proj, att.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj, self.input_layernorm,
                          self.post_attention_layernorm, att.num_heads, att.num_kv_heads, att.head_dim,
                          self.mlp.intermediate, att.scale, "silu", window=att.window, q_norm=att.q_norm,
                          k_norm=att.k_norm)


class LlamaFamilyModel(nn.Module):
    # False once loaded from a checkpoint without lm_head weights (an embedding model saved
    # from the base model, as sentence-transformers does): it computes hidden states only.
    can_generate = True

    def __init__(self, spec: ModelSpec, max_positions: int, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.spec = spec
        self.group = group
        self.rope = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, group)
        self.layers = nn.ModuleList(self.make_layers(spec, group))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = lm_head(spec, group)

    def make_layers(self, spec: ModelSpec, group: ParallelGroup) -> list[nn.Module]:
        """The decoder layers; the families built on this model override it."""
        return [DecoderLayer(spec, window, group) for window in spec.layer_windows]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step.
        `inputs_embeds`: the step's input embeddings in place of the tokens' (a vision model's,
        with its images' embeddings at their placeholders)."""
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        rotary = self.rope(positions)
        if not run_decode_layers(self, x, rotary, None, caches, meta):
            for layer, cache in zip(self.layers, caches, strict=True):
                x = layer(x, rotary, cache, meta)
        return self.norm(x)

    # Tied embeddings on the CPU: oneDNN's packed copy of the embedding for the logits
    # (set by pack_cpu_weights); the embedding lookup keeps the dense table.
    packed_tied_head: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [rows, vocab] of hidden states [rows, hidden] (every rank gets all of them)."""
        if self.packed_tied_head is not None:
            logits = linear(hidden, self.packed_tied_head)
        elif self.lm_head is not None:
            logits = self.lm_head(hidden)
        else:
            weight = self.embed_tokens.head_weight()
            logits = linear(hidden, weight) if isinstance(weight, torch.Tensor) else quantized_linear(hidden, weight)
        return gather_vocab(logits, self.group, self.spec.vocab_size)

    def pack_cpu_weights(self) -> None:
        """Prepack the projections (and the head) for oneDNN, once, after loading
        (rein.model.architectures.linear). A tied head gets a packed copy of the embedding table,
        vocab x hidden more memory (113 MB on SmolLM2-135M), as vLLM's CPU build keeps one:
        the logits of a decode step at 8-32 rows took 16-23 ms unpacked, 11-20 ms packed."""
        if pack_weights(self) and self.lm_head is None and self.can_generate \
                and self.embed_tokens.quantized is None and self.embed_tokens.weight.dtype in packed_dtypes():
            self.packed_tied_head = torch.ops.mkldnn._reorder_linear_weight(
                self.embed_tokens.weight.detach(), PACK_ROWS_HINT)

    # -- weights ---------------------------------------------------------------------------

    def load_hf_weights(self, get: TensorGetter) -> None:
        """Copy Hugging Face named tensors in, fusing q/k/v and gate/up; every weight must be set.

        `get(name, shard)` returns the checkpoint tensor (only this rank's shard of it under
        tensor parallelism) or None; tensors are fetched one at a time so a large checkpoint is
        never held twice in memory.
        """
        weights = WeightLoader(self, get, self.group)
        load_embeddings(self, weights)
        for i in range(self.spec.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            load_attention(weights, self.spec, src + "self_attn.", dst + "self_attn.")
            load_mlp(weights, src + "mlp.", dst + "mlp.")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                weights.put(f"{dst}{norm}.weight", weights.take(f"{src}{norm}.weight"))
        weights.finish()


def run_decode_layers(model: nn.Module, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                      local_rotary: tuple[torch.Tensor, torch.Tensor] | None, caches: list[LayerCache],
                      meta: AttentionMetadata) -> bool:
    """A step of single-token decodes through all of `model`'s layers in one C call on the CPU
    (x updated in place), where rein.kernels.cpu_decode_layers applies: a quantized model,
    float32; `local_rotary`: the windowed layers' rope (Gemma 3), None: `rotary` for all. False,
    nothing done: the caller runs the layers as modules."""
    if not (x.is_cpu and x.dtype == torch.float32):
        return False
    bound = decode_layers(model, caches)
    return bound is not None and bound.run(x, rotary, local_rotary, meta)


def lm_head(spec: ModelSpec, group: ParallelGroup) -> Linear | None:
    """This rank's slice of the output projection; None when tied to the embedding."""
    if spec.tie_word_embeddings:
        return None
    return Linear(spec.hidden_size, vocab_rows(spec.vocab_size, group.world_size), bias=False)


def load_embeddings(model: nn.Module, weights: WeightLoader) -> None:
    """The embedding, the final norm and the head (absent when tied; an embedding model saved
    without one computes hidden states only): each rank its vocabulary slice."""
    vocab = weights.shard(0, uneven=True)
    embed = weights.get("model.embed_tokens.weight", vocab, quantized=True)
    if embed is None and model.spec.tie_word_embeddings:
        # Tied weights saved once may be kept under the head's name (safetensors' save_model).
        embed = weights.get("lm_head.weight", vocab, quantized=True)
    if embed is None:
        embed = weights.take("model.embed_tokens.weight", vocab)
    weights.put("embed_tokens.weight", embed, padded=True)
    weights.put("norm.weight", weights.take("model.norm.weight"))
    if model.lm_head is not None:
        head = weights.get("lm_head.weight", vocab, quantized=True)
        if head is None:
            model.lm_head = None
            model.can_generate = False
            weights.skip("lm_head.weight")
        else:
            weights.put("lm_head.weight", head, padded=True)


def load_attention(weights: WeightLoader, spec: ModelSpec, src: str, dst: str) -> None:
    """One layer's attention: q/k/v fused (and their biases) from this rank's rows of each
    (its heads; k's and v's those of its KV head where KV heads are replicated), o_proj's
    matching columns, the q/k norms whole (they are per head)."""
    heads = weights.shard(0)
    kv = weights.shard(0, replicas=kv_replicas(spec, weights.group.world_size))
    weights.linear(dst + "qkv_proj.weight", [src + "q_proj.weight", src + "k_proj.weight", src + "v_proj.weight"],
                   [heads, kv, kv])
    if spec.attention_bias:
        weights.fused(dst + "qkv_proj.bias", [src + "q_proj.bias", src + "k_proj.bias", src + "v_proj.bias"],
                      [heads, kv, kv])
    weights.linear(dst + "o_proj.weight", [src + "o_proj.weight"], weights.shard(1))
    if spec.qk_norm:
        weights.put(dst + "q_norm.weight", weights.take(src + "q_norm.weight"))
        weights.put(dst + "k_norm.weight", weights.take(src + "k_norm.weight"))


def load_mlp(weights: WeightLoader, src: str, dst: str) -> None:
    """Gate and up fused from this rank's rows of each, down_proj's matching columns."""
    weights.linear(dst + "gate_up_proj.weight", [src + "gate_proj.weight", src + "up_proj.weight"], weights.shard(0))
    weights.linear(dst + "down_proj.weight", [src + "down_proj.weight"], weights.shard(1))
