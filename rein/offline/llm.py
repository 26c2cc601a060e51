"""`rein.LLM`: the offline Python API vLLM users already write, on rein's engine.

    from rein import LLM, SamplingParams
    llm = LLM(model="path/to/model-or.gguf", max_model_len=2048)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)

The constructor takes vLLM's keyword names and maps them onto `EngineConfig`.
`generate` and `chat` check and tokenize every prompt first (a bad one raises ValueError
naming its index before any request runs), then drive the engine through
`rein.offline.driver`, the same windowed admit/step/collect loop as `rein run-batch`: at
most `max_in_flight` requests are in the engine at once, however many prompts are given.
Outputs come back in input order.

The result classes are vLLM's (rein.offline.llm_outputs); prompts are read as vLLM reads them
(rein.offline.prompts).

Choices where rein differs from vLLM:

* Text prompts are encoded with the tokenizer's special tokens (BOS), as vLLM and rein's
  /v1/completions do; chat prompts come from the chat template alone, built by the same
  code as rein's /v1/chat/completions (`rein.openai.prompts`).
* A prompt whose length plus `max_tokens` exceeds the context is refused (ValueError), as
  rein's API does, rather than having its completion cut short.
* `Logprob.rank` is the 1-based rank when the token is among the returned top
  alternatives, else None (the engine returns only the top `logprobs` entries).
* `n` > 1 gives `outputs` with one CompletionOutput per choice, by index (the choices
  share the prompt's prefill; choice i samples with seed `seed + i`). `prompt_logprobs=k`
  fills `GenerationOutput.prompt_logprobs` as vLLM's: None for the first prompt token, then
  {token id: Logprob} with the prompt token and its top k alternatives.
* LoRA adapters (`enable_lora=True`, then `lora_request=` in `generate` and `chat`): a prompt
  whose adapter cannot be loaded does not stop the others; its output has no tokens,
  finish_reason "abort" and `error` saying what was wrong (logged too).
* No beam search, best_of or multimodal inputs.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from rein.core.images import ImageError, ImageInput, open_image
from rein.engine.errors import EngineRequestError
from rein.engine.generation_defaults import load_generation_defaults
from rein.engine.options import ENGINE_OPTION_NAMES, resolve_engine_values
from rein.engine.request_result import RequestResult
from rein.engine.sampling_params import SamplingParams, fits_context
from rein.model.lora.request import LoRARequest
from rein.offline.driver import default_max_in_flight, drive
from rein.offline.embed import EmbeddingRequestOutput, embed
from rein.offline.llm_outputs import (
    CompletionOutput,
    GenerationOutput,
    TokenTexts,
    completion_output,
    logprob_dict,
)
from rein.offline.prompts import (
    Conversation,
    Prompt,
    PromptType,
    as_prompt_list,
    checked_prompt,
    is_conversation,
    read_prompt,
)
from rein.openai.errors import RequestError
from rein.openai.images import image_parts
from rein.openai.prompts import chat_prompt
from rein.openai.reasoning import check_parser_names

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.model.pooling_config import PoolingParams

log = logging.getLogger(__name__)

# vLLM arguments rein accepts but that change nothing here.
_IGNORED_ARGS = frozenset({"disable_log_stats"})


def _records_given_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Keeps the keywords a caller actually gave (as `self._given_arguments`) so that an
    argument left out can take its REIN_* variable, while the signature still shows vLLM's
    defaults (an explicit None counts as not given)."""

    @functools.wraps(init)
    def wrapper(self: LLM, *args: Any, **kwargs: Any) -> None:
        self._given_arguments = {name: value for name, value in kwargs.items() if value is not None}
        init(self, *args, **kwargs)

    return wrapper


class LLM:
    """An engine in this process, driven by `generate` and `chat` (as vLLM's `LLM`).

    Engine arguments use vLLM's names, the same options as the `rein run-batch` flags
    (rein.engine.options): `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`
    (None: the model's; "auto": the most the KV cache holds, which None also is on the CPU when
    the model's own does not fit), `dtype` and `kv_cache_dtype` ("auto", "float32", "float16",
    "bfloat16"; the KV cache also "int8"), `gpu_memory_utilization`, `enforce_eager`,
    `enable_prefix_caching`, `async_scheduling`, `block_size`, `seed` (for requests that give none),
    `generation_config` ("auto": the model's generation_config.json gives the sampling
    defaults, "vllm": built-in ones, or a folder), `model_impl` ("auto", "rein", "transformers":
    rein.engine.config), `tokenizer` (a tokenizer directory or hub id instead of the model's),
    `revision` and `tokenizer_revision` (hub revisions), `chat_template` (a file path or an
    inline Jinja template, replacing the tokenizer's in `chat`), `tool_call_parser` (the format
    `rein.offline.run_batch` reads tool calls from on this engine: hermes, llama3_json, mistral,
    qwen3_coder; None: the chat template's; `chat` returns text and parses none, as vLLM's),
    `trust_remote_code` (let
    transformers run the code of a model or tokenizer whose config needs it; without it such a
    model raises ValueError saying so), `enable_lora`, `max_loras`, `max_cpu_loras`, `max_lora_rank`
    (LoRA adapters, then named per prompt by `generate`'s and `chat`'s `lora_request`),
    `reasoning_parser` (checked; as in vLLM, `chat` returns the raw text, thinking included). rein's own: `device` ("auto", "cuda",
    "cuda:N", "cpu"), `kv_cache_memory` (bytes or a size such as "4GiB"; vLLM's
    `kv_cache_memory_bytes` is accepted for it), and `max_in_flight` (requests in the engine
    at once; default 4 x max_num_seqs). An engine argument not given takes its REIN_*
    variable (REIN_MAX_NUM_SEQS, ...) when set, else the default shown in the signature.
    `tensor_parallel_size` shards the model over that many processes, one device each (on CUDA
    `device` and the ones after it; rein.engine.rank_processes); `quantization` keeps a
    checkpoint's quantized weights (auto), dequantizes them (none) or quantizes a float one
    (int8, int4, int4-gN: rein.model.quant.checkpoint), and `quantized_activations="int8"` multiplies
    quantized weights on the CPU with int8 activations; `pipeline_parallel_size` must
    be 1; `disable_log_stats` is
    accepted and changes nothing. Any other vLLM argument raises
    TypeError rather than being silently ignored.
    """

    @_records_given_arguments
    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        interactive_step_budget: int | str | None = "auto",
        max_model_len: int | str | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        async_scheduling: bool = False,
        block_size: int = 16,
        seed: int = 0,
        device: str = "auto",
        kv_cache_memory: int | str | None = None,
        generation_config: str = "auto",
        model_impl: str = "auto",
        tokenizer: str | None = None,
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        chat_template: str | None = None,
        tool_call_parser: str | None = None,
        trust_remote_code: bool = False,
        max_in_flight: int | None = None,
        tensor_parallel_size: int = 1,
        quantization: str = "auto",
        quantized_activations: str = "float32",
        enable_lora: bool = False,
        max_loras: int = 8,
        max_cpu_loras: int | None = None,
        max_lora_rank: int = 16,
        reasoning_parser: str | None = None,
        max_num_encoder_tokens: int | None = None,
        encoder_cache_tokens: int = 16384,
        max_image_pixels: int = 64_000_000,
        pipeline_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        # Imported here: they import torch, which `import rein` (and the API and CLI) must not.
        from rein.engine.config import EngineConfig
        from rein.engine.engine import LLMEngine

        given = dict(self._given_arguments)   # the keywords the caller wrote (_records_given_arguments)
        if "kv_cache_memory_bytes" in kwargs:
            if kv_cache_memory is not None:
                raise TypeError("give kv_cache_memory or kv_cache_memory_bytes, not both")
            kv_cache_memory = given["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
        unsupported = sorted(set(kwargs) - _IGNORED_ARGS)
        if unsupported:
            raise TypeError(f"LLM() got arguments rein does not support: {', '.join(unsupported)}. "
                            f"It takes: {', '.join(engine_argument_names())}")
        if pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} is not supported: rein shards a "
                             f"model across devices with tensor_parallel_size; use 1")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        # A keyword given > its REIN_* variable > the default (rein.engine.options).
        config = EngineConfig(model=str(model), **resolve_engine_values(given, names=ENGINE_OPTION_NAMES))
        check_parser_names(config.reasoning_parser)   # ValueError naming the choices
        self.engine: LLMEngine = LLMEngine(config)
        self.generation_defaults = load_generation_defaults(self.engine.model_dir, config.generation_config)
        log.info("generation defaults for model %s: %s", model, self.generation_defaults.describe())
        self.max_in_flight = max_in_flight or default_max_in_flight(self.engine)
        self.request_counter = itertools.count()   # vLLM's name; request ids of generate and embed

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams holding the model's sampling defaults (`generation_config`), as
        vLLM's: what `generate` and `chat` use when given no sampling_params."""
        return self.generation_defaults.sampling_params()

    # -- generation ------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """Complete each prompt; one output per prompt, in input order.

        prompts: a string, a list of token ids (one prompt), a {"prompt": text} or
        {"prompt_token_ids": [...]} dict, or a list of any of these. sampling_params: one
        SamplingParams for all prompts, a list with one per prompt, or None (the model's
        defaults, `get_default_sampling_params()`: its generation_config.json's temperature,
        top_p, top_k, min_p and repetition_penalty, max_tokens=16). As in vLLM, a SamplingParams
        given is used as it is. lora_request (vLLM's): the LoRA adapter every prompt runs under,
        or a list with one per prompt (None: the base model); the engine needs enable_lora.
        Raises ValueError naming the first bad prompt.
        """
        items = as_prompt_list(prompts)
        prepared = [self._image_prompt(index, prompt) if isinstance(prompt, Mapping) and "multi_modal_data" in prompt
                    else read_prompt(index, prompt, self.engine.tokenizer, self.engine.spec.vocab_size)
                    for index, prompt in enumerate(items)]
        return self._run(prepared, sampling_params, use_tqdm, "prompt", lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[GenerationOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        Each is rendered with the model's chat template and a generation prompt, exactly as
        rein's /v1/chat/completions renders `messages`. lora_request: as `generate`'s. Raises
        ValueError naming the first bad conversation.
        """
        conversations = [messages] if is_conversation(messages) else list(messages)
        tokenizer, max_model_len = self.engine.tokenizer, self.engine.max_model_len
        prepared = []
        for index, conversation in enumerate(conversations):
            if not isinstance(conversation, Sequence) or isinstance(conversation, (str, bytes)):
                raise ValueError(f"conversation {index}: expected a list of {{'role', 'content'}} dicts, "
                                 f"got {type(conversation).__name__}")
            try:
                conversation, images = image_parts(list(conversation))
            except ImageError as exc:
                raise ValueError(f"conversation {index}: {exc.message}") from exc
            if images:
                prepared.append(self._vision_chat(index, conversation, images))
                continue
            try:
                token_ids = chat_prompt({"messages": list(conversation)}, tokenizer, max_model_len)
            except RequestError as exc:
                raise ValueError(f"conversation {index}: {exc.message}") from exc
            text = tokenizer.decode(token_ids, skip_special_tokens=False)
            prepared.append(checked_prompt(index, Prompt(text, token_ids), self.engine.spec.vocab_size,
                                           "conversation"))
        return self._run(prepared, sampling_params, use_tqdm, "conversation", lora_request)

    def _image_prompt(self, index: int, prompt: Mapping[str, Any]) -> Prompt:
        """vLLM's {"prompt": text, "multi_modal_data": {"image": PIL image or list}}: the text holds
        the model's image placeholder once per image; expanded by the model's processor."""
        data = prompt["multi_modal_data"]
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            raise ValueError(f"prompt {index}: multi_modal_data takes {{'image': a PIL image or a list of them}}")
        images = data.get("image") or []
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if not isinstance(prompt.get("prompt"), str):
            raise ValueError(f"prompt {index}: a prompt with multi_modal_data needs its 'prompt' as text")
        inputs = [ImageInput.of(_png(image)) for image in images]
        return self._expanded(index, prompt["prompt"], inputs, "prompt")

    def _vision_chat(self, index: int, conversation: list[Any], images: list[ImageInput]) -> Prompt:
        """A conversation with image parts: the chat template writes a placeholder per image, the
        processor expands them (rein.model.vision.processor)."""
        tokenizer = self.engine.tokenizer
        try:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template may raise anything
            raise ValueError(f"conversation {index}: the model's chat template rejected the messages: {exc}") from exc
        return self._expanded(index, text, images, "conversation")

    def _expanded(self, index: int, text: str, images: list[ImageInput], what: str) -> Prompt:
        processor = self.engine.vision_processor
        if processor is None:
            raise ValueError(f"{what} {index}: this model takes text only; images need a vision model")
        try:
            opened = [open_image(image.data, max_pixels=self.engine.max_image_pixels) for image in images]
            expanded = processor.expand(text, opened, [image.detail for image in images])
        except ImageError as exc:
            raise ValueError(f"{what} {index}: {exc.message}") from exc
        return checked_prompt(index, Prompt(text, expanded.token_ids, images), self.engine.spec.vocab_size, what)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed each prompt (vLLM's `LLM.embed`); one output per prompt, in input order, the
        vector in `.outputs.embedding`.

        Prompts are given as to `generate` (text is encoded with the tokenizer's special tokens).
        The model's sentence-transformers files say how it pools (last token, normalized, by
        default); `pooling_params` (one for all, or one per prompt) may ask for fewer
        `dimensions` (Matryoshka models) or `normalize=False`. Raises ValueError naming the
        first bad prompt.
        """
        return embed(self, prompts, pooling_params, use_tqdm)

    def _params_for(self, prompts: list[Prompt], sampling_params: Any, what: str) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} {what}s: give one "
                                 f"for all or one per {what}")
            for index, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got {type(p).__name__}")
        limit = self.engine.max_model_len
        for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            if not fits_context(len(prompt.token_ids), p.max_tokens, limit):
                needed = len(prompt.token_ids) + p.max_tokens
                raise ValueError(
                    f"{what} {index} is too long for the context: {len(prompt.token_ids)} prompt tokens + "
                    f"max_tokens {p.max_tokens} = {needed} tokens, but max_model_len is {limit}. Shorten the "
                    f"{what}, lower max_tokens, or raise max_model_len (up to the model's own limit).")
        return params

    # -- the run ---------------------------------------------------------------------------

    @staticmethod
    def _adapters_for(prompts: list[Prompt], lora_request: Any, what: str) -> list[LoRARequest | None]:
        """One LoRARequest (or None) per prompt: `lora_request` for all, or its list, one per prompt."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * len(prompts)
        if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
            raise TypeError(f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}")
        adapters = list(lora_request)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} LoRA requests for {len(prompts)} {what}s: give one "
                             f"for all or one per {what}")
        for index, adapter in enumerate(adapters):
            if adapter is not None and not isinstance(adapter, LoRARequest):
                raise TypeError(f"lora_request[{index}] must be a LoRARequest or None, got {type(adapter).__name__}")
        return adapters

    def _run(self, prompts: list[Prompt], sampling_params: Any, use_tqdm: bool | Callable[..., tqdm],
             what: str, lora_request: Any = None) -> list[GenerationOutput]:
        params = self._params_for(prompts, sampling_params, what)
        adapters = self._adapters_for(prompts, lora_request, what)
        if not prompts:
            return []
        results: list[GenerationOutput | None] = [None] * len(prompts)
        progress = use_tqdm if callable(use_tqdm) else tqdm
        texts = TokenTexts(self.engine.tokenizer)
        totals = {"in": 0, "out": 0}
        started = time.perf_counter()

        def admit(index: int) -> tuple[str, int] | None:
            request_id = str(next(self.request_counter))
            try:
                self.engine.add_request(request_id, prompts[index].token_ids, params[index],
                                        lora_request=adapters[index], images=prompts[index].images)
            except EngineRequestError as exc:
                if exc.param == "lora_request":   # its adapter: this prompt fails, the others run
                    fail(index, request_id, exc.message)
                    return None
                raise ValueError(f"{what} {index}: {exc}") from exc   # the checks above should have caught it
            return request_id, index

        def fail(index: int, request_id: str, error: str) -> None:
            log.warning("%s %d failed: %s", what, index, error)
            prompt = prompts[index]
            results[index] = GenerationOutput(
                request_id=request_id, prompt=prompt.text, prompt_token_ids=prompt.token_ids,
                outputs=[CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                          finish_reason="abort")], error=error)
            bar.update(1)

        def finish(done: RequestResult) -> None:
            index = done.state
            prompt = prompts[index]
            prompt_logprobs = None
            if params[index].prompt_logprobs is not None:
                entries = done.prompt_logprobs or [None] * len(prompt.token_ids)
                prompt_logprobs = [None if entry is None else logprob_dict(entry, texts)
                                   for entry in entries]
            results[index] = GenerationOutput(
                request_id=done.request_id, prompt=prompt.text, prompt_token_ids=prompt.token_ids,
                outputs=[completion_output(choice, params[index], texts) for choice in done.ordered()],
                num_cached_tokens=done.num_cached_tokens, prompt_logprobs=prompt_logprobs,
                error=done.final.error if done.final is not None else None)
            totals["in"] += len(prompt.token_ids)
            totals["out"] += done.completion_tokens
            elapsed = max(time.perf_counter() - started, 1e-9)
            bar.set_postfix_str(f"est. speed input: {totals['in'] / elapsed:.2f} toks/s, "
                                f"output: {totals['out'] / elapsed:.2f} toks/s", refresh=False)
            bar.update(1)

        with progress(total=len(prompts), desc="Processed prompts", unit="prompt", file=sys.stderr,
                      dynamic_ncols=True, disable=not use_tqdm) as bar:
            drive(self.engine, range(len(prompts)), admit, finish, self.max_in_flight)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"the engine returned no output for {what}s {missing} (engine bug)")
        return results  # type: ignore[return-value]


def _png(image: Any) -> bytes:
    """A PIL image as PNG bytes (how an image travels to the engine: rein.core.images.ImageInput)."""
    import io

    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    if not hasattr(image, "save"):
        raise ValueError(f"multi_modal_data images must be PIL images or encoded bytes, got {type(image).__name__}")
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def engine_argument_names() -> list[str]:
    """The keyword arguments `LLM()` takes (for error messages and tests)."""
    names = [p.name for p in inspect.signature(LLM.__init__).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return names + ["kv_cache_memory_bytes", *sorted(_IGNORED_ARGS)]
