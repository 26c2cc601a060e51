"""A tensor-parallel engine's other ranks: rank 0 starts them, sends each step's plan, ends them.

The engine with `tensor_parallel_size` N runs in one process, rank 0: it owns the scheduler,
the block pool, the sampler and everything requests see, and its model runner holds shard 0
of the model and of the paged KV cache. `RankProcesses.start` launches ranks 1..N-1 as
processes of their own (`python -m rein.engine.rank_follower`), each holding its shard of
the weights and of the cache, joined with rank 0 in one torch.distributed group.

Each step, rank 0's runner turns the scheduled requests into a `StepPlan` (plain lists: token
ids, positions, cache slots, block tables, the rows to compute logits for) and `send`s it to
every rank through a pipe before running its own forward; each rank runs the same forward on
its shard (rein.engine.model_runner.ModelRunner.follow), and the collectives inside the model
meet. Pipes rather than a collective for the plan: a rank waits on its pipe for as long as
the engine is idle, which a collective's timeout would not allow, and a pipe tells a rank
that rank 0 is gone (EOF) however it died.

Decode steps replay CUDA graphs on every rank (rein.engine.cuda_graphs): each rank captured the
same sizes and modes in the same order, so the collectives inside pair up, and replays the mode
rank 0's plan names (`StepPlan.graph_mode`); rank 0's graph also samples, the others' stop at the
gathered logits. A replayed collective is not watched by NCCL's watchdog, so rank 0 waits for a
replayed step with `wait_for_device`, which watches the other ranks' processes meanwhile.

Crash-only, as one engine: a rank that dies fails rank 0's next step (`RankDiedError`, or the
collective it was in raising), which fails the engine like any engine error, and the worker
replaces the engine (rein.engine.process_client; rein.worker's dead-engine path), whose ranks
exit when their pipe closes. A rank whose parent is gone while it waits in a collective exits
too (`follower.watch_parent`). Nothing is left behind: no rank outlives rank 0's process.

Devices: on CPU every rank runs on the CPU (gloo), each with its share of the cores; on
CUDA rank r runs on the device after rank 0's by r (rank 0 on cuda:2 of a size-2 engine:
ranks on cuda:2 and cuda:3; the worker supervisor gives each engine its devices through
CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from multiprocessing.connection import Connection, Pipe, wait
from typing import TYPE_CHECKING

import torch

from rein.model.parallel.group import DistributedGroup, file_init_method
from rein.model.parallel.shm_reduce import PeerGone

if TYPE_CHECKING:
    from rein.engine.config import EngineConfig

log = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to load their shards and say so.
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
# How long a step's error waits for a rank the all-reduce saw gone to finish exiting.
PEER_EXIT_WAIT_SECONDS = 2.0


class RankDiedError(RuntimeError):
    """A rank of a tensor-parallel engine is gone: the engine cannot step (the whole group is replaced)."""


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device when rank 0 runs on `device` (see the module docstring)."""
    kind, _, index = device.partition(":")
    if kind != "cuda":
        return device
    return f"cuda:{int(index or 0) + rank}"


def cpu_threads_per_rank(world_size: int) -> int:
    """Each rank's share of this process's cores (at least one): N ranks of a CPU engine split them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


class RankProcesses:
    """Ranks 1..N-1 of rank 0's engine, as processes, and rank 0's own group. See the module docstring."""

    def __init__(self, processes: list[subprocess.Popen], conns: list[Connection], group: DistributedGroup,
                 rendezvous: str) -> None:
        self.processes = processes
        self.conns = conns
        self.group = group
        self._rendezvous = rendezvous
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def start(cls, config: EngineConfig) -> RankProcesses:
        """Launch ranks 1..N-1 and join them as rank 0 (each rank then loads its shard: the
        caller builds rank 0's runner, then `wait_ready`)."""
        world_size = config.tensor_parallel_size
        rendezvous = tempfile.mkdtemp(prefix="rein-tp-")
        init_method = file_init_method(os.path.join(rendezvous, "group"))
        if config.torch_device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(world_size))
        processes, conns = [], []
        try:
            for rank in range(1, world_size):
                ours, theirs = Pipe()
                process = subprocess.Popen(
                    [sys.executable, "-P", "-m", "rein.engine.rank_follower", str(theirs.fileno()), str(os.getpid())],
                    pass_fds=(theirs.fileno(),))
                theirs.close()
                processes.append(process)
                conns.append(ours)
                try:
                    ours.send((replace(config, device=rank_device(config.device, rank)), rank, init_method,
                               logging.getLogger("rein").getEffectiveLevel()))
                except OSError:
                    pass   # it exited already: _expect reports how
            log.info("tensor parallel: %d ranks (pids %s and this one), joining", world_size,
                     ", ".join(str(p.pid) for p in processes))
            # A rank that cannot even import its modules says so here, rather than leaving
            # rank 0 waiting in the rendezvous for the group's timeout.
            _expect(conns, processes, "joining", READY_TIMEOUT_S)
            group = DistributedGroup(0, world_size, init_method, config.torch_device)
        except BaseException:
            _end(processes)
            shutil.rmtree(rendezvous, ignore_errors=True)
            raise
        return cls(processes, conns, group, rendezvous)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until every rank has loaded its shard; RankDiedError (with its reason) if one could not."""
        _expect(self.conns, self.processes, "ready", timeout_s)
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def error_of(self, exc: BaseException) -> BaseException:
        """`exc` (what a step raised) as a RankDiedError naming the dead rank, when one died."""
        if isinstance(exc, PeerGone) and 1 <= exc.rank <= len(self.processes):
            # Seen gone by the all-reduce (its /proc state) a moment before its exit can be
            # collected here: wait for that, so its reason (sent before it exited) is read.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.processes[exc.rank - 1].wait(PEER_EXIT_WAIT_SECONDS)
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns, strict=True), start=1):
            if process.poll() is not None:
                reason = exc
                try:   # a rank that failed (rather than being killed) said why before exiting
                    if conn.poll():
                        reason = conn.recv()[1]
                except (EOFError, OSError):
                    pass
                return RankDiedError(f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                                     f"{process.returncode}: the engine stops and is replaced ({reason})")
        return exc

    def wait_for_device(self, device: torch.device, poll_s: float = 1e-4) -> None:
        """Wait until the work queued on `device` so far is done, raising RankDiedError if a rank
        exits meanwhile: a collective replayed from a CUDA graph would wait for it for ever."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        while not event.query():
            if any(process.poll() is not None for process in self.processes):
                raise self.error_of(RuntimeError("a rank exited during a CUDA graph replay"))
            time.sleep(poll_s)

    def send(self, plan: object) -> None:
        """`plan` to every other rank: pickled once, written to each pipe (an anonymous pipe to
        a child process rein started, never a socket: nothing else can write what it unpickles)."""
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as exc:
            raise self.error_of(exc) from exc

    def close(self) -> None:
        """Tell the ranks to stop (EOF on their pipes), wait briefly, then kill what is left; leave the group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for conn in self.conns:
            conn.close()
        _end(self.processes, STOP_TIMEOUT_S)
        self.group.close()
        shutil.rmtree(self._rendezvous, ignore_errors=True)


def _expect(conns: list[Connection], processes: list[subprocess.Popen], what: str, timeout_s: float) -> None:
    """Wait for message `what` from every rank (ranks 1.. in `conns` order); RankDiedError
    naming the rank and its reason if one fails, exits or stays silent for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    pending = dict(zip(conns, range(1, len(conns) + 1), strict=True))
    while pending:
        ready = wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RankDiedError(f"tensor-parallel ranks {sorted(pending.values())} did not start within "
                                f"{timeout_s:.0f} s")
        for conn in ready:
            rank = pending.pop(conn)
            try:
                message = conn.recv()
            except (EOFError, OSError):
                message = ("failed", f"exited with code {processes[rank - 1].wait()}")
            if message[0] != what:
                raise RankDiedError(f"tensor-parallel rank {rank} could not start: {message[1]}")


def _end(processes: list[subprocess.Popen], grace_s: float = 0.0) -> None:
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
