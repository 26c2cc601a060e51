"""The engine's one configuration object: capacity, budgets, dtype and device.

Everything that sizes or shapes the engine is decided here and validated in
`__post_init__`; nothing deeper reads the environment or re-derives these values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from rein.core.images import DEFAULT_MAX_IMAGE_PIXELS
from rein.core.tool_call_parser_names import TOOL_CALL_PARSERS
from rein.engine.generation_defaults import check_generation_config
from rein.engine.options import (
    AUTO,
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZED_ACTIVATIONS,
    check_tensor_parallel_size,
)
from rein.model.implementation_names import check_model_impl
from rein.model.quant.names import check_quantization

MAX_LORA_RANK = 256
# interactive_step_budget "auto" on a CPU (off on CUDA): the setting that met bench/priority.py's
# targets (docs/benchmarks.md); on a CPU a step's time grows with its tokens, on CUDA it hardly does.
CPU_INTERACTIVE_STEP_BUDGET = 4

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str | int) -> int:
    """'24GiB' -> 25769803776; plain integers are bytes. Raises ValueError naming the input."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read {text!r} as a size: use a number of bytes or a unit such as 512MiB, 24GiB, 8GB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is fp32 on CPU (exact, testable) and bf16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use {', '.join(DTYPES[:-1])} or {DTYPES[-1]}") from None


def resolve_step_budget(value: int | str | None, device: str) -> int | None:
    """The interactive step budget for `value` on `device`: "auto" is CPU_INTERACTIVE_STEP_BUDGET on
    a CPU and None (no limit) elsewhere, "off" None, an integer itself (at least 0)."""
    if value == "auto":
        return CPU_INTERACTIVE_STEP_BUDGET if device == "cpu" else None
    if value is None or value == "off":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"interactive_step_budget must be an integer of at least 0, auto or off, got {value!r}")
    return value


@dataclass
class EngineConfig:
    """How big the engine is and where it runs.

    kv_cache_memory: bytes for the KV block pool (int or '4GiB'); when None, on CUDA,
    gpu_memory_utilization sizes it: the share of the device's total memory rein fills, so the
    pool gets the memory free after the weights less (1 - gpu_memory_utilization) x total (as
    vLLM's, memory other processes hold counts against it); on CPU a fixed 1 GiB.
    enforce_eager: on CUDA, run decode-only steps kernel by kernel instead of replaying the
    CUDA graphs captured at start (rein.engine.cuda_graphs); CPU engines always run eagerly.
    async_scheduling (vLLM's name): overlap the host's work with the forward pass: the next step
    is planned while the model runs this one, and the forward and sampling run on a worker thread
    while the engine's thread detokenizes, checks stops and makes the outputs of the step before
    (rein.engine.async_scheduling). Outputs are the same as without it; steps that need a token on
    the host before the next can be planned (structured outputs, n > 1 forks, LoRA, images,
    tensor parallelism, requests waiting) run as before. Off by default until measured on CUDA.
    enable_prefix_caching: a request whose leading tokens (whole KV blocks) another request
    already computed reuses those blocks instead of computing them (rein.engine.block_pool).
    generation_config: where the sampling defaults of requests come from (auto: the model's
    generation_config.json; vllm or none: built-in; or a folder), rein.engine.generation_defaults.
    The engine itself applies none: they are filled into SamplingParams when a request is parsed.
    model_impl (vLLM's name): rein runs native code only, transformers the model's own transformers
    modeling code with rein's attention (rein.model.architectures.transformers_backend), auto native
    code where rein has it, else transformers.
    tokenizer: a tokenizer directory or hub id used instead of the model's (vLLM's names from here on);
    tokenizer_revision its hub revision. revision: the hub revision of a `model` given as a hub id.
    chat_template: a Jinja template, as a file path or inline, set on the tokenizer in place of its
    own, so every chat prompt is built with it (rein.model.tokenizer_files).
    tool_call_parser (vLLM's name): the format `rein run-batch` reads tool calls from in auto-mode
    answers (rein.openai.tool_call_parsers); None: the chat template's, else hermes. The engine
    itself does not parse them.
    trust_remote_code: let transformers import and run the Python files of a model or tokenizer
    whose config names them (`auto_map`); without it such a model is refused, saying so.
    tensor_parallel_size: ranks the model is sharded over, one process and device each
    (rein.engine.rank_processes); on CUDA, devices `device`, `device` + 1, ...
    quantization (vLLM's name): auto keeps the checkpoint's own (GGUF blocks, AWQ, GPTQ kept
    quantized; float stays float), none dequantizes everything to `dtype`, int8 / int4 /
    int4-gN quantize a float checkpoint's projections at load (rein.model.quant.checkpoint).
    quantized_activations: on the CPU, what quantized weights multiply -- float32 activations as
    they are (the default), or int8: each row's activations quantized per block of 32 to int8
    with a float scale (llama.cpp's Q8_0) and integer dot products (AVX-512 VNNI, AVX2), faster
    at large batch and not exact (rein.kernels.quantized.Int8Panels; bench/int8_activations.py).
    interactive_step_budget: while a request with interactive priority (below PRIORITY_BATCH) is
    in the engine, a step holds at most this many batch-priority tokens (decodes 1 each, prefill
    chunks their length), so that interactive requests' steps cost near what they cost idle; the
    batch requests left out pause (keeping their KV blocks), and batch prefill chunks stay held
    for a while after (rein.engine.scheduler). "auto" (the default): CPU_INTERACTIVE_STEP_BUDGET on
    a CPU, where a step's time grows with its tokens, and no limit elsewhere (on CUDA a step of many
    decodes costs about what one costs, and holding the batch back would only slow it); "off" or
    None: no such limit.
    enable_lora, max_loras, max_cpu_loras, max_lora_rank (vLLM's names): serve LoRA adapters beside
    the base model (rein.model.lora; requests carry a LoRARequest). At most `max_loras` distinct
    adapters run in one step (the device slots; requests of other adapters wait), `max_cpu_loras`
    (None: max_loras) loaded adapters are kept in host memory for later requests, and adapters of
    rank above `max_lora_rank` are refused. Under tensor parallelism each rank holds its shard of
    every adapter (rein.model.lora.sharding).
    reasoning_parser (vLLM's name): deepseek_r1 or qwen3, read where chat bodies are built
    (rein.openai.reasoning); the engine itself needs only each request's end-of-think token
    (SamplingParams.structured_after_token_id).
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | str | None = None
    seed: int = 0
    enforce_eager: bool = False
    async_scheduling: bool = False
    enable_prefix_caching: bool = True
    generation_config: str = "auto"
    model_impl: str = "auto"
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    chat_template: str | None = None
    tool_call_parser: str | None = None
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    quantization: str = "auto"
    quantized_activations: str = "float32"
    interactive_step_budget: int | str | None = "auto"
    enable_lora: bool = False
    max_loras: int = 8
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    reasoning_parser: str | None = None
    # Vision models (rein.engine.multimodal). max_num_encoder_tokens: image tokens the vision
    # encoder may produce per step, beside the text prefill (None: max_num_batched_tokens; an image
    # larger than the budget still runs alone in a step). encoder_cache_tokens: image embeddings
    # kept (rows, least recently used dropped first) so chunks, n > 1 choices, recomputes and
    # repeated images never re-encode.
    max_num_encoder_tokens: int | None = None
    encoder_cache_tokens: int = 16384
    # The most pixels an image may declare (REIN_MAX_IMAGE_PIXELS; rein.core.images.open_image):
    # the API checks it at intake, the engine again on the images it is given.
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS

    def __post_init__(self) -> None:
        check_generation_config(self.generation_config)   # a ValueError naming the choices
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser {self.tool_call_parser!r} is not supported: use one of "
                             f"{', '.join(TOOL_CALL_PARSERS)}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: use one of {', '.join(KV_CACHE_DTYPES)}"
            )
        check_model_impl(self.model_impl)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError("kv_cache_memory must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_num_encoder_tokens is None:
            self.max_num_encoder_tokens = self.max_num_batched_tokens
        if self.max_num_encoder_tokens < 1 or self.encoder_cache_tokens < 1 or self.max_image_pixels < 1:
            raise ValueError("max_num_encoder_tokens, encoder_cache_tokens and max_image_pixels must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"
            )
        check_quantization(self.quantization)
        if self.quantized_activations not in QUANTIZED_ACTIVATIONS:
            raise ValueError(f"quantized_activations {self.quantized_activations!r}: use one of "
                             f"{', '.join(QUANTIZED_ACTIVATIONS)}")
        check_tensor_parallel_size(self.tensor_parallel_size)
        self.interactive_step_budget = resolve_step_budget(self.interactive_step_budget, self.device)
        if isinstance(self.max_model_len, str) and self.max_model_len != AUTO:
            raise ValueError(f"max_model_len must be a number of tokens or {AUTO!r}, got {self.max_model_len!r}")
        if isinstance(self.max_model_len, int) and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        self._check_lora()

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be between 1 and {MAX_LORA_RANK}, got {self.max_lora_rank}")

    @property
    def cpu_lora_capacity(self) -> int:
        """Loaded adapters kept in host memory (max_cpu_loras, by default max_loras)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.torch_device)

    @property
    def cache_torch_dtype(self) -> torch.dtype:
        if self.kv_cache_dtype == "int8":
            return torch.int8
        return resolve_dtype(self.kv_cache_dtype, self.torch_device) if self.kv_cache_dtype != "auto" \
            else self.torch_dtype
