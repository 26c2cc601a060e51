"""The engine options every engine-running subcommand shares, and their EngineConfig.

No torch import at module top: `rein --help` builds every parser.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rein.engine.config import EngineConfig

KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8")  # as rein.engine.config
DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a Hugging Face model directory, a GGUF file (needs rein[gguf]) or a hub id")


def add_engine_options(parser: argparse.ArgumentParser, seed: bool = True) -> None:
    """seed=False leaves --seed to the command (`rein generate` uses it for the request)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--max-num-seqs", type=int, default=64, metavar="N",
                       help="most requests in one step (default 64)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                       help="token budget of one step (default 2048)")
    group.add_argument("--max-model-len", type=int, default=None, metavar="N",
                       help="context length (default: the model's)")
    group.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                       help="memory for the KV cache, e.g. 2GiB (default: 90%% of free GPU memory, 1GiB on CPU)")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="KV cache element type (default: the model dtype)")
    group.add_argument("--dtype", choices=DTYPES, default="auto",
                       help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")
    group.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda if available)")
    group.add_argument("--block-size", type=int, default=16, metavar="N", help="tokens per KV block (default 16)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="on CUDA, launch decode steps kernel by kernel instead of replaying CUDA graphs")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="compute every prompt in full instead of reusing the KV blocks of leading "
                            "tokens other requests computed")
    if seed:
        group.add_argument("--seed", dest="engine_seed", type=int, default=0, metavar="N",
                           help="engine seed, for requests that give none (default 0)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Raises ValueError (with the engine's message) for an invalid combination."""
    from rein.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=getattr(args, "engine_seed", 0),
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def build_engine(args: argparse.Namespace):
    """The engine for these args; configuration and model errors become `CLIError`."""
    from rein.engine.engine import LLMEngine

    try:
        return LLMEngine(engine_config_from_args(args))
    except (ValueError, FileNotFoundError) as exc:  # bad sizes, missing model, capacity errors
        raise CLIError(str(exc)) from exc


class CLIError(Exception):
    """A user error the command reports on one line (exit status 2)."""
