"""The ranks of one tensor-parallel engine: a small wrapper over `torch.distributed`.

A model is built against a group and calls two collectives on it: `all_reduce_` (the
row-parallel projections' partial sums) and `all_gather` (the vocab-parallel logits); the
model runner calls a third, `min_int`, once, so every rank sizes its KV cache alike.
`SINGLE_RANK` answers all three without communicating, so a model built without a group runs
exactly as before. Rank 0's step plans reach the other ranks through pipes, not a collective
(rein.engine.rank_processes): a rank waiting for the next step may wait for hours.

`DistributedGroup` joins N processes, each calling it with its own rank and one shared
`init_method` (`tcp_init_method()`: a free port on this host, or `file_init_method(path)`):
gloo on CPU, NCCL on CUDA (one device per rank). Every collective carries the group's
timeout, so a rank that died or hangs becomes an exception on the others, not a hang:

- gloo: a peer that died closes its connections and the collective raises at once; a peer
  that is alive but never joins raises after the timeout. The model's all-reduces of CPU
  ranks go through shared memory instead (rein.model.parallel.shm_reduce), which checks its
  peers' processes while it waits and keeps the same timeout.
- NCCL: collectives run asynchronously on the GPU, so the calling thread cannot raise; the
  NCCL watchdog aborts the communicator after the timeout and, under PyTorch's default
  TORCH_NCCL_ASYNC_ERROR_HANDLING, ends the process -- which its supervisor sees as a dead
  engine. `min_int` goes through a second, gloo group on the CPU (as vLLM's CPU group).

Every rank is on this host, so the groups listen on the loopback interface only
(`loopback_only`), and only tensors cross them: no object collective (`all_gather_object`,
`broadcast_object_list`), which would unpickle whatever a peer, or anything that reached its
port, sent.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from rein.core.settings import swap_environment
from rein.model.parallel import shm_reduce

# Long enough for a peer to compile its kernels (Triton's first launch) before it reaches a
# collective; a rank that dies outright is noticed sooner (its connections close).
DEFAULT_TIMEOUT_S = 300.0
SYS_NET = "/sys/class/net"
IFF_LOOPBACK = 0x8
LOOPBACK_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class ParallelGroup(Protocol):
    """What a model and the engine need of their ranks."""

    rank: int
    world_size: int

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def min_int(self, value: int) -> int: ...

    def close(self) -> None: ...


class SingleRankGroup:
    """One rank, no communication: every collective returns its input."""

    rank = 0
    world_size = 1

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def min_int(self, value: int) -> int:
        return value

    def close(self) -> None:
        pass


SINGLE_RANK = SingleRankGroup()


def loopback_interface() -> str:
    """The name of this host's loopback network interface ("lo" on Linux)."""
    try:
        for interface in sorted(os.listdir(SYS_NET)):
            flags = int((Path(SYS_NET) / interface / "flags").read_text(), 16)
            if flags & IFF_LOOPBACK:
                return interface
    except (OSError, ValueError):
        pass
    return "lo"


@contextmanager
def loopback_only() -> Iterator[None]:
    """Within it, the gloo and NCCL groups made listen on the loopback interface only.

    Without it gloo listens on the address the host name resolves to (in a container, its
    network address), and NCCL's bootstrap on the first non-loopback interface: reachable
    from other hosts, for a group whose ranks are all on this one. Both read these variables
    when a group is made (torch passes gloo no other way to choose its device); any value the
    environment had is put back after."""
    saved = swap_environment(dict.fromkeys(LOOPBACK_VARIABLES, loopback_interface()))
    try:
        yield
    finally:
        swap_environment(saved)


def tcp_init_method(host: str = "127.0.0.1") -> str:
    """A `tcp://host:port` address on a port free now, for all ranks of one group on this host.
    Chosen before the ranks start (rank 0 then listens on it), so another process could take
    the port in between; `file_init_method` has no such race."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"tcp://{host}:{probe.getsockname()[1]}"


def file_init_method(path: str | Path) -> str:
    """A `file://` address: the ranks meet through a file that must not exist yet (one per group)."""
    return f"file://{Path(path).resolve()}"


class DistributedGroup:
    """This process's rank of `world_size` joined through `init_method`; `close` leaves the group.

    `device` is where the model runs: CPU gives gloo, `cuda:i` gives NCCL on device i (made
    this process's current device). Only one group per process (torch.distributed's default
    group), as each engine rank is its own process."""

    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device | str = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not one of the {world_size} ranks of a group")
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group; "
                               "each tensor-parallel rank runs in its own process")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self._shm: shm_reduce.ShmAllReduce | None = None
        timeout = timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            with loopback_only():
                dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size,
                                        timeout=timeout, device_id=self.device)
                # Host-side agreements (min_int) without a device round trip: a CPU group for them.
                self._cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        elif self.device.type == "cpu":
            with loopback_only():
                dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                        timeout=timeout)
            self._cpu_group = dist.group.WORLD
            # The model's collectives through shared memory: gloo's TCP costs more than the split saves.
            # The ranks decide together (the least of their answers), or their collectives would not meet.
            if world_size > 1 and self.min_int(int(shm_reduce.available(world_size))):
                self._shm = shm_reduce.ShmAllReduce.join(rank, world_size, timeout_s, self._cpu_group)
        else:
            raise ValueError(f"tensor parallelism runs on CPU (gloo) or CUDA (NCCL), not {self.device.type}")

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        if self._shm is not None and self._shm.fits(tensor):
            return self._shm.all_reduce_(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along the last dimension in rank order."""
        tensor = tensor.contiguous()
        if self._shm is not None and self._shm.fits(tensor):
            return self._shm.all_gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (each rank's free memory: the cache size all can hold)."""
        box = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self._cpu_group)
        return int(box.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
