"""Per-request generation settings, validated where they are built.

The field names and ranges follow the OpenAI API (and vLLM where OpenAI is silent),
so a request body maps onto them one to one. Errors name the parameter, the limit and
the value, so the API layer can pass them straight to the user.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 128                 # OpenAI's limit on choices per request
MAX_LOGIT_BIAS = 100.0      # OpenAI's range for a logit_bias value: -100..100
STRUCTURED_TYPES = ("json_schema", "json_object", "regex", "choice", "grammar")


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_max_tokens(value: int, name: str = "max_tokens") -> None:
    """SamplingParamsError unless `value` is at least 1: the one check of a completion's token
    budget, SamplingParams' and the wire format's (`name`: max_tokens or max_completion_tokens)."""
    if value < 1:
        raise SamplingParamsError(name, f"{name} must be at least 1, got {value}")


def fits_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """Whether a prompt of `prompt_tokens` and a completion of up to `max_tokens` fit in a context
    of `max_model_len` tokens: the one rule. Each caller words its own refusal: the wire format's
    context_length_exceeded when a request is parsed (rein.openai.request), `rein.LLM`'s ValueError
    naming the prompt before any prompt runs, the engine's ContextLengthExceeded when a request is
    added."""
    return prompt_tokens + max_tokens <= max_model_len


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy. top_k == 0 (or -1) disables top-k. `logprobs` is the
    number of top alternatives to return per token (None: no logprobs at all; 0: only the
    chosen token's logprob); `prompt_logprobs` the same for every prompt token (vLLM's).

    `n` choices share one prefill; choice i samples with seed `seed + i`. `logit_bias`
    maps token ids to a bias added to their logits (-100 bans, 100 forces); `min_tokens`
    holds back EOS and the stop token ids until that many tokens are out. `structured`
    constrains the output to a grammar: {"type": "json_schema", "schema": {...}},
    {"type": "json_object"}, {"type": "regex", "pattern": str}, {"type": "choice",
    "choices": [str, ...]} or {"type": "grammar", "grammar": str} (plain JSON, so it
    travels in the queue message as it is). `structured_after_token_id`: a reasoning model's
    end-of-think token; the constraint applies only to the tokens after it (vLLM's structured
    outputs with a reasoning parser), None: from the first token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    structured: dict | None = None
    structured_after_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        check_max_tokens(self.max_tokens)
        self._check(0.0 <= self.temperature <= 2.0, "temperature",
                    f"temperature must be between 0 and 2, got {self.temperature}")
        self._check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        self._check(self.top_k >= 0, "top_k", f"top_k must be 0 or -1 (disabled) or positive, got {self.top_k}")
        self._check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be between 0 and 1, got {self.min_p}")
        self._check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
                    f"presence_penalty must be between -2 and 2, got {self.presence_penalty}")
        self._check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
                    f"frequency_penalty must be between -2 and 2, got {self.frequency_penalty}")
        self._check(self.repetition_penalty > 0.0, "repetition_penalty",
                    f"repetition_penalty must be greater than 0, got {self.repetition_penalty}")
        if self.logprobs is not None:
            self._check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                        f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self._check(0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                        f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        self._check(1 <= self.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}, got {self.n}")
        self._check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                    f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias:
            # JSON object keys are strings: a bias map that went through a queue message
            # comes back with "123" keys.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise SamplingParamsError("logit_bias", "logit_bias maps token ids to numbers") from None
            bad = next((v for v in self.logit_bias.values() if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS), None)
            self._check(bad is None, "logit_bias",
                        f"logit_bias values must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bad}")
        else:
            self.logit_bias = None
        if self.structured is not None:
            kind = self.structured.get("type") if isinstance(self.structured, dict) else None
            self._check(kind in STRUCTURED_TYPES, "structured",
                        f"structured must be an object whose type is one of {', '.join(STRUCTURED_TYPES)}, "
                        f"got {self.structured!r:.80}")
        self._check(len(self.stop) <= 4, "stop", f"at most 4 stop sequences are allowed, got {len(self.stop)}")
        self._check(all(isinstance(s, str) and s for s in self.stop), "stop",
                    "stop sequences must be non-empty strings")

    @staticmethod
    def _check(ok: bool, param: str, message: str) -> None:
        if not ok:
            raise SamplingParamsError(param, message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
