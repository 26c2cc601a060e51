"""The engine in a process of its own: `ProcessEngineClient` is an `EngineClient` whose engine
steps in a child process, so the step loop has a core and a GIL to itself.

Why: in a worker, the engine thread shares the interpreter with Celery's consumer, the task
threads, the token publisher and the result recorder. Each of those holds the GIL for a
few milliseconds per job, and every one of those milliseconds is one the step loop waits:
on a small model the service ran at half the speed of the same engine alone. vLLM splits
its front end from its engine core the same way.

The parent keeps what callers see — `submit`, `submit_group`, `abort`, `stop`, the request
streams and the `on_step` hook — and a receiver thread that hands each step's outputs to
them, exactly as `EngineClient` does on its engine thread. The child owns the engine: it
takes commands from the pipe before every step (blocking on it when idle) and sends back,
per step, the outputs and a snapshot of the engine's counters (`EngineView`, what the
parent's heartbeat and metrics read instead of a live engine).

Lifetime: the child is spawned (never forked: the parent has threads), loads the model, and
says it is ready; the parent's constructor waits for that, so a model that cannot load
fails the worker's start with the child's error. The child ignores SIGINT and SIGTERM (a
terminal's Ctrl-C or `kill` of the group reaches both; the parent decides), ends when told
to stop, and exits when the parent dies: the pipe closes, which the child sees before its
next step (or at once when idle), and on Linux, for a runner made on the main thread, the
kernel also kills it (PR_SET_PDEATHSIG). A killed worker never leaves an engine behind.
If the child dies, every waiting stream gets EngineStoppedError, as when the engine thread
fails.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from rein.core.settings import swap_environment
from rein.engine.client import EngineClient, EngineStoppedError, _Add
from rein.engine.config import EngineConfig
from rein.engine.engine import EngineStats
from rein.engine.loop import EngineCore
from rein.engine.step_outputs import RequestOutput

log = logging.getLogger(__name__)

# How long the parent waits for the child to load the model and say it is ready.
START_TIMEOUT_SECONDS = 600.0
PR_SET_PDEATHSIG = 1


@dataclass
class PoolView:
    num_blocks: int
    block_size: int
    num_free: int = 0

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0


@dataclass
class EngineView:
    """What the parent knows of the child's engine: its fixed facts (config, tokenizer,
    context length, pool size) and the counters of its latest step."""

    config: EngineConfig
    tokenizer: Any
    max_model_len: int
    pool: PoolView
    stats: EngineStats = field(default_factory=EngineStats)
    num_running: int = 0
    num_waiting: int = 0

    def update(self, snapshot: tuple[EngineStats, int, int, int]) -> None:
        self.stats, self.num_running, self.num_waiting, self.pool.num_free = snapshot


class ProcessEngineClient(EngineClient):
    """An EngineClient over an engine built from `config` in a child process (see the module
    docstring). `log_level` / `log_format`: rein's logging in the child (None: left as is).
    `cpus`: the cores the child runs on (rein.core.cpu_pinning; None: wherever the parent may)."""

    def __init__(self, config: EngineConfig, name: str = "rein-engine", on_step: Any = None, *,
                 log_level: int | None = None, log_format: str | None = None,
                 start_timeout: float = START_TIMEOUT_SECONDS, cpus: frozenset[int] | None = None) -> None:
        self._conn, child_conn = multiprocessing.Pipe(duplex=True)
        context = multiprocessing.get_context("spawn")
        # PR_SET_PDEATHSIG fires when the creating *thread* ends: ask for it only from the main
        # thread (a worker's bootstep); elsewhere the closed pipe alone ends the child.
        death_signal = threading.current_thread() is threading.main_thread()
        self._process = context.Process(target=serve_engine, name=name, daemon=True,
                                        args=(config, child_conn, os.getpid(), death_signal, log_level,
                                              log_format, cpus))
        previous = os.sched_getaffinity(0) if cpus else None
        if cpus:   # this thread only (Linux): the child, and every thread it starts, inherits the
            os.sched_setaffinity(0, cpus)   # mask, and torch counts those cores for its threads
        # PYTHONSAFEPATH: the child's interpreter starts as `python -c ...`, which would put the
        # working directory first on sys.path, where a planted pickle.py is imported before any
        # rein code runs. In its environment, the child's own children (grammar validators,
        # tensor-parallel ranks) inherit it.
        environment = swap_environment({"PYTHONSAFEPATH": "1"})
        try:
            self._process.start()
        finally:
            swap_environment(environment)
            if previous is not None:
                os.sched_setaffinity(0, previous)
        child_conn.close()
        ready = self._wait_ready(start_timeout)
        super().__init__(ready, name=name, on_step=on_step)   # self.engine: the EngineView
        self._send_lock = threading.Lock()
        self._groups_lock = threading.Lock()
        self._pending: dict[str, _Add] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._receive, name=f"{name}-receiver", daemon=True)

    def _wait_ready(self, timeout: float) -> EngineView:
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.5):
            if not self._process.is_alive():
                raise RuntimeError(f"the engine process exited while loading the model "
                                   f"(exit code {self._process.exitcode}); its log says why")
            if time.monotonic() > deadline:
                self._process.kill()
                raise RuntimeError(f"the engine process did not load the model within {timeout:.0f} s")
        kind, payload = self._conn.recv()
        if kind == "failed":
            self._process.join(5)
            raise RuntimeError(f"the engine could not start: {payload}")
        return payload

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # -- callers' threads --------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:   # the child is gone (ValueError: pipe closed here)
            raise EngineStoppedError(f"the engine process is not running ({exc})") from exc

    def _queue_add(self, command: _Add) -> None:
        with self._groups_lock:
            self._pending[command.request_id] = command
        try:
            self._send(("add", command.request_id, command.prompt, command.params, command.priority,
                        command.lora_request, command.images))
        except EngineStoppedError:
            with self._groups_lock:
                self._pending.pop(command.request_id, None)
            raise

    def lora_event(self, event: str, lora_request: Any) -> None:
        """As EngineClient.lora_event, in the engine's process."""
        self._send(("lora", event, lora_request))

    def _wait_accepted(self, command: _Add) -> None:
        while not command.accepted.wait(timeout=0.5):
            if not self.alive:
                raise EngineStoppedError("the engine process ended before taking the request")

    def abort(self, request_id: str) -> None:
        """Abort within a step; a submit_group group id aborts every request of the group."""
        with self._groups_lock:
            ids = [request_id, *self._groups.get(request_id, ())]
            ids += [c.request_id for c in self._pending.values() if c.group == request_id]
        try:
            self._send(("abort", ids))
        except EngineStoppedError:
            pass    # nothing runs there any more: the streams end with the process

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything left, end the child and wait for it."""
        self._stopping.set()
        try:
            self._send(("stop",))
        except EngineStoppedError:
            pass
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._process.join(max(timeout / 2, 1.0))
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    # -- the receiver thread -------------------------------------------------------------------

    def _receive(self) -> None:
        reason: BaseException = EngineStoppedError("the engine stopped")
        try:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    if not self._stopping.is_set():
                        self._process.join(2)
                        raise EngineStoppedError(f"the engine process exited "
                                                 f"(exit code {self._process.exitcode})") from None
                    break
                kind = message[0]
                if kind == "step":
                    _, outputs, snapshot = message
                    self.engine.update(snapshot)
                    self._deliver(outputs)
                elif kind == "accepted":
                    self._accepted(message[1], message[2])
                elif kind == "stats":
                    self.engine.update(message[1])
                elif kind == "failed":
                    raise EngineStoppedError(f"the engine failed: {message[1]}")
                elif kind == "stopped":
                    break
        except BaseException as exc:
            log.error("engine process failed: %s", exc)
            self._failure = exc
            reason = EngineStoppedError(str(exc))
        with self._groups_lock:
            pending, self._pending = list(self._pending.values()), {}
        for command in pending:
            command.error = reason
            command.accepted.set()
        for stream in list(self._streams.values()):
            stream._put(reason)
        self._streams.clear()

    def _accepted(self, request_id: str, error: tuple | None) -> None:
        with self._groups_lock:
            command = self._pending.pop(request_id, None)
            if command is None:
                return
            if error is None:
                self._streams[request_id] = command.stream
                if command.group is not None:
                    self._groups.setdefault(command.group, set()).add(request_id)
                    self._group_of[request_id] = command.group
        if error is not None:
            command.error = rebuild_error(*error)
        command.accepted.set()

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._groups_lock:     # abort() reads the groups from callers' threads
            super()._deliver(outputs)


# -- errors across the pipe ----------------------------------------------------------------------


def portable_error(exc: BaseException) -> tuple:
    """An exception as (class, message, attributes): rebuilt on the other side without calling
    its __init__, whose arguments pickle does not know (ContextLengthExceeded's)."""
    attributes = {k: v for k, v in vars(exc).items() if _picklable(v)}
    return type(exc), str(exc), attributes


def rebuild_error(cls: type[BaseException], message: str, attributes: dict[str, Any]) -> BaseException:
    try:
        exc = cls.__new__(cls)
        BaseException.__init__(exc, message)
        exc.__dict__.update(attributes)
        return exc
    except Exception:   # noqa: BLE001 - an exotic class: keep the message and the code
        from rein.engine.errors import EngineRequestError

        fallback = EngineRequestError(message, attributes.get("param"))
        fallback.__dict__.update(attributes)
        return fallback


def _picklable(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, type(None), list, tuple, dict))


# -- the child -----------------------------------------------------------------------------------


def serve_engine(config: EngineConfig, conn: Connection, parent_pid: int, death_signal: bool,
                 log_level: int | None, log_format: str | None, cpus: frozenset[int] | None = None) -> None:
    """The child's main: build the engine, say ready, then step it for the parent until told
    to stop or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if death_signal:
        _die_with_parent(parent_pid)
    if cpus:   # the child started on them (ProcessEngineClient); an OMP_NUM_THREADS beyond them is cut
        torch.set_num_threads(min(torch.get_num_threads(), len(cpus)))
    if log_format is not None:
        from rein.core.logging import configure_logging

        configure_logging(log_level or logging.INFO, log_format)   # type: ignore[arg-type]
    try:
        from rein.engine.engine import LLMEngine

        engine = LLMEngine(config)
    except BaseException as exc:   # noqa: BLE001 - the parent reports it
        log.exception("the engine could not start")
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    view = EngineView(config=engine.config, tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                      pool=PoolView(engine.pool.num_blocks, engine.pool.block_size, engine.pool.num_free))
    conn.send(("ready", view))
    try:
        _ChildLoop(engine, conn).run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)    # the parent is gone: nobody is left to hand anything to
    except BaseException as exc:   # noqa: BLE001
        log.exception("engine process failed")
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass


class _ChildLoop:
    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn

    def snapshot(self) -> tuple[EngineStats, int, int, int]:
        engine = self.engine
        return replace(engine.stats), engine.num_running, engine.num_waiting, engine.pool.num_free

    def run(self) -> None:
        """The engine core loop (rein.engine.loop), its commands from the parent's pipe and its
        outputs, with the engine's state, back through it."""
        conn = self.conn
        EngineCore(self.engine, self._drain,
                   deliver=lambda outputs: conn.send(("step", outputs, self.snapshot())),
                   idle=lambda: conn.send(("stats", self.snapshot()))).run()
        conn.send(("stopped",))

    def _drain(self, block: bool) -> bool:
        """Apply the parent's pending commands (waiting for one when idle); False on stop."""
        conn = self.conn
        while block or conn.poll():
            message = conn.recv()
            block = False
            kind = message[0]
            if kind == "add":
                _, request_id, prompt, params, priority, lora_request, images = message
                try:
                    self.engine.add_request(request_id, prompt, params, priority, lora_request=lora_request,
                                            images=images)
                    error = None
                except Exception as exc:   # a validation error: the caller raises it
                    error = portable_error(exc)
                self.conn.send(("accepted", request_id, error))
            elif kind == "abort":
                for request_id in message[1]:
                    self.engine.abort(request_id)
            elif kind == "lora":
                self.engine.lora_event(message[1], message[2])
            elif kind == "stop":
                return False
        return True


def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when its parent dies (a SIGKILLed worker)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:   # it died before prctl took effect
        os._exit(0)
