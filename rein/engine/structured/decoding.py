"""The engine's side of structured outputs (`engine.grammars`): grammars per request, held
requests, and the token masks of every step.

The engine calls, in order of a request's life:

* `attach(request)` in add_request: starts the spec's check and compile if no one has
  (both on the grammar cache's threads: the check, the memoized one of
  rein.engine.structured.spec, may wait for a validator process to start, and the step
  thread never waits for it), and gives the request its own matcher when they are done
  (True; a spec that failed either raises EngineRequestError naming `structured`).
  Otherwise (False) the request is *held* here, out of the scheduler, so no step ever
  samples it without its mask; a held request whose spec fails is ended by `release`.
  The worker's task thread (`prepare_grammar`) and the offline drivers start both before
  the request reaches the engine, so a bad spec is usually refused by add_request itself.
* `release(idle)` at the start of every step that has held requests: the requests whose
  grammar finished compiling, to hand to the scheduler, and those whose compile failed
  (to end as aborted). With nothing else to do (`idle`) it waits briefly for a compile
  instead of letting the engine spin.
* `apply_masks(logits, sampling)` between the forward and the sampler: fills the bitmask
  of every constrained row (llguidance, in parallel when several) and applies it to those
  rows only (rein.engine.structured.kernels).
* `request.grammar.accept(token)` after sampling: advances the matcher; True means the
  request must end now, with finish_reason "stop": the grammar is complete (an EOS token,
  or a document after which nothing may follow), or the token was refused (see below).

EOS is allowed only where the grammar may end (the cache builds llguidance's tokenizer
with the engine's EOS ids). Token ids past the tokenizer's vocabulary (embedding rows the
model pads its vocabulary with) are never allowed.

Preemption keeps a request's output tokens and recomputes their KV; nothing is sampled
again for them, so the matcher's state stays that of the output so far.

For n > 1, every choice needs its own matcher: `RequestGrammar.fork()` copies one in its
current state (at the fork, the start of the grammar), and `new_matcher(spec)` makes a
fresh one from a compiled spec.

A refused token can only come from a row whose mask left nothing to sample (every
allowed token also banned by another rule of the request, such as min_tokens banning the
EOS that is the only thing the grammar allows); the request then ends there, logged.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from rein.engine.errors import CheckTimedOut, EngineRequestError, StructuredSpecError
from rein.engine.structured.cache import (
    CompiledGrammar,
    GrammarCache,
    GrammarCheckUnavailable,
    GrammarError,
)
from rein.engine.structured.kernels import apply_token_bitmask
from rein.engine.structured.spec import check_spec
from rein.engine.structured.validator import ValidatorUnavailable

if TYPE_CHECKING:
    from rein.engine.request import Request

log = logging.getLogger(__name__)

# How long an engine with only held requests waits for one compile before stepping again.
IDLE_WAIT_SECONDS = 0.05


GRAMMAR_WAIT_SECONDS = 60.0
# A request held for its grammar this long is ended: a compile that passed the validator's
# deadline (rein.engine.structured.validator) may still be slower here, where it builds the lexer for
# the model's tokenizer.
COMPILE_DEADLINE_SECONDS = 120.0


def prepare_grammar(engine: Any, params: Any, timeout: float = GRAMMAR_WAIT_SECONDS) -> None:
    """Check and compile `params.structured` for `engine` (an LLMEngine, or an EngineClient
    whose engine it is) on the calling thread's time (the worker's task thread, before it
    submits the request), so the engine's thread finds it ready. Problems are left for add_request to report (it raises EngineRequestError for a
    bad spec; a compile still running after `timeout` just holds the request a while)."""
    spec = getattr(params, "structured", None)
    grammars = getattr(getattr(engine, "engine", engine), "grammars", None)
    if spec is None or grammars is None:   # None: an engine in another process compiles its own
        return
    try:
        grammars.prefetch(spec).result(timeout)   # the check, then the compile
    except Exception:  # noqa: BLE001 - reported by add_request, with the request's context
        return


def check_before_compile(spec: dict[str, Any]) -> None:
    """The engine's check of a spec (rein.engine.structured.spec.check_spec, in a validator
    process), run on a grammar-cache thread before the compile: a spec that would crash the
    compiler in this process stops here. GrammarError with the reason."""
    try:
        check_spec(spec, "structured")
    except CheckTimedOut as exc:
        raise GrammarCheckUnavailable(exc.message) from None
    except StructuredSpecError as exc:
        raise GrammarError(exc.message) from None
    except ValidatorUnavailable as exc:
        raise GrammarCheckUnavailable(f"the structured-output constraint could not be checked: {exc}") from None


class GrammarNotReady(RuntimeError):
    """new_matcher was asked for a spec whose compile has not finished."""


class RequestGrammar:
    """One request's (or one choice's) position in its grammar.

    `waits_for`: a reasoning model's end-of-think token (SamplingParams.structured_after_token_id):
    until it is sampled the grammar is inactive (no mask, nothing consumed), so the thinking is
    free and the constraint applies to the answer after it, as vLLM's reasoning-aware structured
    outputs. None: active from the first token."""

    __slots__ = ("matcher", "spec", "waits_for")

    def __init__(self, matcher: Any, spec: dict[str, Any], waits_for: int | None = None) -> None:
        self.matcher = matcher
        self.spec = spec
        self.waits_for = waits_for

    @property
    def active(self) -> bool:
        """Whether this step's token is constrained (the thinking, if any, is over)."""
        return self.waits_for is None

    def accept(self, token: int) -> bool:
        """Advance past the sampled `token`; True when the request must end here."""
        if self.waits_for is not None:
            if token == self.waits_for:
                self.waits_for = None   # the thinking ended: the grammar applies from the next token
            return False
        matcher = self.matcher
        if not matcher.consume_token(token):
            log.warning("structured output: token %d is not allowed by the grammar (%s); ending the request",
                        token, matcher.get_error())
            return True
        return matcher.is_stopped()

    @property
    def is_complete(self) -> bool:
        """Whether the output so far is a whole document of the grammar (EOS allowed here)."""
        return self.matcher.is_accepting()

    def fork(self) -> RequestGrammar:
        """An independent copy in the same state (an n > 1 choice's own matcher)."""
        return RequestGrammar(self.matcher.deep_copy(), self.spec, self.waits_for)


class StructuredDecoding:
    """See the module docstring. `vocab_size` is the model's (logits columns)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int] | set[int],
                 device: torch.device | str = "cpu", max_entries: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        kwargs = {} if max_entries is None else {"max_entries": max_entries}
        self.cache = GrammarCache(tokenizer, vocab_size, sorted(eos_token_ids), check=check_before_compile, **kwargs)
        self.words = (vocab_size + 31) // 32
        self._held: dict[str, tuple[Request, Future[CompiledGrammar], float]] = {}
        self._bitmask = torch.empty((0, self.words), dtype=torch.int32)
        self._executor: Any = None

    # -- specs and matchers ----------------------------------------------------------------

    def prefetch(self, spec: dict[str, Any]) -> Future[CompiledGrammar]:
        """Start compiling `spec` (any thread); see GrammarCache.prefetch."""
        return self.cache.prefetch(spec)

    def ready(self, spec: dict[str, Any]) -> bool:
        return self.cache.ready(spec)

    def new_matcher(self, spec: dict[str, Any]) -> RequestGrammar:
        """A fresh matcher for a compiled spec; GrammarNotReady while it compiles,
        EngineRequestError if it failed to compile."""
        future = self.cache.prefetch(spec)
        if not future.done():
            raise GrammarNotReady("the grammar of this structured spec is still compiling")
        return self._matcher(future, spec)

    def _matcher(self, future: Future[CompiledGrammar], spec: dict[str, Any],
                 waits_for: int | None = None) -> RequestGrammar:
        try:
            compiled = future.result()
        except GrammarError as exc:
            raise EngineRequestError(str(exc), param="structured") from None
        return RequestGrammar(compiled.matcher(), spec, waits_for)

    # -- requests --------------------------------------------------------------------------

    def attach(self, request: Request) -> bool:
        """Give `request` its matcher now (True), or hold it until its grammar compiles (False)."""
        spec = request.sampling_params.structured
        future = self.cache.prefetch(spec)   # checked first, on the cache's thread (check_before_compile)
        if future.done():
            request.grammar = self._matcher(future, spec, request.sampling_params.structured_after_token_id)
            return True
        self._held[request.request_id] = (request, future, time.monotonic())
        return False

    @property
    def has_held(self) -> bool:
        return bool(self._held)

    def release(self, idle: bool = False) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Held requests whose compile is done: (ready ones, now holding their matcher;
        failed ones with the reason). `idle`: wait up to IDLE_WAIT_SECONDS for one.
        A failed request stays held until the caller ends it (`unhold`): it never reached
        the scheduler, so the scheduler must not be asked to end it."""
        if idle and not any(f.done() for _, f, _ in self._held.values()):
            self.cache.wait_any([f for _, f, _ in self._held.values()], IDLE_WAIT_SECONDS)
        ready, failed = [], []
        now = time.monotonic()
        for request_id, (request, future, held_at) in list(self._held.items()):
            if not future.done():
                if now - held_at > COMPILE_DEADLINE_SECONDS:
                    # The compile thread cannot be stopped; the request need not wait for it.
                    reason = (f"its structured-output grammar did not compile within {COMPILE_DEADLINE_SECONDS:g} s; "
                              f"make it simpler")
                    log.error("request %s: %s", request_id, reason)
                    failed.append((request, reason))
                continue
            try:
                params = request.sampling_params
                request.grammar = self._matcher(future, params.structured, params.structured_after_token_id)
            except EngineRequestError as exc:
                log.error("request %s: %s", request_id, exc)
                failed.append((request, str(exc)))
                continue
            del self._held[request_id]
            ready.append(request)
        return ready, failed

    def unhold(self, request: Request) -> bool:
        """Drop a held request (it was aborted); False if it was not held."""
        return self._held.pop(request.request_id, None) is not None

    # -- the step --------------------------------------------------------------------------

    def apply_masks(self, logits: torch.Tensor, sampling: list[Request]) -> None:
        """Mask the logits rows of the constrained requests in `sampling` (row i is sampling[i])."""
        rows = [i for i, r in enumerate(sampling) if r.grammar is not None and r.grammar.active]
        if not rows:
            return
        bitmask = self._mask_buffer(len(rows))
        row_bytes = self.words * 4
        if len(rows) == 1:
            sampling[rows[0]].grammar.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            self._parallel().unsafe_compute_mask_ptr(
                [(sampling[i].grammar.matcher, k) for k, i in enumerate(rows)], bitmask.data_ptr(), row_bytes,
                len(rows))
        apply_token_bitmask(logits, bitmask, rows)

    def _mask_buffer(self, rows: int) -> torch.Tensor:
        if self._bitmask.shape[0] < rows:
            # Pinned on CUDA, so the copy to the device does not wait. Reusing it next step is
            # safe: the sampler reads its tokens back to the host, which waits for the copy.
            pin = self.device.type == "cuda"
            self._bitmask = torch.empty((max(rows, 2 * self._bitmask.shape[0], 8), self.words), dtype=torch.int32,
                                        pin_memory=pin)
        return self._bitmask[:rows]

    def _parallel(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            # As many mask threads as torch has compute threads: the masks are filled between
            # the forward and the sampler, when those threads would otherwise wait.
            self._executor = LLExecutor(max(1, torch.get_num_threads()))
        return self._executor

    def close(self) -> None:
        self.cache.close()
