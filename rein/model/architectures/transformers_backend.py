"""Every other causal LM: the model's own transformers modeling code, run inside rein's engine.

As vLLM's Transformers backend does, rein builds the `AutoModelForCausalLM` transformers
builds and plugs its paged attention in through transformers' `AttentionInterface`: each
attention module computes its projections, norms and positions itself, then calls the
function registered here with its q, k and v, which stores k/v in the layer's paged cache
and attends with the step's metadata (`rein.model.attention.paged_attention`). So
continuous batching, the paged KV cache, prefix caching, chunked prefill and every sampling
feature work for any architecture whose attention goes through that interface.

A step's tokens of all requests run as one sequence ([1, T] with the tokens' own positions):
attention alone looks at request boundaries, through the cache's block tables. Since the
attention name is not one transformers builds masks for, `create_causal_mask` returns None
and no dense [T, T] mask is made. The step's caches and metadata reach the attention
function through a context variable set around the forward, so it works whether or not a
model passes its forward's keyword arguments down to its attention modules. A model that
caps its attention logits (Gemma 2) takes a torch path over the same paged cache
(`softcapped_attention`), since the kernels do not cap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from rein import kernels
from rein.kernels import reference
from rein.model.architectures.linear import Linear, pack_weights
from rein.model.attention import AttentionMetadata, LayerCache, paged_attention
from rein.model.files import ModelFiles
from rein.model.spec import ModelSpec, UnsupportedModelError

ATTENTION_NAME = "rein_paged"

# (the layers' caches, the step's metadata) while a forward runs.
_step: ContextVar[tuple[list[LayerCache], AttentionMetadata] | None] = ContextVar("rein_step", default=None)


def rein_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   sliding_window: int | None = None, softcap: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q [1, heads, T, d], k/v [1, kv_heads, T, d]
    -> ([1, T, heads, d], no weights). The layer is the module's `layer_idx`."""
    step = _step.get()
    if step is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention ran outside a rein engine step")
    caches, meta = step
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(f"{type(module).__name__} adds attention sinks, which rein's paged attention lacks")
    cache = caches[module.layer_idx]
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    if k.shape[1:] != cache.k.shape[2:] or v.shape[1:] != cache.v.shape[2:]:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) gives keys/values of {tuple(k.shape[1:])} "
            f"and {tuple(v.shape[1:])} (heads, head_dim), but the config describes {tuple(cache.k.shape[2:])}")
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if softcap:
        meta = meta.for_cache(cache, sliding_window)
        kernels.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
        out = softcapped_attention(q, cache, meta, scale, softcap, sliding_window)
    else:
        out = paged_attention(q, k, v, cache, meta, scale, window=sliding_window)
    return out.unsqueeze(0), None


def softcapped_attention(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
                         softcap: float, window: int | None) -> torch.Tensor:
    """Attention whose scores are capped, softcap * tanh(scores / softcap), before the softmax
    (Gemma 2), which the paged kernels do not do: a torch path over each request's cached
    K/V, decode rows first, then the prefill chunks (as paged_attention lays them out).
    A request at a time, so slower than the kernels; only models that cap take it."""
    spans = []   # (first row, rows, context length incl. those rows, block table row)
    if meta.num_decode_tokens:
        for row, length in enumerate(meta.decode_context_lens.tolist()):
            spans.append((row, 1, length, meta.decode_block_tables[row]))
    if meta.prefill_cu_seqlens_q is not None:
        starts = meta.prefill_cu_seqlens_q.tolist()
        for i, length in enumerate(meta.prefill_context_lens.tolist()):
            spans.append((meta.num_decode_tokens + starts[i], starts[i + 1] - starts[i], length,
                          meta.prefill_block_tables[i]))
    out = torch.empty_like(q)
    group = q.shape[1] // cache.k.shape[2]
    for first, rows, length, table in spans:
        keys = reference.gather_kv(cache.k, cache.k_scale, table, length, q.dtype).repeat_interleave(group, 1)
        values = reference.gather_kv(cache.v, cache.v_scale, table, length, q.dtype).repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[first:first + rows], keys) * scale
        scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(length - rows, length, device=q.device).unsqueeze(1)
        k_pos = torch.arange(length, device=q.device).unsqueeze(0)
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[first:first + rows] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, rein_attention)


class TransformersModel(nn.Module):
    """A transformers causal LM behind the interface rein's model runner calls (as the native
    models': forward to final hidden states, then `compute_logits` on the rows that sample)."""

    def __init__(self, hf_model: nn.Module, can_generate: bool = True) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.can_generate = can_generate
        config = hf_model.config.get_text_config()
        # What the model's own forward does to the head's output (Gemma 2 caps, Granite
        # divides, Cohere multiplies); the base model's output is already past the final norm.
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        self.logits_divisor = getattr(config, "logits_scaling", None)
        self.logits_factor = getattr(config, "logit_scale", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step."""
        token = _step.set((caches, meta))
        try:
            out = self.hf_model.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                           use_cache=False, return_dict=True)
        finally:
            _step.reset(token)
        return out.last_hidden_state[0]

    def pack_cpu_weights(self) -> None:
        """The model's plain `nn.Linear` layers computed as rein's native ones are on the CPU:
        oneDNN with float32 weights prepacked once (rein.model.architectures.linear). Same parameters,
        same products up to summation order; F.linear's MKL path took about twice as long. A tied
        head gets its own packed copy of the embedding, as the native models' does."""
        for module in self.hf_model.modules():
            if type(module) is nn.Linear:
                module.__class__ = Linear
        pack_weights(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden)
        if self.logits_divisor:
            logits = logits / self.logits_divisor
        if self.logits_factor:
            logits = logits * self.logits_factor
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def load_transformers_model(files: ModelFiles, spec: ModelSpec, dtype: torch.dtype,
                            device: torch.device, trust_remote_code: bool = False) -> TransformersModel:
    """Build the model transformers builds for the directory's config, in `dtype` on `device`,
    with rein's attention; its weights from the safetensors (transformers' own loading, which
    reads them one at a time and knows each architecture's renamings) or from the GGUF file,
    dequantized one tensor at a time (transformers' own GGUF loading would hold the whole
    dequantized checkpoint beside the model). `trust_remote_code`: transformers may build the
    repository's own classes (config.json's auto_map); the engine refused such a model without
    it when it read the spec (rein.model.implementation.check_model_code)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rein.model.loader import gguf_tensors

    _register()
    config = AutoConfig.from_pretrained(str(files.directory), trust_remote_code=trust_remote_code)
    if files.gguf is not None:
        with _parameters_on_meta():
            hf_model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME,
                                                        trust_remote_code=trust_remote_code)
        with gguf_tensors(files.gguf, files.directory, dtype) as get:
            fill_parameters(hf_model, get, device)
        return TransformersModel(hf_model.eval())
    hf_model, info = AutoModelForCausalLM.from_pretrained(
        str(files.directory), config=config, dtype=dtype, attn_implementation=ATTENTION_NAME,
        device_map=device, output_loading_info=True, trust_remote_code=trust_remote_code)
    head = hf_model.get_output_embeddings()
    head_weight = None if head is None else f"{_name_of(hf_model, head)}.weight"
    missing = set(info["missing_keys"])
    # A checkpoint saved from the base model (an embedding model) has no head: transformers
    # fills it with random weights, so such a model computes hidden states only.
    headless = head_weight in missing
    if missing - {head_weight}:
        raise ValueError(f"weights not found in the checkpoint: {', '.join(sorted(missing - {head_weight}))}")
    return TransformersModel(hf_model.eval(), can_generate=not headless)


def fill_parameters(hf_model: nn.Module, get: Callable[[str], torch.Tensor | None], device: torch.device) -> None:
    """Give every parameter (created on the meta device) its checkpoint tensor, one at a time,
    then tie the tied ones again and move the buffers (rope tables: built for real) to `device`."""
    tied = set(getattr(hf_model, "all_tied_weights_keys", {}) or {})
    missing = []
    for name, param in list(hf_model.named_parameters()):
        tensor = get(name)
        if tensor is None:
            if name not in tied:
                missing.append(name)
            continue
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
        owner, _, leaf = name.rpartition(".")
        module = hf_model.get_submodule(owner)
        module._parameters[leaf] = nn.Parameter(tensor.to(device=device, dtype=param.dtype), requires_grad=False)
    hf_model.tie_weights()
    missing += [name for name, param in hf_model.named_parameters() if param.is_meta and name not in missing]
    if missing:
        raise ValueError(f"weights not found in the checkpoint: {', '.join(sorted(missing))}")
    hf_model.to(device)


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build a model whose parameters live on the meta device (no memory, no random init kept)
    while its buffers are real: rope tables and scales are computed in the modules' __init__,
    and nothing in a checkpoint restores them."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _name_of(root: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in root.named_modules() if candidate is module)
