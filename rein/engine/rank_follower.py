"""One rank (1..N-1) of a tensor-parallel engine: `python -m rein.engine.rank_follower FD PID`.

Started by rank 0 (rein.engine.rank_processes) with one end of a pipe as file descriptor FD
and rank 0's pid. It reads its setup from the pipe (the engine configuration with its own
device, its rank and the group's rendezvous), joins the group, loads its shard of the model
and KV cache (on CUDA capturing the same decode graphs as rank 0, in the same order), says ready,
then runs every plan the pipe brings (ModelRunner.follow: a decode step replays the graph mode
the plan names) until the pipe closes: rank 0 stopped, or died.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

log = logging.getLogger("rein.engine.rank_follower")

PARENT_CHECK_SECONDS = 1.0


def watch_parent(parent_pid: int) -> None:
    """Exit when rank 0's process is gone, even while this rank waits inside a collective (an
    NCCL wait does not end when a peer dies); the pipe's EOF covers the idle case."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="rein-tp-parent", daemon=True).start()


def serve_rank(conn: Connection, parent_pid: int) -> int:
    # A terminal's Ctrl-C or a `kill` of the process group reaches every rank: rank 0 decides.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_parent(parent_pid)
    config, rank, init_method, log_level = conn.recv()
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    try:
        import torch

        from rein.engine.model_runner import ModelRunner
        from rein.engine.rank_processes import cpu_threads_per_rank
        from rein.model.files import resolve_model
        from rein.model.implementation import spec_for
        from rein.model.parallel.group import DistributedGroup

        if config.torch_device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(config.tensor_parallel_size))
        conn.send(("joining", None))   # rank 0 waits for this before it joins (RankProcesses.start)
        group = DistributedGroup(rank, config.tensor_parallel_size, init_method, config.torch_device)
        files = resolve_model(config.model, revision=config.revision)
        runner = ModelRunner(config, files, spec_for(files.directory, config.model_impl, config.trust_remote_code),
                             group)
    except BaseException as exc:   # noqa: BLE001 - rank 0 reports it
        log.exception("rank %d could not start", rank)
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return 1
    conn.send(("ready", None))
    try:
        while True:
            runner.follow(conn.recv())
    except EOFError:   # rank 0 closed the pipe: stopped or gone
        return 0
    except Exception as exc:   # noqa: BLE001 - e.g. an adapter this rank could not read: rank 0 names it
        log.exception("rank %d failed a step", rank)
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return 1
    finally:
        group.close()


def main() -> int:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    return serve_rank(Connection(fd), parent_pid)


if __name__ == "__main__":
    sys.exit(main())
