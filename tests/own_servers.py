"""Servers of a test's own: a Redis server and a PostgreSQL cluster on free ports in a temp
dir, so that killing them touches nothing else (never the machine's own services). The fault
tests (e2e/chaos_support.py, bench/chaos.py, bench/soak.py) and the integration tests that lose
Redis under a client (test_channel_listener.py) start them.

`RedisServer` keeps nothing on disk unless asked (`aof=True`: an append-only file, fsynced
every second, that a restart reloads): without it a restart comes back empty, as a Redis
without AOF does after a crash or a failover. `PostgresCluster` is made with initdb (as the `postgres`
user when the tests run as root, which initdb refuses) and started and stopped with pg_ctl.
A missing server binary skips the test, and fails it under CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
from support import free_port, wait_for


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        message = f"{tool} is not installed: these tests start their own servers"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


class RedisServer:
    def __init__(self, directory: Path, aof: bool = False, extra_args: tuple[str, ...] = ()) -> None:
        """`extra_args`: more redis-server options (a replica's `--replicaof HOST PORT`)."""
        self.binary = _need("redis-server")
        self.directory = directory
        self.aof = aof
        self.extra_args = extra_args
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        log = open(self.directory / "redis.log", "ab")  # noqa: SIM115 (the server keeps it)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes" if self.aof else "no", "--appendfsync", "everysec",
             "--dir", str(self.directory), *self.extra_args], stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._answers, 20, f"redis-server on port {self.port}", interval=0.05)

    def _answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(port=self.port, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        """SIGKILL: whatever it held is lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill()


class RedisSentinelGroup:
    """A Redis primary, one replica (`--replicaof`) and three `redis-server --sentinel`
    processes (quorum 2) watching them as master `MASTER_NAME`, quick to fail over: the primary
    is down after `down_after_ms` without an answer, a failover retried after `failover_timeout_ms`.
    `url` is rein's `redis+sentinel://` form; `start` returns once the sentinels know the
    replica and each other, so a failover can start as soon as the primary dies."""

    MASTER_NAME = "reinmaster"

    def __init__(self, directory: Path, sentinels: int = 3, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 3000) -> None:
        self.directory = directory
        # Diskless full sync: the replica is in sync in milliseconds, nothing written to disk.
        sync = ("--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0")
        self.primary = RedisServer(directory / "primary", extra_args=sync)
        self.replica = RedisServer(directory / "replica",
                                   extra_args=("--replicaof", "127.0.0.1", str(self.primary.port), *sync))
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.sentinel_procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.MASTER_NAME}/0"

    def start(self) -> None:
        self.primary.start()
        self.replica.start()
        binary = _need("redis-server")
        for n, port in enumerate(self.sentinel_ports):
            where = self.directory / f"sentinel{n}"
            where.mkdir(parents=True, exist_ok=True)
            config = where / "sentinel.conf"     # a sentinel rewrites its config: a file of its own
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {where}\n"
                f"sentinel monitor {self.MASTER_NAME} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER_NAME} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.MASTER_NAME} {self.failover_timeout_ms}\n"
                f"sentinel parallel-syncs {self.MASTER_NAME} 1\n")
            log = open(where / "sentinel.log", "ab")  # noqa: SIM115 (the server keeps it)
            self.sentinel_procs.append(subprocess.Popen([binary, str(config), "--sentinel"],
                                                        stdout=log, stderr=subprocess.STDOUT))
        wait_for(self._ready, 40, "the sentinels to know the replica and each other", interval=0.1)

    def _sentinel(self, port: int):
        import redis

        return redis.Redis(port=port, socket_connect_timeout=1, socket_timeout=2, decode_responses=True)

    def _ready(self) -> bool:
        import redis

        try:
            for port in self.sentinel_ports:
                with self._sentinel(port) as sentinel:
                    replicas = sentinel.execute_command("SENTINEL", "REPLICAS", self.MASTER_NAME)
                    others = sentinel.execute_command("SENTINEL", "SENTINELS", self.MASTER_NAME)
                    if not replicas or len(others) < len(self.sentinel_ports) - 1:
                        return False
                    if any("disconnected" in str(r) or "s_down" in str(r) for r in replicas):
                        return False
            with redis.Redis(port=self.replica.port, socket_connect_timeout=1) as replica:
                return replica.info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def master_port(self) -> int | None:
        """The master's port as the first sentinel that answers reports it."""
        import redis

        for port in self.sentinel_ports:
            try:
                with self._sentinel(port) as sentinel:
                    address = sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER_NAME)
                    return int(address[1]) if address else None
            except redis.RedisError:
                continue
        return None

    def stop(self) -> None:
        for proc in self.sentinel_procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
        self.primary.stop()
        self.replica.stop()


class PostgresCluster:
    """A cluster in a new directory of the system's temp dir (which the `postgres` user can
    reach, unlike a root-owned pytest temp dir), removed by `destroy`."""

    def __init__(self) -> None:
        self.initdb, self.pg_ctl = _need("initdb"), _need("pg_ctl")
        self.directory = Path(tempfile.mkdtemp(prefix="rein-pg-"))
        self.data = self.directory / "data"
        self.port = free_port()

    @property
    def url(self) -> str:
        """The maintenance database, as the e2e harness wants it."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str, timeout: float = 60) -> None:
        command = list(args)
        if os.geteuid() == 0:       # initdb and postgres refuse to run as root
            command = ["runuser", "-u", "postgres", "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def create(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres")
        self._run(self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()

    def start(self) -> None:
        # fsync off: a test cluster, thrown away after the run.
        self._run(self.pg_ctl, "-D", str(self.data), "-l", str(self.directory / "postgres.log"), "-w", "-o",
                  f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.directory} "
                  f"-c fsync=off -c max_connections=200", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(self.pg_ctl, "-D", str(self.data), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop("immediate")
        except RuntimeError:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)
