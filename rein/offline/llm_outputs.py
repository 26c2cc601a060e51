"""The results `rein.LLM.generate` and `chat` return, in vLLM's shapes, and their making from the
engine's choices and logprob entries.

Output classes. vLLM calls the per-prompt result `RequestOutput`; rein's engine already
has a `rein.engine.step_outputs.RequestOutput` (one step's delta of one request). So the class
here is `GenerationOutput`, and `rein.RequestOutput` is an alias of it for code ported from
`from vllm import RequestOutput`; inside rein, `RequestOutput` by its module path is still
the engine's delta. `CompletionOutput` and `Logprob` follow vLLM's fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rein.engine.request_result import Choice
    from rein.engine.sampling_params import SamplingParams
    from rein.engine.step_outputs import TokenLogprob


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
    the prompt token and the top k alternatives; None when not asked for. `error` (rein's own):
    why the engine did not run or finish this prompt's request for a fault of its own (a LoRA
    adapter that could not be loaded, a grammar that did not compile), else None; its outputs
    then end with finish_reason "abort".
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None


class TokenTexts:
    """Each token id's text, decoded once per run: the same alternatives recur in many entries."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]


def completion_output(choice: Choice, params: SamplingParams, texts: TokenTexts) -> CompletionOutput:
    """One choice of the engine's result as vLLM's CompletionOutput (logprobs only when asked for)."""
    logprobs = cumulative = None
    if params.logprobs is not None:
        logprobs = [logprob_dict(entry, texts) for entry in choice.logprobs]
        cumulative = choice.cumulative_logprob
    return CompletionOutput(index=choice.index, text=choice.text, token_ids=choice.token_ids,
                            cumulative_logprob=cumulative, logprobs=logprobs, finish_reason=choice.finish_reason,
                            stop_reason=choice.stop_reason)


def logprob_dict(entry: TokenLogprob, texts: TokenTexts) -> dict[int, Logprob]:
    """One token's entry as vLLM's {token id: Logprob}: the chosen token first, then its alternatives."""
    ranks = {token_id: rank for rank, (token_id, _) in enumerate(entry.top, start=1)}
    out = {entry.token_id: Logprob(entry.logprob, ranks.get(entry.token_id), texts(entry.token_id))}
    for token_id, logprob in entry.top:
        if token_id not in out:
            out[token_id] = Logprob(logprob, ranks[token_id], texts(token_id))
    return out
