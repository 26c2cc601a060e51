"""A thread-safe front for the engine: one background thread owns it and steps it; any
thread submits requests and reads each request's outputs from its own stream.

The engine thread runs the engine core loop (rein.engine.loop): it blocks on its command
queue when idle (no polling), drains every pending command before each step (so requests
join at every step), and hands each step's outputs to the streams. `stop()` aborts whatever is left and joins the thread
promptly — a worker's warm shutdown depends on it.

An optional `on_step` hook sees all of a step's outputs at once, on the engine thread,
before the streams do: the worker publishes every running job's delta in one Redis round
trip per step through it. The hook must be quick and must not raise (an exception is
logged and the engine carries on).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rein.core.images import ImageInput
from rein.engine.engine import LLMEngine
from rein.engine.loop import EngineCore
from rein.engine.request_result import RequestResult
from rein.engine.sampling_params import SamplingParams
from rein.engine.step_outputs import RequestOutput

log = logging.getLogger(__name__)

_STOP = object()


class EngineStoppedError(RuntimeError):
    """The engine is not running (stopped, or failed: the message says why)."""


class RequestStream:
    """Outputs of one request, in order; iteration ends after the finished output."""

    def __init__(self, request_id: str, runner: EngineClient) -> None:
        self.request_id = request_id
        self._runner = runner
        self._queue: queue.Queue[RequestOutput | BaseException] = queue.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put(item)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises queue.Empty after `timeout`, or the engine's error."""
        item = self._queue.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self.get()
            yield output
            if output.finished:
                return

    def abort(self) -> None:
        self._runner.abort(self.request_id)


class CollectingStream(RequestStream):
    """A stream for a caller that wants only the end result: the engine thread appends each
    output to `collected` and wakes the caller once, at the end, instead of at every step.

    With a batch of many requests, waking each request's thread at every step costs more
    than the step's own bookkeeping (a thread switch per request per token).
    """

    def __init__(self, request_id: str, runner: EngineClient) -> None:
        super().__init__(request_id, runner)
        self.collected = RequestResult(request_id)
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
            self._done.set()
            return
        self.collected.add(item)
        if item.finished:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the request has finished (see `collected`); False after `timeout`.
        Raises the engine's error if it stopped or failed first."""
        if not self._done.wait(timeout):
            return False
        if self._error is not None:
            raise self._error
        return True

    def get(self, timeout: float | None = None) -> RequestOutput:
        raise TypeError("a CollectingStream gives its outputs at the end: use wait() and collected")


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    priority: int
    stream: RequestStream
    accepted: threading.Event
    error: BaseException | None = None
    group: str | None = None          # submit_group: aborting the group aborts this request
    lora_request: Any = None          # rein.model.lora.LoRARequest: the adapter it runs under
    images: Any = None                # list[rein.core.images.ImageInput]: the prompt's images


class EngineClient:
    def __init__(self, engine: LLMEngine, name: str = "rein-engine",
                 on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._failure: BaseException | None = None
        self._stopping = threading.Event()
        # submit_group's groups (engine thread only): group id -> its unfinished requests.
        self._groups: dict[str, set[str]] = {}
        self._group_of: dict[str, str] = {}

    def start(self) -> EngineClient:
        self._thread.start()
        return self

    def __enter__(self) -> EngineClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request_id: str, prompt: list[int] | str, params: SamplingParams | None = None,
               priority: int = 0, *, collect: bool = False, lora_request: Any = None,
               images: list[ImageInput] | None = None) -> RequestStream:
        """Queue a request; validation errors (context length, a bad LoRA adapter, ...) raise here,
        in the caller.

        `collect=True` returns a CollectingStream: the outputs are gathered and handed over
        at the end rather than one by one. `lora_request`: the LoRA adapter it runs under.
        `images`: the prompt's images (LLMEngine.add_request; the prompt ids already expanded).
        """
        self._check_running()
        stream = CollectingStream(request_id, self) if collect else RequestStream(request_id, self)
        command = _Add(request_id, prompt, params or SamplingParams(), priority, stream, threading.Event(),
                       lora_request=lora_request, images=images)
        self._queue_add(command)
        self._wait_accepted(command)
        if command.error is not None:
            raise command.error
        return stream

    def submit_group(self, group: str, prompts: list[list[int]], params: Any, priority: int = 0,
                     ) -> list[CollectingStream]:
        """Queue one request per prompt, all in one go (not one step each), as collecting
        streams; request i is `{group}#{i}`. `abort(group)` aborts them all (an embeddings job's
        inputs are one job to the cancel path). If the engine refuses one, those already
        queued are aborted and the error raises, with `.index` set to the refused prompt."""
        self._check_running()
        commands = [_Add(f"{group}#{i}", prompt, params, priority, CollectingStream(f"{group}#{i}", self),
                         threading.Event(), group=group) for i, prompt in enumerate(prompts)]
        for command in commands:
            self._queue_add(command)
        for command in commands:
            self._wait_accepted(command)
        refused = next((i for i, c in enumerate(commands) if c.error is not None), None)
        if refused is not None:
            self.abort(group)
            error = commands[refused].error
            error.index = refused   # type: ignore[union-attr]
            raise error   # type: ignore[misc]
        return [command.stream for command in commands]  # type: ignore[misc]

    # How a request reaches the engine (ProcessEngineClient sends it to another process instead).

    def _check_running(self) -> None:
        if self._failure is not None:
            raise EngineStoppedError(f"the engine failed: {self._failure!r}") from self._failure
        if self._stopping.is_set() or not self.alive:
            raise EngineStoppedError("the engine runner is not running")

    def _queue_add(self, command: _Add) -> None:
        self._commands.put(command)

    def _wait_accepted(self, command: _Add) -> None:
        while not command.accepted.wait(timeout=0.5):
            if not self.alive:
                raise EngineStoppedError("the engine thread ended before taking the request")

    def abort(self, request_id: str) -> None:
        """Abort within one step; the stream then gets a final output with finish_reason 'abort'.
        A submit_group group id aborts every request of the group."""
        self._commands.put(("abort", request_id))

    def lora_event(self, event: str, lora_request: Any) -> None:
        """A LoRA adapter registered ("load") or unloaded ("unload") for the fleet: the engine reads
        it into its host cache or drops it there (LLMEngine.lora_event), between two steps."""
        self._commands.put(("lora", event, lora_request))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything left, end the thread and wait for it."""
        self._stopping.set()
        self._commands.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            EngineCore(self.engine, self._drain, self._deliver).run()
        except BaseException as exc:  # the engine is broken: tell every waiting stream
            log.exception("engine thread failed")
            self._failure = exc
            for stream in self._streams.values():
                stream._put(EngineStoppedError(f"the engine failed: {exc!r}"))
            self._streams.clear()
            return
        # Stopped (the core ended what the engine held): a stream still open gets the reason.
        for stream in self._streams.values():
            stream._put(EngineStoppedError("the engine stopped"))
        self._streams.clear()

    def _drain(self, block: bool) -> bool:
        """Apply pending commands (waiting for one when idle); False once told to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            if command is _STOP:
                return False
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(command.request_id, command.prompt, command.params,
                                            command.priority, lora_request=command.lora_request,
                                            images=command.images)
                    self._streams[command.request_id] = command.stream
                    if command.group is not None:
                        self._groups.setdefault(command.group, set()).add(command.request_id)
                        self._group_of[command.request_id] = command.group
                except Exception as exc:  # validation error: the caller raises it
                    command.error = exc
                command.accepted.set()
            elif command[0] == "lora":
                _, event, lora_request = command
                self.engine.lora_event(event, lora_request)
            else:
                _, request_id = command
                self.engine.abort(request_id)
                for member in self._groups.get(request_id, ()):
                    self.engine.abort(member)
            block = False

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None and outputs:
            try:
                self.on_step(outputs)
            except Exception:  # a hook's failure must not take the engine down with it
                log.exception("engine on_step hook failed")
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]
                group = self._group_of.pop(output.request_id, None)
                if group is not None:
                    members = self._groups[group]
                    members.discard(output.request_id)
                    if not members:
                        del self._groups[group]
