"""The all-reduce (and all-gather) of CPU ranks on one host, through shared memory instead of gloo's TCP.

A layer of a tensor-parallel model all-reduces twice, so a SmolLM2-sized model does ~60 small
all-reduces per step. Over gloo (TCP on loopback) each took ~625 us on the 2-core machine
here, ~38 ms a step: more than the split saved. Through shared memory one is a copy, a flag
and a sum (vLLM's CPU backend does the same).

The memory: an anonymous memfd that rank 0 makes and every rank maps (see
rein.model.parallel.shared_memory: no name in /dev/shm, mode 0600, pages reserved, nothing
left behind), holding a flag per rank (int64) and two buffers of one slot per rank. Call k:
each rank copies its tensor into its slot of buffer k % 2, publishes k in its flag, waits
until every flag reads k, then sums the slots in rank order into its tensor -- the same sum,
bit for bit, on every rank. Two buffers make one barrier per call enough: a rank that writes
buffer k % 2 again at call k + 2 has seen every flag reach k + 1, which each rank sets only
after its sum of call k.

Memory order: a weakly ordered CPU (ARM, POWER) may make a rank's flag visible to another core
before the data written ahead of it, and may read a peer's slot ahead of the flag that says it
is there. `_exchange` puts a release fence between its data and its flag, and an acquire fence
between the flags it waited for and the data it reads (shared_memory's fences; nothing to do
on x86's total store order). That is C11's fence-to-fence synchronization: the flags are
aligned 8-byte words, read and written whole by one instruction on every 64-bit CPU, and a
rank that reads a peer's flag k after its acquire fence sees everything the peer wrote before
its release fence -- torch's copy and sum included when they run on several threads, whose
work the calling thread joins before its fence (and starts after its fence) through OpenMP's
own synchronization. The same fences order the reuse of a buffer: a rank's reads of call k's
slots come before its flag k + 1 (release), and a writer's stores at call k + 2 after its read
of that flag (acquire).

The ranks agree on the memory through plain integer tensors (rank 0's pid, descriptor and a
random token; every rank's pid): nothing received from a peer is unpickled, and what rank 0
names is checked before it is mapped. A rank that cannot map it makes the whole group use
gloo (a warning says why); memory that rank 0 cannot reserve is an error on every rank.

A rank that waits for a flag checks, every few thousand reads, whether the other ranks'
processes are alive and whether the group's timeout has passed: a dead peer raises at once,
a hung one after the timeout, as gloo does. Tensors larger than a slot go through gloo.
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist

from rein.model.parallel import shared_memory
from rein.model.parallel.shared_memory import SharedMemoryError

log = logging.getLogger(__name__)

SLOT_BYTES = 4 * 1024 * 1024   # per rank and buffer: a 1024-token chunk of a 1024-wide float32 model
FLAGS_BYTES = 4096             # the flags' page, ahead of the buffers
MAX_RANKS = FLAGS_BYTES // 8
SPINS_BEFORE_YIELD = 200       # tight reads before giving the core away (ranks may outnumber cores)
CHECK_EVERY = 4096             # reads between liveness and timeout checks


def available(world_size: int) -> bool:
    """Whether this rank can take part in shared-memory collectives of `world_size` ranks (memfd,
    /proc, and the fences this CPU needs); the ranks then agree on the least of their answers."""
    return 1 < world_size <= MAX_RANKS and shared_memory.supported() and shared_memory.fences_available()


def buffer_bytes(world_size: int) -> int:
    return 2 * world_size * SLOT_BYTES


def memory_bytes(world_size: int) -> int:
    """The shared memory a group of `world_size` ranks maps: its flags and its two buffers."""
    return FLAGS_BYTES + buffer_bytes(world_size)


class ShmAllReduce:
    """See the module docstring. Built by every rank of a CPU group, collectively, with `join`."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, pids: list[int], memory) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.pids = pids
        self._memory = memory   # the mapping: the views below keep it alive
        self._flag_view = np.frombuffer(memory, dtype=np.int64, count=world_size)
        self._data = torch.frombuffer(memory, dtype=torch.uint8, offset=FLAGS_BYTES,
                                      count=buffer_bytes(world_size)).view(2, world_size, SLOT_BYTES)
        self._calls = int(self._flag_view[rank])

    @classmethod
    def join(cls, rank: int, world_size: int, timeout_s: float, group) -> ShmAllReduce | None:
        """This rank's part of the group's shared memory, made by rank 0 and mapped by all; None
        (on every rank) when some rank could not map it. SharedMemoryError on every rank when
        rank 0 cannot reserve it. Every rank of `group` calls it together."""
        nbytes = memory_bytes(world_size)
        fd, token, failure = -1, 0, None
        if rank == 0:
            token = secrets.randbits(63)
            try:
                fd = shared_memory.create(nbytes, token)
            except SharedMemoryError as exc:
                failure = exc
        memory, reason = None, ""
        try:
            mine = torch.tensor([os.getpid(), fd, token], dtype=torch.int64)
            rows = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(rows, mine, group=group)
            pids = [int(row[0]) for row in rows]
            creator_fd, token = int(rows[0][1]), int(rows[0][2])
            if failure is not None:
                raise failure
            if creator_fd < 0:
                raise SharedMemoryError("tensor parallel: rank 0 could not reserve the shared memory of the CPU "
                                        "ranks' all-reduce (rank 0's error says how much it needed and had)")
            try:
                if rank != 0:
                    fd = shared_memory.open_peer(pids[0], creator_fd, token, nbytes)
                memory = shared_memory.map_shared(fd, nbytes)
            except (SharedMemoryError, OSError) as exc:
                reason = str(exc)
            # The barrier: rank 0 holds its descriptor until every rank has its own mapping (or
            # has failed to); after it, only the mappings (each with the duplicate descriptor
            # Python's mmap keeps) refer to the memory.
            mapped = torch.tensor([int(memory is not None)], dtype=torch.int64)
            dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=group)
        finally:
            if fd >= 0:
                os.close(fd)
        if not mapped.item():
            log.warning("tensor parallel: the CPU ranks' all-reduces go through gloo, not shared memory: %s",
                        reason or "another rank could not map rank 0's shared memory (its warning says why)")
            if memory is not None:
                memory.close()
            return None
        return cls(rank, world_size, timeout_s, pids, memory)

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= SLOT_BYTES and tensor.is_contiguous()

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` (contiguous, at most a slot) over the ranks, in place; returns it."""
        torch.sum(self._exchange(tensor), dim=0, out=tensor.view(-1))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (contiguous, at most a slot), concatenated along the last dimension."""
        parts = self._exchange(tensor).view(self.world_size, *tensor.shape)
        return torch.cat(parts.unbind(0), dim=-1)

    def _exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, flattened, as a [world_size, numel] view of this call's buffer
        (valid until this rank's call after next)."""
        self._calls += 1
        call = self._calls
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self._data[call % 2]
        buffer[self.rank, :nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        shared_memory.release_fence()   # the slot (and this rank's reads of call - 1) before the flag
        self._flag_view[self.rank] = call
        self._wait_for(call)
        shared_memory.acquire_fence()   # every flag read as `call` before the slots they publish
        return buffer[:, :nbytes].view(tensor.dtype)

    def _wait_for(self, call: int) -> None:
        flags = self._flag_view
        reads = 0
        started = None
        while flags.min() < call:
            reads += 1
            if reads > SPINS_BEFORE_YIELD:
                os.sched_yield()
            if reads % CHECK_EVERY == 0:
                started = started or time.monotonic()
                self._check_peers(call, started)

    def _check_peers(self, call: int, started: float) -> None:
        for rank, pid in enumerate(self.pids):
            if self._flag_view[rank] < call and not process_alive(pid):
                raise PeerGone(rank, pid)
        if time.monotonic() - started > self.timeout_s:
            late = [rank for rank in range(self.world_size) if self._flag_view[rank] < call]
            raise RuntimeError(f"all-reduce: ranks {late} did not arrive within {self.timeout_s:.0f} s")


class PeerGone(RuntimeError):
    """A rank of the group ended while the others waited for it in an all-reduce."""

    def __init__(self, rank: int, pid: int) -> None:
        super().__init__(f"all-reduce: tensor-parallel rank {rank} (pid {pid}) is gone")
        self.rank = rank
        self.pid = pid


def process_alive(pid: int) -> bool:
    """Whether process `pid` is running (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

