"""The CPU ranks' shared memory and gloo group are private to the engine (rein.model.parallel).

In this process: the memory rank 0 makes is a nameless memfd of mode 0600 with its pages
reserved, a reservation that fails says how much was needed and how much there is, and a peer
opens only its group's memory (another pid, descriptor, token, size or mode is refused).
Across two spawned ranks, with unpickling made to fail in both and gloo told by the
environment to use a non-loopback interface (what it does by default where the host name
resolves to the network address): the collectives work, through a memfd mapping and nothing in
/dev/shm, and gloo listens on loopback only. A rank SIGKILLed at the setup barrier, the creator
of the memory or its peer, makes the other raise, and leaves nothing behind.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import ipaddress
import multiprocessing
import os
import pickle
import signal
import socket
import stat
import struct
import time
from pathlib import Path

import pytest
import torch

from rein.model.parallel import DistributedGroup, file_init_method, shared_memory
from rein.model.parallel.shared_memory import SharedMemoryError
from rein.model.parallel.shm_reduce import process_alive

SIOCGIFADDR = 0x8915


def memfds(prefix: str = "/memfd:rein-tp-") -> list[str]:
    """This process's descriptors of rein's shared memory."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            name = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if name.startswith(prefix):
            names.append(name)
    return names


def rein_files_in_dev_shm() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("rein")}


# -- the memory, in this process ---------------------------------------------------------------

def test_the_memory_is_nameless_private_and_reserved():
    fd = shared_memory.create(1 << 20, token=0x1234)
    try:
        info = os.fstat(fd)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_nlink == 0, "the memory has a name on a file system"
        assert os.readlink(f"/proc/self/fd/{fd}") == "/memfd:rein-tp-0000000000001234 (deleted)"
        assert info.st_size == 1 << 20
        assert info.st_blocks * 512 >= 1 << 20, "the pages are not reserved (a sparse file)"
    finally:
        os.close(fd)


def test_memory_that_cannot_be_reserved_is_an_error_with_the_sizes(monkeypatch):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(shared_memory, "available_memory", lambda: 5 * 2**20)
    with pytest.raises(SharedMemoryError) as info:
        shared_memory.create(48 * 2**20, token=0xdead)
    message = str(info.value)
    assert "48.0 MiB" in message and "available: 5.0 MiB" in message
    assert "/dev/shm" in message and os.strerror(errno.ENOSPC) in message
    assert "--tensor-parallel-size" in message
    assert memfds("/memfd:rein-tp-000000000000dead") == [], "the descriptor was left open"


def test_available_memory_reads_this_machine():
    free = shared_memory.available_memory()
    assert free is not None and free > 2**20


def test_a_peer_opens_only_its_groups_memory(tmp_path):
    nbytes = 1 << 16
    me = os.getpid()
    # Another test in this worker process may still hold a group's mapping (until it is
    # collected): count only the descriptors this test makes.
    before = set(memfds())
    ours, other = shared_memory.create(nbytes, token=7), shared_memory.create(nbytes, token=8)
    plain = os.open(tmp_path / "plain", os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(plain, nbytes)
    try:
        peer = shared_memory.open_peer(me, ours, 7, nbytes)
        try:
            mine, theirs = shared_memory.map_shared(ours, nbytes), shared_memory.map_shared(peer, nbytes)
            mine[100:104] = b"rein"
            assert theirs[100:104] == b"rein"   # one memory, two mappings
            mine.close()
            theirs.close()
        finally:
            os.close(peer)
        refused = [
            ((me, ours, 8, nbytes), "not this group's memory"),      # the token of another group
            ((me, other, 7, nbytes), "not this group's memory"),     # another group's memory
            ((me, plain, 7, nbytes), "not this group's memory"),     # a file
            ((me, ours, 7, 2 * nbytes), f"holds {nbytes} bytes"),
            ((me, 10**6, 7, nbytes), "cannot open"),                 # no such descriptor
            ((-1, ours, 7, nbytes), "invalid"),
            ((me, -3, 7, nbytes), "invalid"),
            ((me, ours, -7, nbytes), "invalid"),
        ]
        for address, reason in refused:
            with pytest.raises(SharedMemoryError, match=reason):
                shared_memory.open_peer(*address)
        os.fchmod(ours, 0o644)
        with pytest.raises(SharedMemoryError, match="mode is 644"):
            shared_memory.open_peer(me, ours, 7, nbytes)
        made = sorted(set(memfds()) - before)
        assert made == ["/memfd:rein-tp-0000000000000007 (deleted)", "/memfd:rein-tp-0000000000000008 (deleted)"]
    finally:
        for fd in (ours, other, plain):
            os.close(fd)


def test_the_fences_run():
    shared_memory.release_fence()
    shared_memory.acquire_fence()
    fences = shared_memory.libatomic_fences()   # what weakly ordered CPUs use
    if fences is None:
        pytest.skip("no libatomic here")
    for fence in fences:
        fence()


# -- two ranks ---------------------------------------------------------------------------------

def non_loopback_ipv4_interface() -> str | None:
    """An interface of this host with an IPv4 address that is not loopback, if any."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()))
            except OSError:
                continue
            if not ipaddress.ip_address(packed[20:24]).is_loopback:
                return name
    finally:
        probe.close()
    return None


def listening_addresses() -> list[str]:
    """The addresses this process's TCP sockets listen on (from /proc/net/tcp and tcp6)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table in ("tcp", "tcp6"):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:   # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # The kernel prints each 32-bit word in host (little-endian) order.
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                address = ipaddress.ip_address(words)
                addresses.append(str(getattr(address, "ipv4_mapped", None) or address))
    return addresses


def refuse_unpickling() -> None:
    def refused(*args, **kwargs):
        raise AssertionError("something was unpickled")

    import torch.distributed.distributed_c10d as c10d

    pickle.loads = pickle.load = refused
    pickle.Unpickler = c10d._unpickler = refused


def observe_rank(rank: int, init_method: str, interface: str | None, out) -> None:
    """One of two ranks: the group's collectives under `refuse_unpickling`, with gloo pointed at
    `interface` by the environment; reports what it saw (its mappings of rein's memory or of
    /dev/shm, but for the semaphores of this test's own queue)."""
    torch.set_num_threads(1)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    refuse_unpickling()
    group = DistributedGroup(rank, 2, init_method, timeout_s=60)
    try:
        report = {
            "shared memory": group._shm is not None,
            "sum": group.all_reduce_(torch.arange(6.0) * (rank + 1)).tolist(),
            "gathered": group.all_gather(torch.full((1, 2), float(rank))).tolist(),
            "smallest": group.min_int(10 + rank),
            "mappings": [line.split(maxsplit=5)[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                         if "rein-tp" in line or ("/dev/shm/" in line and "/dev/shm/sem.mp-" not in line)],
            "listening": listening_addresses(),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME"),
            "descriptors": memfds(),
        }
        out.put((rank, report))
        group.all_reduce_(torch.ones(1))   # both have reported before either leaves
    finally:
        group.close()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> tuple[str | None, dict[int, dict]]:
    interface = non_loopback_ipv4_interface()
    before = rein_files_in_dev_shm()
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    init_method = file_init_method(tmp_path_factory.mktemp("private") / "rendezvous")
    ranks = [context.Process(target=observe_rank, args=(rank, init_method, interface, out)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        seen = dict(out.get(timeout=180) for _ in ranks)
        for process in ranks:
            process.join(timeout=60)
            assert process.exitcode == 0, f"a rank ended with exit code {process.exitcode}"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
    assert rein_files_in_dev_shm() <= before
    return interface, seen


def test_the_collectives_work_without_unpickling_anything(reports):
    _, seen = reports
    for rank in (0, 1):
        assert seen[rank]["shared memory"], "the group fell back to gloo"
        assert seen[rank]["sum"] == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
        assert seen[rank]["gathered"] == [[0.0, 0.0, 1.0, 1.0]]
        assert seen[rank]["smallest"] == 10


def test_the_ranks_map_a_memfd_and_nothing_in_dev_shm(reports):
    _, seen = reports
    for rank in (0, 1):
        mappings = seen[rank]["mappings"]
        assert mappings and all(m.startswith("/memfd:rein-tp-") and m.endswith("(deleted)") for m in mappings), mappings
        # The setup's descriptors are closed; Python's mmap keeps a duplicate of its own.
        assert seen[rank]["descriptors"] == mappings, "a descriptor of the setup was left open"
    assert seen[0]["mappings"] == seen[1]["mappings"]   # the same memory (its name carries the token)


def test_gloo_listens_on_loopback_only(reports):
    interface, seen = reports
    for rank in (0, 1):
        listening = seen[rank]["listening"]
        assert listening, "no listening socket found: /proc/net/tcp does not show this rank's"
        assert all(ipaddress.ip_address(a).is_loopback for a in listening), (rank, listening, interface)
        # The environment is put back as it was.
        assert seen[rank]["GLOO_SOCKET_IFNAME"] == interface


# -- a rank killed at the setup barrier -----------------------------------------------------

def die_at_barrier(rank: int, init_method: str, victim: int, out) -> None:
    """Rank 1 reports when it reaches the memory rank 0 made (rank 0 then waits at the barrier,
    holding it) and dies there when it is the victim; otherwise it waits until the test has
    killed rank 0, then goes on. The survivor reports what it raised and what it still holds."""
    torch.set_num_threads(1)
    real_open_peer = shared_memory.open_peer

    def open_peer(pid: int, fd: int, token: int, nbytes: int) -> int:
        out.put(("at the barrier", rank))
        if victim == 1:
            out.close()
            out.join_thread()   # the message is out before the process goes
            os.kill(os.getpid(), signal.SIGKILL)
        while process_alive(pid):
            time.sleep(0.05)
        return real_open_peer(pid, fd, token, nbytes)

    shared_memory.open_peer = open_peer
    start = time.monotonic()
    try:
        DistributedGroup(rank, 2, init_method, timeout_s=20)
        outcome = "no error"
    except Exception as error:   # whatever torch.distributed raises: the point is that it does
        outcome = f"{type(error).__name__}: {error}"
        del error
    waited = time.monotonic() - start
    gc.collect()
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if "rein-tp" in line]
    out.put((outcome, waited, memfds(), maps))


@pytest.mark.parametrize("victim", [0, 1], ids=["creator killed", "peer killed"])
def test_a_rank_killed_at_the_barrier_leaves_nothing(victim, tmp_path):
    before = rein_files_in_dev_shm()
    context = multiprocessing.get_context("spawn")
    # A queue per rank: a rank killed while its queue's feeder holds the shared write lock
    # would block the other's reports on one queue.
    queues = [context.Queue() for _ in range(2)]
    init_method = file_init_method(tmp_path / "rendezvous")
    ranks = [context.Process(target=die_at_barrier, args=(rank, init_method, victim, queues[rank]))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        assert queues[1].get(timeout=180) == ("at the barrier", 1)
        if victim == 0:
            time.sleep(0.5)   # rank 0 is in the barrier's collective, its memory made
            os.kill(ranks[0].pid, signal.SIGKILL)
        ranks[victim].join(timeout=30)
        assert ranks[victim].exitcode == -signal.SIGKILL
        outcome, waited, descriptors, maps = queues[1 - victim].get(timeout=120)
        assert outcome != "no error", "the surviving rank's setup did not fail"
        assert waited < 60, f"the survivor waited {waited:.1f} s ({outcome})"
        assert descriptors == [] and maps == [], "the survivor still holds the shared memory"
        survivor = ranks[1 - victim]
        survivor.join(timeout=30)
        assert survivor.exitcode == 0
        assert rein_files_in_dev_shm() <= before, "files left in /dev/shm"
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
