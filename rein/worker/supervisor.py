"""One engine per device under one `rein worker` command: the worker supervisor.

`rein worker --devices 0,1,2,3` (or `--data-parallel-size 4`) runs this process, which holds no
engine: it starts one ordinary `rein worker` process per engine, each on its own device and with
its own Celery node name (so its own heartbeat, leases and `jobs.worker`), all consuming the
model's queues. Processes, not threads in one worker: an engine owns its device, and a worker
that dies takes no other engine with it. Each child keeps a lone worker's crash-only behaviour:
the leases of a dead child's jobs run out and a sibling's reaper queues them again with their
attempts refunded (rein.jobs.reaper), so nothing is lost or billed twice.

The supervisor

* forwards SIGTERM and SIGINT to every child (a warm shutdown each; a second signal, a cold one,
  as Celery's) and exits 0 once they are gone;
* starts a child that dies again, after a back-off that grows while it keeps dying young;
* gives up -- stops the others and exits non-zero, naming the device -- when a child refuses to
  start (exit 2: a device it cannot use, an unmigrated database, a bad flag) or dies young
  MAX_QUICK_DEATHS times in a row (an engine that cannot load there).

`parse_devices` reads `--devices`: CUDA indices (`0,1`, ranges `0-7`, `cuda:N`), or `cpu`
entries (`cpu,cpu` or `cpu:0,cpu:1`: two CPU engines, for tests and CPU hosts). With
`--tensor-parallel-size N` each engine is a group of N devices (`EngineGroup.devices`,
`plan_engines`): `--devices 0-7 --tensor-parallel-size 2` runs four engines of two GPUs, each
worker process the rank 0 of its engine's ranks (rein.engine.rank_processes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rein.engine.options import check_tensor_parallel_size

log = logging.getLogger(__name__)

# `rein worker` exits 2 when it refuses to start (rein.cli.worker; argparse's errors too): a
# configuration error that starting it again cannot fix.
REFUSED_EXIT = 2
# A child that lived less than this died young: it counts towards giving up.
STABLE_SECONDS = 120.0
MAX_QUICK_DEATHS = 5
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 30.0

_CUDA_RANGE = re.compile(r"(\d+)-(\d+)")
_CPU = re.compile(r"cpu(:\d+)?")
_PR_SET_PDEATHSIG = 1
# Looked up before any fork: the child runs _die_with_parent between fork and exec.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_WATCHED = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


def parse_devices(text: str) -> tuple[str, ...]:
    """`--devices` as engine devices: ("cuda:0", "cuda:1", ...) or ("cpu", "cpu", ...); ValueError
    saying what is wrong."""
    items = [item.strip().lower() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"--devices {text!r}: expected a comma-separated list of devices, e.g. 0,1,2,3, 0-7 "
                         f"or cpu,cpu")
    devices: list[str] = []
    for item in items:
        if _CPU.fullmatch(item):
            devices.append("cpu")
            continue
        index = item.removeprefix("cuda:")
        if index.isdigit():
            devices.append(f"cuda:{int(index)}")
        elif (span := _CUDA_RANGE.fullmatch(index)) is not None:
            first, last = int(span[1]), int(span[2])
            if first > last:
                raise ValueError(f"--devices {text!r}: the range {item} runs backwards; write {last}-{first}")
            devices.extend(f"cuda:{i}" for i in range(first, last + 1))
        else:
            raise ValueError(f"--devices {text!r}: {item!r} is not a device; give CUDA indices (0,1 or a range "
                             f"0-3, or cuda:N), all, or cpu entries (cpu,cpu: two CPU engines)")
    cuda = [device for device in devices if device != "cpu"]
    if cuda and len(cuda) != len(devices):
        raise ValueError(f"--devices {text!r} mixes CPU and CUDA devices; a worker's engines run on one kind")
    if twice := sorted({device for device in cuda if cuda.count(device) > 1}):
        raise ValueError(f"--devices {text!r} names {', '.join(twice)} more than once: each engine sizes its KV "
                         f"cache to a share of its GPU's memory, so two engines cannot share a GPU")
    return tuple(devices)


@dataclass(frozen=True)
class EngineGroup:
    """The devices of one engine (several under tensor parallelism), and the engine's position
    among the worker's engines."""

    devices: tuple[str, ...]
    position: int

    @property
    def device(self) -> str:
        """The engine's --device."""
        return self.devices[0]

    @property
    def label(self) -> str:
        """The engine's name in node names and logs: cuda0, or cpu1 (CPU engines by position)."""
        return self.device.replace(":", "") if self.device != "cpu" else f"cpu{self.position}"


def plan_engines(devices: tuple[str, ...] | None, data_parallel_size: int | None, tensor_parallel_size: int,
                 device: str) -> list[EngineGroup]:
    """The engines to run: on `devices` (parse_devices), or `data_parallel_size` of them on
    `device` (cpu; cuda: indices 0 to N-1), each of `tensor_parallel_size` devices. ValueError
    for a combination that does not fit. A tensor-parallel engine runs its ranks on consecutive
    CUDA indices from its --device on (rein.engine.rank_processes), so a group must be consecutive."""
    check_tensor_parallel_size(tensor_parallel_size, "--tensor-parallel-size")
    if data_parallel_size is not None and data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
    if devices is None:
        if data_parallel_size is None:
            raise ValueError("give --devices or --data-parallel-size")
        count = data_parallel_size * tensor_parallel_size
        if device == "cpu":
            devices = ("cpu",) * count
        elif device == "cuda":
            devices = tuple(f"cuda:{i}" for i in range(count))
        else:
            raise ValueError(f"--data-parallel-size with device {device}: name the GPUs with --devices "
                             f"(e.g. --devices 0-{count - 1}) instead of one device")
    elif data_parallel_size is not None and data_parallel_size * tensor_parallel_size != len(devices):
        raise ValueError(f"--data-parallel-size {data_parallel_size} engines of {tensor_parallel_size} device(s) "
                         f"need {data_parallel_size * tensor_parallel_size} devices; --devices names {len(devices)}")
    if len(devices) % tensor_parallel_size:
        raise ValueError(f"{len(devices)} devices do not split into engines of {tensor_parallel_size}")
    groups = [EngineGroup(tuple(devices[start:start + tensor_parallel_size]), position)
              for position, start in enumerate(range(0, len(devices), tensor_parallel_size))]
    for group in groups:
        indices = [int(d.removeprefix("cuda:")) for d in group.devices if d != "cpu"]
        if indices and indices != list(range(indices[0], indices[0] + len(indices))):
            raise ValueError(f"engine {group.position} would run on {', '.join(group.devices)}: the devices of "
                             f"one tensor-parallel engine must be consecutive indices (list --devices so that "
                             f"each {tensor_parallel_size} in a row are, e.g. 0-7)")
    return groups


@dataclass
class Child:
    """One engine's worker process: how to start it, and what became of it."""

    group: EngineGroup
    name: str                    # its Celery node name
    argv: list[str]
    process: subprocess.Popen | None = None
    started: float = 0.0         # time.monotonic() of the last start
    quick_deaths: int = 0        # young deaths in a row
    restart_at: float | None = None

    def describe(self) -> str:
        return f"worker {self.name} (device {', '.join(self.group.devices)})"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the supervisor dies (SIGKILL, the OOM killer), so
    no engine is left holding a device with nobody to start it again; a warm shutdown hands its
    jobs back."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Supervisor:
    """Runs `children` until told to stop or one cannot run (module docstring)."""

    children: Sequence[Child]
    stable_seconds: float = STABLE_SECONDS
    max_quick_deaths: int = MAX_QUICK_DEATHS
    first_backoff_seconds: float = FIRST_BACKOFF_SECONDS
    stopping: bool = False
    exit_code: int = 0

    def run(self) -> int:
        """Start every child; return when all are gone after a stop (0) or a give-up (non-zero)."""
        # Signals arrive as bytes on a pipe (set_wakeup_fd), read by the loop: it blocks in select
        # until a signal or a due restart, and nothing runs inside a signal handler.
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)
        handlers = {signum: signal.signal(signum, _noted) for signum in _WATCHED}
        previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        try:
            for child in self.children:
                self._start(child)
            while not (self.stopping and all(child.process is None for child in self.children)):
                select.select([read_end], [], [], self._until_next_restart())
                for signum in _drain(read_end):
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self.stop(signum)
                self._reap()
                self._restart_due()
            return self.exit_code
        finally:
            signal.set_wakeup_fd(previous_fd)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            os.close(read_end)
            os.close(write_end)

    def stop(self, signum: int = signal.SIGTERM, exit_code: int | None = None) -> None:
        """Pass `signum` to every live child; start none again."""
        if not self.stopping:
            log.info("stopping %d worker(s) (%s)", sum(c.process is not None for c in self.children),
                     signal.Signals(signum).name)
        self.stopping = True
        if exit_code is not None and self.exit_code == 0:
            self.exit_code = exit_code
        for child in self.children:
            child.restart_at = None
            if child.process is not None and child.process.poll() is None:
                child.process.send_signal(signum)

    def _start(self, child: Child) -> None:
        # A session of its own: a Ctrl-C in the terminal reaches the children once, through
        # stop(), not also directly (two SIGINTs would be Celery's cold shutdown).
        child.process = subprocess.Popen(child.argv, start_new_session=True, preexec_fn=_die_with_parent)
        child.started = time.monotonic()
        child.restart_at = None
        log.info("%s started (pid %d)", child.describe(), child.process.pid)

    def _reap(self) -> None:
        for child in self.children:
            if child.process is None or (code := child.process.poll()) is None:
                continue
            child.process = None
            lived = time.monotonic() - child.started
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if self.stopping:
                log.info("%s stopped (%s)", child.describe(), how)
            elif code == REFUSED_EXIT:
                log.error("%s refused to start (%s, its reason above); stopping the other workers",
                          child.describe(), how)
                self.stop(exit_code=REFUSED_EXIT)
            else:
                child.quick_deaths = child.quick_deaths + 1 if lived < self.stable_seconds else 0
                if child.quick_deaths >= self.max_quick_deaths:
                    log.error("%s died %d times in a row within %.0f s of starting (last: %s); giving up and "
                              "stopping the other workers", child.describe(), child.quick_deaths,
                              self.stable_seconds, how)
                    self.stop(exit_code=1)
                    continue
                delay = min(self.first_backoff_seconds * 2 ** max(child.quick_deaths - 1, 0), MAX_BACKOFF_SECONDS)
                log.warning("%s died after %.0f s (%s); its jobs go back to the queue when their leases run out; "
                            "starting it again in %.0f s", child.describe(), lived, how, delay)
                child.restart_at = time.monotonic() + delay

    def _restart_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if not self.stopping and child.restart_at is not None and child.restart_at <= now:
                self._start(child)

    def _until_next_restart(self) -> float | None:
        due = [child.restart_at for child in self.children if child.restart_at is not None]
        return max(min(due) - time.monotonic(), 0.0) if due else None


def _noted(signum: int, frame: object) -> None:
    """The Python-level handler: nothing to do, the signal's byte on the wakeup pipe is the news."""


def _drain(fd: int) -> list[int]:
    """The signal numbers written to the wakeup pipe since the last read."""
    received = b""
    while True:
        try:
            chunk = os.read(fd, 512)
        except BlockingIOError:
            return list(received)
        if not chunk:
            return list(received)
        received += chunk
