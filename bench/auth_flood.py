"""Floods of 15 MB bodies the API must refuse, while another tenant's calls go on.

    python bench/auth_flood.py [--flood-key made-up|no-scope|scoped] [--senders 4] [--seconds 20]
                               [--body-mb 15] [--calls 200] [--redis-url URL] [--postgres-url URL]

`--flood-key` is the key the flood sends: `made-up` (the default; 401 from the header),
`no-scope`, a valid key of another tenant with only the `usage` scope (403 from the header,
the body never read), or `scoped`, a valid key with the `inference` scope (its bodies are
read, two at a time at most, and refused unparsed: 400, or 429 beyond the key's large-body
slots). The issue's run: `--flood-key no-scope --senders 8`.

A throwaway database and Redis key prefix, and `rein api` on a free loopback port (as
bench/intake.py: its Sandbox and ApiProcess), serving the tiny llama. Two phases:

* quiet: a real key calls GET /v1/models `--calls` times, one after another;
* flood: `--senders` threads each send, again and again for `--seconds`, a POST
  /v1/chat/completions whose body is `--body-mb` MB of nested empty objects
  (`[{}, {}, ...]`, what took 3.1 s to refuse and ~500 MB of memory when the body was
  parsed before the key was checked) with the flood key; meanwhile the real key calls GET
  /v1/models as in the quiet phase.

The API answers 401 or 403 from the header alone and closes the connection, so a sender
usually sees either that answer or its upload cut short: both count as refused. Printed: the
real key's p50 / p99 / max latency in both phases and their ratio, the refusals per second
and their latency, and the API's resident memory before the flood and its peak during it
(from /proc; the peak is reset before the flood where the kernel allows). The last line of
stdout is one JSON object with every figure; the exit status is 1 when the real key's p99
under the flood passes TARGET_P99_MS, the peak grew by TARGET_RSS_GROWTH_MB or more, or a
flood request was answered anything but the refusals its key should get.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from intake import ApiProcess, Sandbox, check_loopback, ensure_model, pct  # noqa: E402

TARGET_P99_MS = 250.0     # the other tenant's calls under the flood (3,000 ms before auth moved first)
TARGET_RSS_GROWTH_MB = 400.0   # the API's peak over its resident memory before the flood
# What each flood key's requests may be answered ("None": the upload was cut, then the answer lost).
REFUSALS = {"made-up": {"401", "None"}, "no-scope": {"403", "None"}, "scoped": {"400", "429", "None"}}


def timed_calls(base_url: str, key: str, count: int, stop: threading.Event | None = None) -> list[float]:
    """GET /v1/models with `key`, one after another: latencies in ms (all 200, or it raises)."""
    import httpx

    latencies = []
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:
        for _ in range(count):
            if stop is not None and stop.is_set():
                break
            started = time.perf_counter()
            response = client.get("/v1/models")
            latencies.append((time.perf_counter() - started) * 1000)
            if response.status_code != 200:
                raise RuntimeError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
            time.sleep(0.01)
    return latencies


def flood(port: int, bearer: str, body: bytes, until: float, results: dict, lock: threading.Lock) -> None:
    """Send the big body with `bearer` until `until`, on raw sockets (so a cut upload is seen as
    such); tally statuses and latencies in `results`."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {bearer}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    while time.monotonic() < until:
        started = time.perf_counter()
        sent = 0
        status = None
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            try:
                sock.sendall(head)
                view = memoryview(body)
                while sent < len(body):
                    sent += sock.send(view[sent:sent + (1 << 20)])
            except OSError:
                pass                     # the server answered and closed: the upload was cut
            try:
                reply = sock.recv(4096)
                if reply.startswith(b"HTTP/1.1 "):
                    status = int(reply[9:12])
            except OSError:
                pass
        with lock:
            results["latencies"].append((time.perf_counter() - started) * 1000)
            results["statuses"][str(status)] = results["statuses"].get(str(status), 0) + 1
            results["bytes_sent"].append(sent)


def memory_mb(pid: int, field: str) -> float:
    """VmHWM (peak) or VmRSS (now) of a process, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss(pid: int) -> bool:
    """Set the process' VmHWM back to its VmRSS (Linux 4.0+, as its owner or root)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def summary(latencies: list[float]) -> dict:
    return {"calls": len(latencies), "p50_ms": round(statistics.median(latencies), 2),
            "p99_ms": round(pct(latencies, 99), 2), "max_ms": round(max(latencies), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood-key", choices=sorted(REFUSALS), default="made-up",
                        help="the key the flood sends (default made-up)")
    parser.add_argument("--senders", type=int, default=4, help="flooding threads (default 4)")
    parser.add_argument("--seconds", type=float, default=20.0, help="flood duration (default 20)")
    parser.add_argument("--body-mb", type=float, default=15.0, help="size of each flood body (default 15)")
    parser.add_argument("--calls", type=int, default=200, help="the real key's calls per phase (default 200)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    args = parser.parse_args()
    check_loopback(args.redis_url, "redis")
    check_loopback(args.postgres_url, "postgres")

    model_dir = ensure_model()
    sandbox = Sandbox(args.postgres_url, args.redis_url)
    api = None
    try:
        from sqlalchemy.orm import sessionmaker
        from sqlalchemy.pool import NullPool

        from rein.store.db import make_engine
        from rein.store.keys import create_key

        sandbox.migrate()
        engine = make_engine(sandbox.database_url, poolclass=NullPool)
        try:
            with sessionmaker(engine).begin() as session:
                key = create_key(session, name="bench-auth", tenant="bench", scopes="inference").key
                flood_bearer = {
                    "made-up": "made-up",
                    "no-scope": create_key(session, name="bench-flood", tenant="flood", scopes="usage").key,
                    "scoped": create_key(session, name="bench-flood", tenant="flood", scopes="inference").key,
                }[args.flood_key]
        finally:
            engine.dispose()
        api = ApiProcess(sandbox, model_dir, Path(tempfile.mkdtemp(prefix="rein-bench-auth-")) / "api.log")
        api.wait_ready()
        timed_calls(api.base_url, key, 20)                    # warm-up
        quiet = timed_calls(api.base_url, key, args.calls)

        count = max(1, int(args.body_mb * 1e6) // 3)
        body = b"[" + b"{}," * (count - 1) + b"{}]"
        results: dict = {"latencies": [], "statuses": {}, "bytes_sent": []}
        lock = threading.Lock()
        rss_before = memory_mb(api.proc.pid, "VmRSS")
        peak_reset = reset_peak_rss(api.proc.pid)
        until = time.monotonic() + args.seconds
        senders = [threading.Thread(target=flood, args=(api.port, flood_bearer, body, until, results, lock),
                                    daemon=True)
                   for _ in range(args.senders)]
        for thread in senders:
            thread.start()
        time.sleep(0.5)                  # the flood is on before the timed calls start
        stop = threading.Event()
        threading.Timer(max(until - time.monotonic() - 0.5, 0.1), stop.set).start()
        loud = timed_calls(api.base_url, key, 1_000_000, stop)   # until the flood ends
        for thread in senders:
            thread.join()
        peak = memory_mb(api.proc.pid, "VmHWM")
        report = {
            "flood_key": args.flood_key,
            "body_bytes": len(body), "senders": args.senders, "flood_seconds": args.seconds,
            "quiet": summary(quiet), "under_flood": summary(loud),
            "p99_ratio": round(pct(loud, 99) / pct(quiet, 99), 2),
            "flood_requests": len(results["latencies"]),
            "flood_per_second": round(len(results["latencies"]) / args.seconds, 1),
            "flood_statuses": results["statuses"],
            "flood_latency": summary(results["latencies"]),
            "flood_mean_bytes_sent": round(statistics.mean(results["bytes_sent"])),
            "api_rss_before_mb": round(rss_before, 1),
            "api_peak_rss_mb": round(peak, 1),
            "api_peak_growth_mb": round(peak - rss_before, 1) if peak_reset else None,
            "target_p99_ms": TARGET_P99_MS, "target_rss_growth_mb": TARGET_RSS_GROWTH_MB,
        }
    finally:
        if api is not None:
            api.stop()
        sandbox.delete_keys()
        sandbox.drop_database()
    q, u = report["quiet"], report["under_flood"]
    print(f"body: {report['body_bytes'] / 1e6:.1f} MB of nested empty objects, {args.senders} senders, "
          f"{args.seconds:g} s, flood key: {args.flood_key}")
    print(f"real key, quiet:       p50 {q['p50_ms']:7.2f} ms  p99 {q['p99_ms']:7.2f} ms  max {q['max_ms']:7.2f} ms"
          f"  ({q['calls']} calls)")
    print(f"real key, under flood: p50 {u['p50_ms']:7.2f} ms  p99 {u['p99_ms']:7.2f} ms  max {u['max_ms']:7.2f} ms"
          f"  ({u['calls']} calls)  p99 ratio {report['p99_ratio']}x")
    print(f"flood: {report['flood_requests']} requests ({report['flood_per_second']}/s), statuses "
          f"{report['flood_statuses']}, p50 {report['flood_latency']['p50_ms']} ms, "
          f"{report['flood_mean_bytes_sent'] / 1e6:.1f} MB sent per request on average")
    growth = report["api_peak_growth_mb"]
    print(f"API resident memory: {report['api_rss_before_mb']} MB before the flood, peak "
          f"{report['api_peak_rss_mb']} MB" + (f" (+{growth} MB; target < {TARGET_RSS_GROWTH_MB:g})"
                                               if growth is not None else " (peak not reset: since start)"))
    print(json.dumps(report))
    refused_only = set(report["flood_statuses"]) <= REFUSALS[args.flood_key]
    memory_held = growth is None or growth < TARGET_RSS_GROWTH_MB
    return 0 if u["p99_ms"] <= TARGET_P99_MS and refused_only and memory_held else 1


if __name__ == "__main__":
    sys.exit(main())
