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

Output classes. vLLM calls the per-prompt result `RequestOutput`; rein's engine already
has a `rein.engine.outputs.RequestOutput` (one step's delta of one request). So the class
here is `GenerationOutput`, and `rein.RequestOutput` is an alias of it for code ported from
`from vllm import RequestOutput`; inside rein, `RequestOutput` by its module path is still
the engine's delta. `CompletionOutput` and `Logprob` follow vLLM's fields.

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
* No beam search, best_of, LoRA or multimodal inputs.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import numbers
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from rein.engine.errors import EngineRequestError
from rein.engine.results import Choice, RequestResult
from rein.engine.sampling_params import SamplingParams
from rein.offline.driver import default_max_in_flight, drive
from rein.openai.errors import RequestError
from rein.openai.prompts import chat_prompt

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.engine.outputs import TokenLogprob
    from rein.engine.pooling_config import PoolingParams
    from rein.offline.embed import EmbeddingRequestOutput

# One prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
PromptType = str | Sequence[int] | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]

log = logging.getLogger(__name__)

# vLLM arguments rein accepts but that change nothing here (rein runs no model code from the hub).
_IGNORED_ARGS = frozenset({"trust_remote_code", "disable_log_stats"})


def _records_given_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Keeps the keywords a caller actually gave (as `self._given_arguments`) so that an
    argument left out can take its REIN_* variable, while the signature still shows vLLM's
    defaults (an explicit None counts as not given)."""

    @functools.wraps(init)
    def wrapper(self: LLM, *args: Any, **kwargs: Any) -> None:
        self._given_arguments = {name: value for name, value in kwargs.items() if value is not None}
        init(self, *args, **kwargs)

    return wrapper


@dataclass
class Logprob:
    """One token's log-probability, as vLLM's `Logprob`."""

    logprob: float
    rank: int | None = None             # 1 = most likely; None when not among the returned top tokens
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """The generated completion of one prompt (vLLM's `CompletionOutput`).

    `logprobs` is None unless the request's SamplingParams asked for them (`logprobs=k`);
    then it holds one dict per generated token, mapping token id -> `Logprob`: the chosen
    token first, then the top k alternatives (the chosen one appears once).
    `cumulative_logprob` is the sum of the chosen tokens' logprobs (None without logprobs).
    `finish_reason` is "stop" (end of sequence, stop string or stop token) or "length"
    (max_tokens or the context's end); "abort" only if the request was aborted from
    outside. `stop_reason` is the stop string or stop token id that matched, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class GenerationOutput:
    """The result for one prompt (vLLM's `RequestOutput`; exported as `rein.RequestOutput` too).

    `prompt` is the text when the prompt was given as text, the rendered chat template
    (decoded) for `chat`, and None for token-id prompts. `outputs` holds one
    `CompletionOutput` per choice (SamplingParams.n), by index. `num_cached_tokens` counts
    prompt tokens taken from the prefix cache. `prompt_logprobs` (SamplingParams.prompt_logprobs
    = k): one entry per prompt token, None for the first, else {token id: Logprob} holding
    the prompt token and the top k alternatives; None when not asked for.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


class LLM:
    """An engine in this process, driven by `generate` and `chat` (as vLLM's `LLM`).

    Engine arguments use vLLM's names, the same options as the `rein run-batch` flags
    (rein.engine.options): `max_num_seqs`, `max_num_batched_tokens`, `max_model_len`
    (None: the model's), `dtype` and `kv_cache_dtype` ("auto", "float32", "float16",
    "bfloat16"; the KV cache also "int8"), `gpu_memory_utilization`, `enforce_eager`,
    `enable_prefix_caching`, `block_size`, `seed` (for requests that give none),
    `generation_config` ("auto": the model's generation_config.json gives the sampling
    defaults, "vllm": built-in ones, or a folder). rein's own: `device` ("auto", "cuda",
    "cuda:N", "cpu"), `kv_cache_memory` (bytes or a size such as "4GiB"; vLLM's
    `kv_cache_memory_bytes` is accepted for it), and `max_in_flight` (requests in the engine
    at once; default 4 x max_num_seqs). An engine argument not given takes its REIN_*
    variable (REIN_MAX_NUM_SEQS, ...) when set, else the default shown in the signature.
    `tensor_parallel_size` and `pipeline_parallel_size` must be 1; `trust_remote_code` and
    `disable_log_stats` are accepted and change nothing. Any other vLLM argument raises
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
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        seed: int = 0,
        device: str = "auto",
        kv_cache_memory: int | str | None = None,
        generation_config: str = "auto",
        max_in_flight: int | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        from rein.engine.config import EngineConfig
        from rein.engine.engine import LLMEngine
        from rein.engine.generation_defaults import load_generation_defaults
        from rein.engine.options import ENGINE_OPTION_NAMES, resolve_engine_values

        given = dict(self._given_arguments)   # the keywords the caller wrote (_records_given_arguments)
        if "kv_cache_memory_bytes" in kwargs:
            if kv_cache_memory is not None:
                raise TypeError("give kv_cache_memory or kv_cache_memory_bytes, not both")
            kv_cache_memory = given["kv_cache_memory"] = kwargs.pop("kv_cache_memory_bytes")
        unsupported = sorted(set(kwargs) - _IGNORED_ARGS)
        if unsupported:
            raise TypeError(f"LLM() got arguments rein does not support: {', '.join(unsupported)}. "
                            f"It takes: {', '.join(engine_argument_names())}")
        for name, value in (("tensor_parallel_size", tensor_parallel_size),
                            ("pipeline_parallel_size", pipeline_parallel_size)):
            if value != 1:
                raise ValueError(f"{name}={value} is not supported: rein runs a model on one device; use 1")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        # A keyword given > its REIN_* variable > the default (rein.engine.options).
        config = EngineConfig(model=str(model), **resolve_engine_values(given, names=ENGINE_OPTION_NAMES))
        self.engine: LLMEngine = LLMEngine(config)
        self.generation_defaults = load_generation_defaults(self.engine.model_dir, config.generation_config)
        log.info("generation defaults for model %s: %s", model, self.generation_defaults.describe())
        self.max_in_flight = max_in_flight or default_max_in_flight(self.engine)
        self._request_counter = itertools.count()

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
    ) -> list[GenerationOutput]:
        """Complete each prompt; one output per prompt, in input order.

        prompts: a string, a list of token ids (one prompt), a {"prompt": text} or
        {"prompt_token_ids": [...]} dict, or a list of any of these. sampling_params: one
        SamplingParams for all prompts, a list with one per prompt, or None (the model's
        defaults, `get_default_sampling_params()`: its generation_config.json's temperature,
        top_p, top_k, min_p and repetition_penalty, max_tokens=16). As in vLLM, a SamplingParams
        given is used as it is. Raises ValueError naming the first bad prompt.
        """
        items = _as_prompt_list(prompts)
        prepared = [self._prepare(index, prompt) for index, prompt in enumerate(items)]
        return self._run(prepared, sampling_params, use_tqdm, "prompt")

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
    ) -> list[GenerationOutput]:
        """Answer one conversation (a list of {"role", "content"} dicts) or a list of them.

        Each is rendered with the model's chat template and a generation prompt, exactly as
        rein's /v1/chat/completions renders `messages`. Raises ValueError naming the first
        bad conversation.
        """
        conversations = [messages] if _is_conversation(messages) else list(messages)
        tokenizer, max_model_len = self.engine.tokenizer, self.engine.max_model_len
        prepared = []
        for index, conversation in enumerate(conversations):
            if not isinstance(conversation, Sequence) or isinstance(conversation, (str, bytes)):
                raise ValueError(f"conversation {index}: expected a list of {{'role', 'content'}} dicts, "
                                 f"got {type(conversation).__name__}")
            try:
                token_ids = chat_prompt({"messages": list(conversation)}, tokenizer, max_model_len)
            except RequestError as exc:
                raise ValueError(f"conversation {index}: {exc.message}") from exc
            text = tokenizer.decode(token_ids, skip_special_tokens=False)
            prepared.append(self._checked(index, _Prompt(text, token_ids), "conversation"))
        return self._run(prepared, sampling_params, use_tqdm, "conversation")

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
        from rein.offline.embed import embed

        return embed(self, prompts, pooling_params, use_tqdm)

    # -- prompts ---------------------------------------------------------------------------

    def _prepare(self, index: int, prompt: PromptType) -> _Prompt:
        if isinstance(prompt, Mapping):
            extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
            if extra:
                raise ValueError(f"prompt {index}: unsupported keys {extra}; a prompt dict holds 'prompt' "
                                 f"(text) or 'prompt_token_ids'")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(f"prompt {index}: 'prompt' must be text, got {type(prompt).__name__}")
            else:
                raise ValueError(f"prompt {index}: a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:   # refused whatever the tokenizer adds (a BOS): it asks for nothing
                raise ValueError(f"prompt {index}: the prompt is empty: give at least one character or token")
            found = _Prompt(prompt, list(self.engine.tokenizer.encode(prompt, add_special_tokens=True)))
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            bad = next((t for t in prompt if not _is_int(t)), None)
            if bad is not None:
                raise ValueError(f"prompt {index}: token ids must be integers, got {bad!r}")
            found = _Prompt(None, [int(t) for t in prompt])
        else:
            raise ValueError(f"prompt {index}: expected text, a list of token ids or a prompt dict, "
                             f"got {type(prompt).__name__}")
        return self._checked(index, found, "prompt")

    def _checked(self, index: int, prompt: _Prompt, what: str) -> _Prompt:
        """The checks `LLMEngine.add_request` would make later, made now so nothing has run."""
        if not prompt.token_ids:
            raise ValueError(f"{what} {index}: the prompt is empty: give at least one token")
        vocab = self.engine.spec.vocab_size
        for position, token_id in enumerate(prompt.token_ids):
            if not 0 <= token_id < vocab:
                raise ValueError(f"{what} {index}: token id {token_id} (at position {position}) is outside "
                                 f"the vocabulary: ids run from 0 to {vocab - 1}")
        return prompt

    def _params_for(self, prompts: list[_Prompt], sampling_params: Any, what: str) -> list[SamplingParams]:
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
            needed = len(prompt.token_ids) + p.max_tokens
            if needed > limit:
                raise ValueError(
                    f"{what} {index} is too long for the context: {len(prompt.token_ids)} prompt tokens + "
                    f"max_tokens {p.max_tokens} = {needed} tokens, but max_model_len is {limit}. Shorten the "
                    f"{what}, lower max_tokens, or raise max_model_len (up to the model's own limit).")
        return params

    # -- the run ---------------------------------------------------------------------------

    def _run(self, prompts: list[_Prompt], sampling_params: Any, use_tqdm: bool | Callable[..., tqdm],
             what: str) -> list[GenerationOutput]:
        params = self._params_for(prompts, sampling_params, what)
        if not prompts:
            return []
        results: list[GenerationOutput | None] = [None] * len(prompts)
        progress = use_tqdm if callable(use_tqdm) else tqdm
        decoded: dict[int, str] = {}
        totals = {"in": 0, "out": 0}
        started = time.perf_counter()

        def admit(index: int) -> tuple[str, int]:
            request_id = str(next(self._request_counter))
            try:
                self.engine.add_request(request_id, prompts[index].token_ids, params[index])
            except EngineRequestError as exc:   # the checks above should have caught it
                raise ValueError(f"{what} {index}: {exc}") from exc
            return request_id, index

        def finish(done: RequestResult) -> None:
            index = done.state
            prompt = prompts[index]
            prompt_logprobs = None
            if params[index].prompt_logprobs is not None:
                entries = done.prompt_logprobs or [None] * len(prompt.token_ids)
                prompt_logprobs = [None if entry is None else self._logprob_dict(entry, decoded)
                                   for entry in entries]
            results[index] = GenerationOutput(
                request_id=done.request_id, prompt=prompt.text, prompt_token_ids=prompt.token_ids,
                outputs=[self._completion(choice, params[index], decoded) for choice in done.ordered()],
                num_cached_tokens=done.num_cached_tokens, prompt_logprobs=prompt_logprobs)
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

    def _completion(self, choice: Choice, params: SamplingParams, decoded: dict[int, str]) -> CompletionOutput:
        logprobs = cumulative = None
        if params.logprobs is not None:
            logprobs = [self._logprob_dict(entry, decoded) for entry in choice.logprobs]
            cumulative = choice.cumulative_logprob
        return CompletionOutput(index=choice.index, text=choice.text, token_ids=choice.token_ids,
                                cumulative_logprob=cumulative, logprobs=logprobs, finish_reason=choice.finish_reason,
                                stop_reason=choice.stop_reason)

    def _logprob_dict(self, entry: TokenLogprob, decoded: dict[int, str]) -> dict[int, Logprob]:
        def text(token_id: int) -> str:
            if token_id not in decoded:
                decoded[token_id] = self.engine.tokenizer.decode([token_id])
            return decoded[token_id]

        ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, start=1)}
        out = {entry.token_id: Logprob(entry.logprob, ranks.get(entry.token_id), text(entry.token_id))}
        for token_id, logprob in entry.top:
            if token_id not in out:
                out[token_id] = Logprob(logprob, ranks[token_id], text(token_id))
        return out


def engine_argument_names() -> list[str]:
    """The keyword arguments `LLM()` takes (for error messages and tests)."""
    names = [p.name for p in inspect.signature(LLM.__init__).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return names + ["kv_cache_memory_bytes", *sorted(_IGNORED_ARGS)]


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt or a list of them -> a list (a list of ints is one prompt of token ids)."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(f"prompts must be text, token ids, a prompt dict or a list of these, "
                         f"got {type(prompts).__name__}")
    if prompts and all(_is_int(t) for t in prompts):
        return [prompts]
    return list(prompts)


def _is_conversation(messages: Any) -> bool:
    return isinstance(messages, Sequence) and bool(messages) and isinstance(messages[0], Mapping)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)

