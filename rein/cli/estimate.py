"""`rein estimate --model DIR --memory 24GiB`: how much KV cache, and how many requests, fit.

Reads the config only (config.json, or a GGUF file's metadata), no weights. The arithmetic is the engine's own
(`rein.model.capacity`, `EngineConfig`'s dtype rules, the runner's max_model_len rule),
so the estimate and the pool the engine builds agree. Memory for activations and the CUDA
context is not counted: leave some headroom. A windowed model's sliding-window layers get
storage of their own sized from --max-num-seqs and --max-num-batched-tokens (as the
engine's), and the full-attention layers' pool the rest. With --tensor-parallel-size N, --memory is
one device's and the figures are one rank's: its share of the weights, and a cache of its KV
heads (one replicated KV head per rank where N exceeds the model's KV heads).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rein.engine.options import DTYPES, KV_CACHE_DTYPES
from rein.model.files import resolve_model
from rein.model.implementation_names import MODEL_IMPLS
from rein.model.quant.names import QUANTIZATIONS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "estimate", help="KV-cache capacity for a model and a memory size",
        description="Weights size, KV bytes per token, and how many tokens and concurrent requests "
                    "fit in the memory left for the KV cache. Reads the model's config (config.json, or a GGUF file's metadata) only.")
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a model directory, a GGUF file or a hub id")
    parser.add_argument("--memory", required=True, metavar="SIZE",
                        help="device memory for weights + KV cache, e.g. 24GiB")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="context length (default: the model's)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache element type (default: the weights dtype)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="weights dtype (default: what the engine picks on --device)")
    parser.add_argument("--device", default="cuda",
                        help="the device 'auto' dtypes are resolved for (default cuda: bfloat16)")
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="requests running at once (default: the engine's); sizes a windowed model's "
                             "sliding-window storage")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                        help="tokens per engine step (default: the engine's); sizes it too")
    parser.add_argument("--context-len", type=int, default=None, metavar="N",
                        help="tokens per request when counting concurrent requests (default: max_model_len)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                        help="as the engine's flag: auto counts a GGUF file's blocks, AWQ and GPTQ at their "
                             "quantized size; none dequantized; int8 / int4 quantized at load")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="ranks the model is sharded over: --memory is then one device's, and the "
                             "weights and KV cache one rank's (default 1)")
    parser.add_argument("--model-impl", choices=MODEL_IMPLS, default="auto",
                        help="as the engine's flag: native code (rein), the Transformers backend, or auto")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers read a config that needs the repository's own code")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        print(estimate(args))
    except EstimateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


class EstimateError(ValueError):
    pass


def _by_layer_kind(spec, capacity, max_num_seqs: int, max_num_batched_tokens: int) -> list[str]:
    """A windowed model's KV per token split by layer kind, what a request at max_model_len
    holds of each, and whether its windowed layers get storage of their own
    (rein.model.capacity): why not, when they do not."""
    from rein.model.capacity import windowed_pool_bound

    per_layer = capacity.bytes_per_token // spec.num_layers
    windowed = spec.windowed_layers
    full = spec.num_layers - windowed
    window = max(w for w in spec.layer_windows if w is not None)
    max_model_len, block_size = capacity.max_model_len, capacity.block_size
    needed = min(window, max_model_len)
    lines = [
        f"KV by layer kind: {windowed} sliding-window layers (window {window:,}) x {per_layer:,} + {full} "
        f"full-attention layers x {per_layer:,} bytes per token",
        f"  a {max_model_len:,}-token request: its windowed layers attend to {needed:,} positions "
        f"({windowed * per_layer * needed:,} bytes of their {windowed * per_layer * max_model_len:,})",
    ]
    bound = windowed_pool_bound(window, block_size, max_num_seqs, max_num_batched_tokens)
    formula = (f"{max_num_seqs} seqs x ({-(-window // block_size)} + 1) + "
               f"{-(-max_num_batched_tokens // block_size)} + {max_num_seqs}")
    if capacity.num_windowed_blocks:
        lines.append(
            f"  rein keeps only what the windows cover: the windowed layers' own storage holds {bound:,} blocks "
            f"({formula}, what running requests can hold at once) of {capacity.windowed_bytes_per_block:,} bytes "
            f"= {capacity.num_windowed_blocks * capacity.windowed_bytes_per_block:,} bytes"
            + (", every block the memory has room for (every layer is windowed)"
               if capacity.num_windowed_blocks > bound else "")
            + "; the block pool below is the full-attention layers'")
    elif window >= max_model_len:
        lines.append("  rein keeps every position in every layer: the window spans max_model_len")
    else:
        lines.append(f"  rein keeps every position in every layer: storage of their own for the windowed layers "
                     f"needs {bound:,} blocks ({formula}), no fewer than the memory holds with every layer "
                     f"alike; lower --max-num-seqs or give more memory")
    return lines


def _load_spec(model: str, model_impl: str, trust_remote_code: bool):
    """The spec the engine would run under `--model-impl`, and the folder holding config.json."""
    from rein.model.implementation import spec_for  # torch: not at every command's start-up

    if Path(model).expanduser().exists():  # a model directory or a GGUF file (its shapes)
        directory = resolve_model(model).directory
    else:
        try:
            from huggingface_hub import hf_hub_download

            directory = Path(hf_hub_download(model, "config.json")).parent
        except Exception as exc:  # offline, 404, auth: the hub raises many kinds
            raise EstimateError(f"{model} is not a local model directory and its config.json could not be "
                                f"fetched from the Hugging Face hub ({type(exc).__name__}: {exc})") from exc
    return spec_for(directory, model_impl, trust_remote_code), directory


def _transformers_parameters(directory: Path, trust_remote_code: bool) -> int:
    """A Transformers-backend model's parameter count: the model transformers builds, on the meta
    device (no memory, no weights read), so every architecture's own layers are counted."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception as exc:  # a config transformers cannot build: its many kinds of error
        raise EstimateError(f"transformers cannot build the model in {directory}: {type(exc).__name__}: "
                            f"{exc}") from exc
    return sum(p.numel() for p in model.parameters())   # a tied head is one parameter, counted once


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _bytes(n: int) -> str:
    return f"{n} byte" if n == 1 else f"{n} bytes"


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def estimate(args: argparse.Namespace) -> str:
    """The report, as text; EstimateError for anything the user must change."""
    import dataclasses

    import torch  # here and below: torch loads for `rein estimate` only

    from rein.engine.config import EngineConfig, parse_bytes
    from rein.engine.model_runner import decide_max_model_len
    from rein.model.capacity import kv_capacity, parameters_per_rank, rank_spec
    from rein.model.implementation import TRANSFORMERS_FAMILY, check_shardable
    from rein.model.quant.checkpoint import estimated_weight_bytes

    try:
        memory = parse_bytes(args.memory)
        limits = {name: value for name, value in (("max_num_seqs", args.max_num_seqs),
                                                  ("max_num_batched_tokens", args.max_num_batched_tokens))
                  if value is not None}
        config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                              kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                              max_model_len=args.max_model_len, **limits)
        spec, directory = _load_spec(args.model, args.model_impl, args.trust_remote_code)
        max_model_len = decide_max_model_len(spec, args.max_model_len)
        dtype, cache_dtype = config.torch_dtype, config.cache_torch_dtype
        tp = args.tensor_parallel_size
        if tp < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp}")
        check_shardable(spec, tp)
        rank = rank_spec(spec, tp)   # ValueError for a size the heads refuse
    except (ValueError, RuntimeError, FileNotFoundError) as exc:  # bad sizes, unsupported or missing model, ...
        raise EstimateError(str(exc)) from exc

    elem = torch.empty((), dtype=dtype).element_size()
    if spec.family == TRANSFORMERS_FAMILY:
        params = _transformers_parameters(directory, args.trust_remote_code)
        weights = params * elem
        held = ""
    else:
        params = spec.num_parameters()
        weights, held = estimated_weight_bytes(spec, directory, elem, args.quantization)
    counted = (f"{params:,} parameters, {held}, the rest x {_bytes(elem)} ({_dtype_name(dtype)})" if held
               else f"{params:,} parameters x {_bytes(elem)} ({_dtype_name(dtype)})")
    lines = [
        f"model: {spec.architecture}, {spec.num_layers} layers, {spec.num_heads} heads, "
        f"{spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, max_model_len {max_model_len}",
        f"weights: {counted} = {weights:,} bytes ({_size(weights)})",
    ]
    if tp > 1:
        # Scaled by the parameters a rank holds (its share, plus what every rank keeps whole).
        share = parameters_per_rank(spec, tp)
        weights = weights * share // params
        copies = tp // spec.num_kv_heads
        kv = (f"{rank.num_kv_heads} KV head{'s' if rank.num_kv_heads > 1 else ''} of {spec.num_kv_heads}"
              if copies <= 1 else
              f"1 KV head of {spec.num_kv_heads}, replicated: each KV head is computed and cached on {copies} ranks")
        lines.append(f"tensor parallel: {tp} ranks, each with {rank.num_heads} query head{'s' if rank.num_heads > 1 else ''} and {kv}; weights per "
                     f"rank: {share:,} of {params:,} parameters = about {weights:,} bytes ({_size(weights)})")
    if weights >= memory:
        raise EstimateError(
            f"the weights alone need {weights:,} bytes ({_size(weights)}, {_dtype_name(dtype)}), which is "
            f"not less than --memory {memory:,} bytes ({_size(memory)}): give more memory or a smaller "
            f"--dtype")

    kv_memory = memory - weights
    max_num_seqs, max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
    capacity = kv_capacity(rank, kv_memory, cache_dtype, config.block_size, max_model_len, max_num_seqs,
                           max_num_batched_tokens)
    cache_elem = torch.empty((), dtype=cache_dtype).element_size()
    formula = (f"2 x {spec.num_layers} layers x {rank.num_kv_heads} kv_heads x {spec.head_dim} head_dim "
               f"x {_bytes(cache_elem)} ({_dtype_name(cache_dtype)})")
    if cache_dtype == torch.int8:
        formula += f" + 2 x {spec.num_layers} layers x {rank.num_kv_heads} kv_heads x 4 bytes (fp32 scales)"
    context_len = args.context_len or max_model_len
    if context_len < 1 or context_len > max_model_len:
        raise EstimateError(f"--context-len must be between 1 and max_model_len {max_model_len}, got {context_len}")
    at_context = dataclasses.replace(capacity, max_model_len=context_len)
    lines += [
        f"KV cache per token: {formula} = {capacity.bytes_per_token:,} bytes",
        f"memory left for the KV cache: {memory:,} - {weights:,} = {kv_memory:,} bytes ({_size(kv_memory)})",
        f"KV cache{' (full-attention layers)' if capacity.num_windowed_blocks else ''}: "
        f"{capacity.num_blocks:,} blocks x {capacity.block_size} tokens = {capacity.num_tokens:,} tokens "
        f"({capacity.bytes_per_block:,} bytes per block"
        f"{'; block ids only: every layer is windowed' if capacity.num_windowed_blocks and not capacity.bytes_per_block else ''})",
        f"concurrent requests at {context_len:,} tokens: {at_context.max_full_requests:,} "
        f"({at_context.blocks_per_full_request:,} blocks each)",
    ]
    if spec.windowed_layers:
        lines[3:3] = _by_layer_kind(spec, capacity, max_num_seqs, max_num_batched_tokens)
    if capacity.num_tokens < max_model_len:
        lines.append(f"warning: the KV cache holds fewer tokens than max_model_len {max_model_len}; the engine "
                     f"would refuse to start: give more memory or a lower --max-model-len")
    lines.append("(activations and the CUDA context need memory too, not counted here)")
    return "\n".join(lines)
