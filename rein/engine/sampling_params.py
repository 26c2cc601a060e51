"""Per-request generation settings, validated where they are built.

The field names and ranges follow the OpenAI API (and vLLM where OpenAI is silent),
so a request body maps onto them one to one. Errors name the parameter, the limit and
the value, so the API layer can pass them straight to the user.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature == 0 means greedy. top_k == 0 (or -1) disables top-k. `logprobs` is the
    number of top alternatives to return per token (None: no logprobs at all; 0: only the
    chosen token's logprob).
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._check(self.max_tokens >= 1, "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
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
