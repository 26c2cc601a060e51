"""The all-reduce (and all-gather) of CPU ranks on one host, through shared memory instead of gloo's TCP.

A layer of a tensor-parallel model all-reduces twice, so a SmolLM2-sized model does ~60 small
all-reduces per step. Over gloo (TCP on loopback) each took ~625 us on the 2-core machine
here, ~38 ms a step: more than the split saved. Through shared memory one is a copy, a flag
and a sum (vLLM's CPU backend does the same).

The memory: a file in /dev/shm that rank 0 creates and every rank maps (rank 0 unlinks it
once all have, so nothing is left if a rank dies), holding a flag per rank (int64) and two
buffers of one slot per rank. Call k: each rank copies its tensor into its slot of buffer
k % 2, publishes k in its flag, waits until every flag reads k, then sums the slots in rank
order into its tensor -- the same sum, bit for bit, on every rank. Two buffers make one
barrier per call enough: a rank that writes buffer k % 2 again at call k + 2 has seen every
flag reach k + 1, which each rank sets only after its sum of call k.

A rank that waits for a flag checks, every few thousand reads, whether the other ranks'
processes are alive and whether the group's timeout has passed: a dead peer raises at once,
a hung one after the timeout, as gloo does. Tensors larger than a slot go through gloo, and so
does everything when /dev/shm has not twice the buffers' size free (`available`).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
SLOT_BYTES = 4 * 1024 * 1024   # per rank and buffer: a 1024-token chunk of a 1024-wide float32 model
SPINS_BEFORE_YIELD = 200       # tight reads before giving the core away (ranks may outnumber cores)
CHECK_EVERY = 4096             # reads between liveness and timeout checks


def available(world_size: int) -> bool:
    """Whether /dev/shm can take a group's buffers, with room to spare: a tmpfs that fills up
    kills the process writing to it (SIGBUS), and a container's is small (Docker's: 64 MB)."""
    if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)):
        return False
    stats = os.statvfs(SHM_DIR)
    return stats.f_bavail * stats.f_frsize >= 2 * buffer_bytes(world_size)


def buffer_bytes(world_size: int) -> int:
    return 2 * world_size * SLOT_BYTES


class ShmAllReduce:
    """See the module docstring. Built by every rank of a CPU group, collectively."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, group) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        box = [f"rein-tp-{uuid.uuid4().hex}" if rank == 0 else None, os.getpid()]
        names: list = [None] * world_size
        dist.all_gather_object(names, box, group=group)
        name = names[0][0]
        self.pids = [pid for _, pid in names]
        flags_path, data_path = SHM_DIR / f"{name}.flags", SHM_DIR / f"{name}.data"
        data_bytes = buffer_bytes(world_size)
        if rank == 0:
            for path, size in ((flags_path, 8 * world_size), (data_path, data_bytes)):
                with open(path, "wb") as f:
                    f.truncate(size)
        dist.barrier(group=group)
        self._flags = torch.from_file(str(flags_path), shared=True, size=world_size, dtype=torch.int64)
        self._data = torch.from_file(str(data_path), shared=True, size=data_bytes, dtype=torch.uint8)
        self._data = self._data.view(2, world_size, SLOT_BYTES)
        self._flag_view = self._flags.numpy()
        dist.barrier(group=group)
        if rank == 0:   # every rank has it mapped: the files can go
            flags_path.unlink()
            data_path.unlink()
        self._calls = int(self._flag_view[rank])

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
        self._flag_view[self.rank] = call
        self._wait_for(call)
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
                raise RuntimeError(f"all-reduce: tensor-parallel rank {rank} (pid {pid}) is gone")
        if time.monotonic() - started > self.timeout_s:
            late = [rank for rank in range(self.world_size) if self._flag_view[rank] < call]
            raise RuntimeError(f"all-reduce: ranks {late} did not arrive within {self.timeout_s:.0f} s")


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

