"""Memory that only the ranks of one tensor-parallel group can reach, and the fences that order it.

Rank 0 makes an anonymous file (`memfd_create`), not a file in /dev/shm: it has no name on any
file system, so another user of the host or of the IPC namespace can neither list nor open it
(it is mode 0600 besides), and nothing is ever left behind -- the kernel frees it with the last
descriptor or mapping, however the ranks end, SIGKILL at any point included. A named file
would stay if its creator were killed between creating and unlinking it. Its pages are
reserved at once (`posix_fallocate`): a sparse file takes them at first touch, and a tmpfs or a
memory cgroup that is full then kills the process touching them (SIGBUS); here the shortage
is an error at start-up that says how much was needed and how much there is.

The other ranks open it through `/proc/<rank 0's pid>/fd/<fd>` while rank 0 holds the
descriptor. That works however the ranks were started (rein's follower processes, a test's
spawned ones) with nothing to pass but two integers, where handing a descriptor over needs
a Unix socket or the process's birth; and the kernel allows the open only to a process that
may read rank 0's memory anyway (same user, ptrace read access). What a peer opens is checked
before it is mapped (`open_peer`): a memfd named after the group's random token, of the
expected size, owned by this user, linked nowhere -- so a wrong or stale pid or descriptor is
an error, never another process's memory.

The fences (`release_fence`, `acquire_fence`) order the data a rank writes before the flag
that publishes it, and the flags a rank reads before the data it then reads: see
rein.model.parallel.shm_reduce for the protocol and why it needs them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import stat
from collections.abc import Callable
from functools import partial
from pathlib import Path

NAME_PREFIX = "rein-tp-"
MODE = 0o600

# C11's memory orders, as libatomic's atomic_thread_fence takes them.
_ACQUIRE, _RELEASE = 2, 3
# Total store order: a store is never seen before an earlier store, a load never passes an earlier
# load, and neither moves across a later store -- all a fence would add here (shm_reduce).
_TSO_MACHINES = ("x86_64", "amd64", "i386", "i686")


class SharedMemoryError(RuntimeError):
    """The ranks' shared memory could not be made or opened (the message says why and what to do)."""


def _load_fences() -> tuple[Callable[[], None], Callable[[], None]] | None:
    """(release, acquire) fences: nothing to do on a TSO machine (x86: a C compiler emits no
    instruction for either); elsewhere (ARM, POWER, RISC-V) libatomic's atomic_thread_fence, GCC's
    runtime, present wherever gcc is (as in rein's image); None where neither applies."""
    if platform.machine().lower() in _TSO_MACHINES:
        return (lambda: None), (lambda: None)
    return libatomic_fences()


def libatomic_fences() -> tuple[Callable[[], None], Callable[[], None]] | None:
    """(release, acquire) through libatomic's atomic_thread_fence; None without libatomic."""
    for name in ("libatomic.so.1", "libatomic.so"):
        try:
            fence = ctypes.CDLL(name).atomic_thread_fence
        except (OSError, AttributeError):
            continue
        fence.argtypes, fence.restype = [ctypes.c_int], None
        return partial(fence, _RELEASE), partial(fence, _ACQUIRE)
    return None


_fences = _load_fences()


def fences_available() -> bool:
    """Whether this machine has the fences the shared-memory protocol needs (else: gloo)."""
    return _fences is not None


def release_fence() -> None:
    """Every load and store before it is visible to another CPU before any store after it."""
    _fences[0]()


def acquire_fence() -> None:
    """No load or store after it happens before the loads before it."""
    _fences[1]()


def supported() -> bool:
    """Whether this system has what `create` and `open_peer` use (Linux: memfd and /proc)."""
    return hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir()


def create(nbytes: int, token: int) -> int:
    """A new private memfd of `nbytes`, its pages reserved, named after `token`; its descriptor.
    SharedMemoryError, with the sizes, when the memory cannot be reserved."""
    fd = os.memfd_create(memfd_name(token), os.MFD_CLOEXEC)
    try:
        os.fchmod(fd, MODE)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        raise SharedMemoryError(reserve_failure(nbytes, exc)) from exc
    return fd


def reserve_failure(nbytes: int, exc: OSError) -> str:
    free = available_memory()
    free_text = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
    return (f"tensor parallel: could not reserve {nbytes / 2**20:.1f} MiB of shared memory for the CPU ranks' "
            f"all-reduce ({exc.strerror or exc}); memory available: {free_text}. It is an anonymous memfd, "
            f"shared memory like /dev/shm's but not limited by /dev/shm's size: it counts against the "
            f"machine's memory and the container's memory limit. Free memory, raise the limit, or run fewer "
            f"ranks (--tensor-parallel-size)")


def available_memory() -> int | None:
    """Bytes of memory this process could still take: the kernel's MemAvailable, or less under a
    cgroup v2 memory limit; None when /proc does not say."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        free = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        cgroup = Path("/proc/self/cgroup").read_text().splitlines()[0].partition("::")[2]
        directory = Path("/sys/fs/cgroup") / cgroup.lstrip("/")
        limit = (directory / "memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int((directory / "memory.current").read_text()))
    except (OSError, IndexError, ValueError):
        pass
    return max(0, free)


def open_peer(pid: int, fd: int, token: int, nbytes: int) -> int:
    """Open rank 0's memory (descriptor `fd` of process `pid`, made by `create(nbytes, token)`);
    this process's own descriptor of it. SharedMemoryError if it is anything else."""
    if not (isinstance(pid, int) and isinstance(fd, int) and pid > 0 and fd >= 0 and 0 <= token < 2**63):
        raise SharedMemoryError(f"tensor parallel: rank 0 sent an invalid shared-memory address "
                                f"(pid {pid}, descriptor {fd}, token {token})")
    path = f"/proc/{pid}/fd/{fd}"
    expected = f"/memfd:{memfd_name(token)} (deleted)"
    try:
        ours = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise SharedMemoryError(f"tensor parallel: cannot open rank 0's shared memory at {path}: {exc}") from exc
    try:
        # What was opened, not what the path named a moment before (the descriptor may have changed).
        name = os.readlink(f"/proc/self/fd/{ours}")
        info = os.fstat(ours)
        problem = ("it is not this group's memory" if name != expected else
                   "it is not a regular file" if not stat.S_ISREG(info.st_mode) else
                   "it has a name on a file system" if info.st_nlink != 0 else
                   "another user owns it" if info.st_uid != os.geteuid() else
                   f"its mode is {stat.S_IMODE(info.st_mode):o}, not {MODE:o}" if stat.S_IMODE(info.st_mode) != MODE else
                   f"it holds {info.st_size} bytes, not {nbytes}" if info.st_size != nbytes else "")
    except OSError as exc:
        problem = str(exc)
    if problem:
        os.close(ours)
        raise SharedMemoryError(f"tensor parallel: {path} is not rank 0's shared memory: {problem}")
    return ours


def map_shared(fd: int, nbytes: int) -> mmap.mmap:
    """`fd`'s `nbytes`, mapped shared and writable (the mapping outlives the descriptor)."""
    return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def memfd_name(token: int) -> str:
    return f"{NAME_PREFIX}{token:016x}"
