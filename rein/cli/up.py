"""`rein up`: migrate, then run the API and one worker together (for local use).

It upgrades the database (as `rein migrate`), then starts `rein api` and
`rein worker --model <the first served model>` as child processes and forwards their
output, each line prefixed with `api |` or `worker |`. Ctrl-C, SIGTERM or SIGHUP stops both
(SIGTERM, then SIGKILL for a child still running after 15 s) and exits 0; if either child
exits on its own, the other is stopped and `rein up` exits 1. Needs REIN_MODELS, Postgres
and Redis, like the commands it runs.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from rein.core.settings import SettingsError, load_settings

STOP_TIMEOUT_SECONDS = 15.0
_POLL_SECONDS = 0.2


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("up", help="migrate, then run the API and a worker (local use)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="address the API listens on (default: REIN_API_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port the API listens on (default: REIN_API_PORT)")
    parser.set_defaults(func=run)


class _Child:
    """A child `rein` process whose merged stdout/stderr is forwarded line by line with a prefix."""

    def __init__(self, name: str, argv: list[str], out: IO[str], lock: threading.Lock, width: int) -> None:
        self.name = name
        # The child inherits the environment (its REIN_* settings); -u: unbuffered output.
        # Its own session: a terminal's Ctrl-C reaches only `rein up`, which then stops the
        # children in order (SIGTERM, a grace period, SIGKILL) instead of all at once.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-u", "-m", "rein.cli.main", *argv], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            text=True, errors="replace", bufsize=1)
        self._prefix = f"{name:<{width}} | "
        self._out, self._lock = out, lock
        self._thread = threading.Thread(target=self._forward, name=f"rein-up-{name}", daemon=True)
        self._thread.start()

    def _forward(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self._out.write(self._prefix + line if line.endswith("\n") else self._prefix + line + "\n")
                self._out.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.alive():
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass

    def finish(self) -> None:
        """Reap the process and drain what it printed."""
        self.proc.wait()
        self._thread.join(timeout=5)


def stop_children(children: list[_Child], timeout: float = STOP_TIMEOUT_SECONDS) -> None:
    """SIGTERM every live child, wait up to `timeout` s for all, SIGKILL what is left, reap all."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout
    while any(c.alive() for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    for child in children:
        if child.alive():
            print(f"rein up: {child.name} did not stop within {timeout:.0f} s; killing it",
                  file=sys.stderr, flush=True)
            child.kill()
    for child in children:
        child.finish()


def run(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("api_host", args.host), ("api_port", args.port)) if v is not None}
    try:
        settings = load_settings(**overrides)
        model = settings.default_model
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        from rein.store.migrate import upgrade  # SQLAlchemy and Alembic: not at start-up

        report = upgrade(settings)
    except Exception as exc:  # an unreachable server or a bad URL: one line, not a traceback
        print(f"error: cannot migrate the database: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    state = "already current" if report.before == report.after else f"{report.before or 'empty'} -> {report.after}"
    print(f"rein up: database {report.database} at revision {report.after} ({state})", flush=True)

    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    lock = threading.Lock()
    children: list[_Child] = []
    try:
        width = len("worker")
        children.append(_Child("api", ["api", "--host", settings.api_host, "--port", str(settings.api_port)],
                               sys.stdout, lock, width))
        children.append(_Child("worker", ["worker", "--model", model.name], sys.stdout, lock, width))
        for child in children:
            print(f"rein up: started {child.name} (pid {child.proc.pid})", flush=True)
        print(f"rein up: API on http://{settings.api_host}:{settings.api_port}, worker for model "
              f"{model.name!r}; Ctrl-C stops both", flush=True)

        dead: _Child | None = None
        while not stop.is_set():
            dead = next((c for c in children if not c.alive()), None)
            if dead is not None:
                break
            stop.wait(_POLL_SECONDS)

        if dead is not None:
            print(f"rein up: {dead.name} exited with code {dead.proc.returncode}; stopping the rest",
                  file=sys.stderr, flush=True)
        else:
            print(f"rein up: {signal.Signals(received[0]).name if received else 'stop'} received; "
                  "stopping api and worker", flush=True)
        stop_children(children)
        print("rein up: stopped", flush=True)
        return 1 if dead is not None else 0
    finally:
        # Reached early only on an unexpected error: never leave children behind.
        if any(c.alive() for c in children):
            stop_children(children)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
