"""Structured-output specs checked in child processes, so native code cannot take a process down.

llguidance compiles in native code. The caps of rein.engine.structured.limits keep out the inputs
known to break it, but not every input that might: so the check (build the grammar, validate
it) runs in a small pool of child processes (`python -m rein.engine.structured.validator`), one JSON
line in and one out. A child that dies on a spec (a crash in native code) makes that spec's
answer "the validator crashed on it", a 400 for its sender; a child that has not answered
within the deadline is killed, and the spec is refused as too slow to compile. Either way the
child is replaced and the calling process (the API, a batch validator, the worker) lives on.
When no child can be started at all, ValidatorUnavailable says so (a 503 at the API).

The pool starts its children on first use; a child is plain Python with llguidance (no torch),
some 40 MB and 0.2 s to start. Callers memoize answers per spec (rein.engine.structured.spec), so a
batch of 10,000 lines with one schema sends it here once. REIN_STRUCTURED_VALIDATORS=0 checks
in the calling process instead (no isolation).
"""

from __future__ import annotations

import json
import logging
import select
import subprocess
import sys
import threading
import time

from rein.core.settings import setting_or_default

log = logging.getLogger(__name__)


class ValidatorUnavailable(RuntimeError):
    """No validator process could be started or had room within the deadline."""


class CompileTimeout(Exception):
    """The spec did not compile within the deadline; the message says so. Not a verdict to
    remember: on a less busy machine the same spec may make it."""


class _Child:
    def __init__(self) -> None:
        # stderr to the parent's: a crash's message lands in the log of the process that asked.
        # The child flushes each answer itself; it inherits this process's environment. -P: the
        # working directory is not put on sys.path (`-m` would put it first: a json.py there
        # would be imported in place of the standard library's).
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-m", "rein.engine.structured.validator"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, encoding="utf-8", errors="surrogatepass")

    def ask(self, key: str, deadline: float) -> tuple[str, str | None]:
        """("ok", problem) | ("crashed", None) | ("timeout", None)."""
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(key + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            return "crashed", None
        ready, _, _ = select.select([self.process.stdout], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            return "timeout", None
        line = self.process.stdout.readline()
        if not line:
            return "crashed", None
        return "ok", json.loads(line)["problem"]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class ValidatorPool:
    """Up to `size` children, each checking one spec at a time; `problem(key)` waits at most
    `timeout` seconds in all (for a free child and for its answer)."""

    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self._idle: list[_Child] = []
        self._running = 0
        self._cond = threading.Condition()

    def problem(self, key: str) -> str | None:
        """What is wrong with the spec whose spec_key is `key` (rein.engine.structured.spec), or None."""
        deadline = time.monotonic() + self.timeout
        child = self._take(deadline)
        outcome = "crashed"
        try:
            outcome, problem = child.ask(key, deadline)
        finally:
            self._give_back(child, healthy=outcome == "ok")
        if outcome == "crashed":
            log.warning("a structured-output validator process died on a spec (%d characters)", len(key))
            return ("the grammar crashed rein's grammar compiler (llguidance); make it smaller or "
                    "simpler (fewer rules, less nesting)")
        if outcome == "timeout":
            raise CompileTimeout(f"compiling it took longer than {self.timeout:g} s; make it simpler (fewer "
                                 f"alternatives or nested anyOf/allOf)")
        return problem

    def _take(self, deadline: float) -> _Child:
        with self._cond:
            while not self._idle and self._running >= self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValidatorUnavailable(
                        f"all {self.size} grammar validators stayed busy for {self.timeout:g} s")
                self._cond.wait(left)
            self._running += 1
            if self._idle:
                return self._idle.pop()
        try:
            return _Child()
        except OSError as exc:
            with self._cond:
                self._running -= 1
                self._cond.notify()
            raise ValidatorUnavailable(f"no grammar validator process could be started: {exc}") from exc

    def _give_back(self, child: _Child, healthy: bool) -> None:
        if not healthy:
            child.kill()
        with self._cond:
            self._running -= 1
            if healthy:
                self._idle.append(child)
            self._cond.notify()


_pool: ValidatorPool | None = None
_pool_lock = threading.Lock()


def pool() -> ValidatorPool | None:
    """The process's pool, sized by REIN_STRUCTURED_VALIDATORS (None: 0, check in-process)."""
    global _pool
    size = setting_or_default("structured_validators")
    if size == 0:
        return None
    with _pool_lock:
        if _pool is None or _pool.size != size:
            _pool = ValidatorPool(size, setting_or_default("structured_validate_seconds"))
        return _pool


def _serve() -> None:
    """The child: one spec key a line in, {"problem": str | null} a line out, until stdin ends."""
    from rein.engine.structured.spec import find_problem

    for line in sys.stdin:
        try:
            problem = find_problem(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - any failure to compile is the spec's problem
            problem = f"{type(exc).__name__}: {exc}"
        sys.stdout.write(json.dumps({"problem": problem}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
