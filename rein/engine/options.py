"""The engine options, defined once: flags, REIN_* variables, `rein.LLM` keywords.

Every engine-running entry point takes the same options under vLLM's names: `rein worker`,
`rein run-batch` and `rein generate` as flags (`--max-num-seqs`), `rein.LLM` as keyword
arguments (`max_num_seqs=`), and each also reads its `REIN_*` variable (REIN_MAX_NUM_SEQS,
through rein.core.settings.EngineSettings, the only reader of the environment). Precedence:
a flag or keyword argument given > the variable > the default. The defaults are
EngineSettings' (equal to EngineConfig's: a test checks it), so argparse defaults are None
("not given") and `resolve_engine_values` does the layering.

No torch import at module top: `rein --help` builds every parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rein.core.settings import EngineSettings, load_engine_settings
from rein.core.tool_call_parser_names import TOOL_CALL_PARSERS
from rein.model.implementation_names import MODEL_IMPLS
from rein.model.quant.names import QUANTIZATIONS

# The names --dtype and --kv-cache-dtype take, here and in EngineConfig (rein.engine.config),
# which resolves them to torch dtypes; defined here because this module imports no torch.
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = (*DTYPES, "int8")
# --quantized-activations: what CPU quantized weights multiply (rein.kernels.quantized.Int8Panels).
QUANTIZED_ACTIVATIONS = ("float32", "int8")

AUTO = "auto"      # --max-model-len auto: the longest context the KV cache holds (rein.engine.model_runner)


def max_model_len_value(text: str) -> int | str:
    """A --max-model-len value: a positive number of tokens, or "auto"."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a number of tokens or auto, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


WORKER = "worker"
OFFLINE = ("run-batch", "generate")        # the commands with an engine in the process
API = "api"                                # runs no engine, but checks and completes requests


def step_budget(text: str) -> int | str:
    """--interactive-step-budget's value: a number of tokens (at least 0), auto or off."""
    if text in ("auto", "off"):
        return text
    value = int(text)   # argparse reports a ValueError as "invalid step_budget value"
    if value < 0:
        raise ValueError(text)
    return value


@dataclass(frozen=True)
class EngineOption:
    """One engine option. `name` is the EngineConfig field, the `rein.LLM` keyword, the
    EngineSettings field (variable REIN_<NAME>) and the argparse dest; the flag is `--name`
    with dashes. `boolean` options take `--name` / `--no-name`."""

    name: str
    help: str
    type: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    boolean: bool = False
    commands: tuple[str, ...] = (WORKER, *OFFLINE)
    shown_default: str | None = None     # what an unset default means, for --help

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def variable(self) -> str:
        return "REIN_" + self.name.upper()

    @property
    def default(self) -> Any:
        return EngineSettings.model_fields[self.name].default


ENGINE_OPTIONS: tuple[EngineOption, ...] = (
    EngineOption("max_model_len", "context length, prompt + completion (for a served model, its REIN_MODELS "
                 "entry's @N comes before REIN_MAX_MODEL_LEN); auto: the most the KV cache holds, up to the "
                 "model's own (on the CPU also what an unset one does when the model's own does not fit)",
                 max_model_len_value, "N|auto", shown_default="the model's",
                 commands=(WORKER, *OFFLINE, API)),
    EngineOption("max_num_seqs", "most requests in one step; the worker's concurrency too", int, "N"),
    EngineOption("max_num_batched_tokens", "token budget of one step (prefill chunks + decodes)", int, "N"),
    EngineOption("max_num_encoder_tokens", "vision models: image tokens the vision encoder may produce in one "
                 "step, beside the text prefill (an image larger than N runs alone in a step)", int, "N",
                 shown_default="--max-num-batched-tokens", commands=(WORKER, *OFFLINE)),
    EngineOption("encoder_cache_tokens", "vision models: image embeddings kept by image (rows, least recently "
                 "used dropped first), so chunks, choices, recomputes and repeated images are encoded once",
                 int, "N", commands=(WORKER, *OFFLINE)),
    EngineOption("max_image_pixels", "vision models: the most pixels (width x height) an image may declare; "
                 "larger ones are refused before their pixels are decoded", int, "N",
                 commands=(WORKER, *OFFLINE)),
    EngineOption("interactive_step_budget", "while interactive requests (priority below batch) are in the engine, "
                 "hold a step's batch-priority work to N tokens (decodes 1 each, prefill chunks their length) so "
                 "interactive token latency stays near idle; the batch requests left out pause for that step, "
                 "and batch prefill stays within 4N tokens a step for 64 steps after (256 outside them); "
                 "auto: 4 on a CPU, off on CUDA", step_budget, "N|auto|off"),
    EngineOption("gpu_memory_utilization", "without --kv-cache-memory, on CUDA: the share of the device's total "
                 "memory rein fills; the KV cache gets what is free after the weights less (1 - FRACTION) x total",
                 float, "FRACTION"),
    EngineOption("kv_cache_memory", "memory for the KV cache, e.g. 2GiB; wins over --gpu-memory-utilization",
                 str, "SIZE", shown_default="--gpu-memory-utilization on CUDA, 1GiB on CPU"),
    EngineOption("kv_cache_dtype", "KV cache element type (auto: the model dtype)", choices=KV_CACHE_DTYPES),
    EngineOption("dtype", "weights and activations (auto: bfloat16 on CUDA, float32 on CPU)", choices=DTYPES),
    EngineOption("device", "auto, cuda, cuda:N or cpu (auto: cuda if available)", str, "DEVICE"),
    EngineOption("block_size", "tokens per KV block (a power of two)", int, "N"),
    EngineOption("enable_prefix_caching", "reuse the KV blocks of leading tokens other requests computed "
                 "(--no-enable-prefix-caching: compute every prompt in full)", boolean=True),
    EngineOption("enforce_eager", "on CUDA, launch decode steps kernel by kernel instead of replaying CUDA graphs",
                 boolean=True),
    EngineOption("async_scheduling", "plan the next step and make the outputs of the last while the model runs "
                 "this one (forward and sampling on a worker thread); the same outputs, steps that need a token "
                 "first (structured outputs, n > 1 forks, LoRA, images, tensor parallelism) run as without it",
                 boolean=True),
    EngineOption("model_impl", "rein: rein's native model code only; transformers: the model's own transformers "
                 "code with rein's paged attention (any causal LM transformers builds); auto: native code where "
                 "rein has it, else transformers", choices=MODEL_IMPLS),
    EngineOption("tensor_parallel_size", "shard the model over N ranks, one process and device each (CUDA: "
                 "--device and the N-1 after it; CPU: the cores split between them); N must divide the model's "
                 "attention and KV heads", int, "N"),
    EngineOption("quantization", "weights: auto keeps the checkpoint's own (GGUF blocks, AWQ and GPTQ stay "
                 "quantized; float stays float); none dequantizes all to --dtype; int8 (per channel) and int4 "
                 "(groups of 128, or int4-gN) quantize a float checkpoint's projections at load; awq, gptq, gguf "
                 "(vLLM's names) are auto for a checkpoint of that method",
                 choices=QUANTIZATIONS),
    EngineOption("quantized_activations", "CPU quantized weights: float32 multiplies the activations as they "
                 "are; int8 quantizes them per row and block of 32 (llama.cpp's Q8_0) and uses integer dot "
                 "products: faster at large batch, not exact", choices=QUANTIZED_ACTIVATIONS),
    EngineOption("seed", "engine seed: seeds the sampling of requests that give no seed", int, "N"),
    EngineOption("generation_config", "sampling defaults of requests: auto (the model's generation_config.json), "
                 "vllm (built-in; none is the same), or a folder holding a generation_config.json",
                 str, "auto|vllm|FOLDER", commands=(*OFFLINE, API)),
    # The API tokenizes requests and applies the chat template itself, so it takes the options
    # that choose the tokenizer and template, and they must agree with the worker's.
    EngineOption("tokenizer", "a tokenizer directory or hub id to use instead of the model's", str, "DIR|HUB_ID",
                 shown_default="the model's", commands=(WORKER, *OFFLINE, API)),
    EngineOption("revision", "hub revision (branch, tag or commit) of a --model given as a hub id", str,
                 "REVISION", shown_default="the default branch", commands=(WORKER, *OFFLINE, API)),
    EngineOption("tokenizer_revision", "hub revision of a --tokenizer given as a hub id", str, "REVISION",
                 shown_default="the default branch", commands=(WORKER, *OFFLINE, API)),
    EngineOption("chat_template", "a Jinja chat template, as a file path or inline, replacing the tokenizer's",
                 str, "FILE|TEMPLATE", shown_default="the tokenizer's", commands=(WORKER, *OFFLINE, API)),
    EngineOption("tool_call_parser", "the format tool calls are read from in tool_choice auto answers (vLLM's "
                 "names)", choices=TOOL_CALL_PARSERS, shown_default="the chat template's, else hermes",
                 commands=("run-batch", API)),      # `rein generate` takes no tools
    EngineOption("trust_remote_code", "let transformers run the Python code of a model or tokenizer whose "
                 "config needs it (auto_map); without it such a model is refused", boolean=True,
                 commands=(WORKER, *OFFLINE, API)),
    # Read where chat bodies are built (the API, run-batch); a worker's engine learns each request's
    # end-of-think token from its sampling params.
    EngineOption("reasoning_parser", "split a reasoning model's thinking into reasoning_content: deepseek_r1 or "
                 "qwen3 (vLLM's names); with several served models, name=parser,... per model",
                 str, "PARSER", shown_default="none", commands=(*OFFLINE, API)),
    # LoRA (issue 44), vLLM's flags. The API checks adapters' ranks against --max-lora-rank.
    EngineOption("enable_lora", "serve LoRA adapters beside the base model (requests name one as their "
                 "model; on by itself when --lora-modules or REIN_LORA_MODULES names one)", boolean=True,
                 commands=(WORKER, *OFFLINE, API)),
    EngineOption("max_loras", "with LoRA: the most distinct adapters one step runs (device slots); "
                 "requests of other adapters wait", int, "N", commands=(WORKER, *OFFLINE)),
    EngineOption("max_cpu_loras", "with LoRA: loaded adapters kept in host memory for later requests "
                 "(at least max_loras)", int, "N", shown_default="max_loras", commands=(WORKER, *OFFLINE)),
    EngineOption("max_lora_rank", "with LoRA: the largest adapter rank accepted (1-256)", int, "N",
                 commands=(WORKER, *OFFLINE, API)),
)
ENGINE_OPTION_NAMES = tuple(option.name for option in ENGINE_OPTIONS)


def options_for(command: str) -> tuple[EngineOption, ...]:
    return tuple(option for option in ENGINE_OPTIONS if command in option.commands)


def options_by_name(name: str) -> EngineOption:
    return next(option for option in ENGINE_OPTIONS if option.name == name)


def resolve_engine_values(given: Mapping[str, Any], variables: EngineSettings | None = None,
                          names: tuple[str, ...] = ENGINE_OPTION_NAMES) -> dict[str, Any]:
    """Each option's value: `given` (flags or keywords; None = not given) > REIN_* > default.

    `variables` are the REIN_* values (EngineSettings, or the worker's Settings); by default
    they are read now. Raises SettingsError for a bad variable.
    """
    variables = variables if variables is not None else load_engine_settings()
    return {name: given[name] if given.get(name) is not None else getattr(variables, name) for name in names}


def check_tensor_parallel_size(size: int, name: str = "tensor_parallel_size") -> int:
    """`size` if it is at least 1; else ValueError naming `name` (the keyword, or the flag for a
    caller that reads flags). The one check: EngineConfig's, and the worker supervisor's, which
    splits devices into engines before any engine is configured."""
    if size < 1:
        raise ValueError(f"{name} must be at least 1, got {size}")
    return size
