"""Compiled grammars for one tokenizer, compiled once per distinct spec, off the caller's thread.

`GrammarCache.prefetch(spec)` starts compiling a spec in a small background thread pool
(or finds it already compiled or compiling) and returns its Future; the engine's step
thread only ever asks `ready(spec)` and takes a matcher from a finished compile, so it
never waits for a compile. The worker's task thread and the offline drivers call
`prefetch` (or `wait`) as they take requests, so most grammars are compiled before their
request reaches the engine.

Keyed by the spec's JSON (rein.engine.structured.spec.spec_key): a batch of 10,000 lines with
one schema compiles it once. Bounded: past `max_entries` the least recently used finished
entries are dropped (a request that already holds its grammar keeps it). A spec that
fails to compile is remembered too, with its error, so it is not compiled again.

`check` (the engine's: rein.engine.structured.decoding) runs on the pool's thread before the
compile: the check in a validator process, which may wait for one to start, is never on the
caller's thread. A check that could not answer (GrammarError with `remember` False) fails
the callers of that compile, and the next prefetch of the spec starts it again.

Torch-free: llguidance and a Hugging Face fast tokenizer are all it needs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from rein.engine.structured.limits import parser_limits
from rein.engine.structured.spec import grammar_text, spec_key

log = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_THREADS = 2


class GrammarError(ValueError):
    """A spec that llguidance cannot compile for this tokenizer; the message says why."""

    param = "structured"
    remember = True     # False: not a verdict on the spec (no validator could answer), asked again next time


class GrammarCheckUnavailable(GrammarError):
    """The spec could not be checked (no validator process, or past its deadline)."""

    remember = False


def _unanswered(future: Future[CompiledGrammar]) -> bool:
    """A finished compile whose check could not answer (not a verdict to keep)."""
    if not future.done() or future.cancelled():
        return False
    error = future.exception()
    return isinstance(error, GrammarError) and not error.remember


class CompiledGrammar:
    """One compiled spec: a pristine matcher that every request's matcher is copied from
    (a copy shares the compiled grammar and lexer; it costs about 2 us)."""

    __slots__ = ("key", "spec", "_template", "seconds")

    def __init__(self, key: str, spec: dict[str, Any], template: Any, seconds: float) -> None:
        self.key = key
        self.spec = spec
        self._template = template
        self.seconds = seconds

    def matcher(self) -> Any:
        """A fresh llguidance LLMatcher at the start of the grammar."""
        return self._template.deep_copy()


class GrammarCache:
    """See the module docstring. `tokenizer` is a Hugging Face fast tokenizer; `vocab_size`
    the model's (its embedding rows, which may exceed the tokenizer's: ids past the
    tokenizer's are never allowed); `eos_token_ids` end a grammar where it may end."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int] | tuple[int, ...],
                 max_entries: int = DEFAULT_MAX_ENTRIES, threads: int = DEFAULT_THREADS,
                 check: Callable[[dict[str, Any]], None] | None = None) -> None:
        self._check = check
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.max_entries = max(1, max_entries)
        self.compiles = 0              # grammars compiled (a cache hit does not count)
        self.compile_seconds = 0.0     # summed over those
        self._entries: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="rein-grammar")
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()

    # -- the caller's side -----------------------------------------------------------------

    def prefetch(self, spec: dict[str, Any]) -> Future[CompiledGrammar]:
        """The spec's compile, started now unless it is cached or under way."""
        key = spec_key(spec)
        with self._lock:
            future = self._entries.get(key)
            if future is not None and not _unanswered(future):
                self._entries.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key, spec)
            self._entries[key] = future
            self._evict()
        return future

    def ready(self, spec: dict[str, Any]) -> bool:
        """Whether the spec's compile has finished (successfully or not)."""
        with self._lock:
            future = self._entries.get(spec_key(spec))
        return future is not None and future.done()

    def wait(self, spec: dict[str, Any], timeout: float | None = None) -> CompiledGrammar:
        """The compiled spec, compiling it if needed and waiting up to `timeout` seconds.
        Raises GrammarError if it does not compile, TimeoutError if it takes longer."""
        return self.prefetch(spec).result(timeout)

    def wait_any(self, futures: list[Future[CompiledGrammar]], timeout: float) -> None:
        """Block until one of `futures` is done or `timeout` passes (the engine's idle wait)."""
        wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the pool's side -------------------------------------------------------------------

    def ll_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built once (about 0.2 s for a 49k vocabulary)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def _compile(self, key: str, spec: dict[str, Any]) -> CompiledGrammar:
        from llguidance import LLMatcher

        if self._check is not None:
            self._check(spec)             # raises GrammarError
        tokenizer = self.ll_tokenizer()   # built by the first compile, not counted in its time
        started = time.perf_counter()
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise GrammarError(f"the structured spec cannot be compiled: {exc}") from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise GrammarError(f"the structured spec cannot be compiled: {matcher.get_error()}")
        # llguidance builds its lexer lazily; the first mask is the costly one, so it is
        # computed here, in the pool, rather than in the engine's first step with it.
        matcher.compute_bitmask()
        seconds = time.perf_counter() - started
        with self._lock:
            self.compiles += 1
            self.compile_seconds += seconds
        log.debug("compiled a %s grammar in %.1f ms", spec.get("type"), seconds * 1e3)
        return CompiledGrammar(key, spec, matcher, seconds)

    def _evict(self) -> None:
        # Under self._lock. Oldest first; entries still compiling stay (someone waits on them).
        excess = len(self._entries) - self.max_entries
        if excess <= 0:
            return
        for key in [k for k, f in self._entries.items() if f.done()][:excess]:
            del self._entries[key]
