"""Interactive latency under a running batch: one worker busy with an OpenAI batch, and chat
completions arriving meanwhile, against the same chats on an idle service and the same batch
alone.

    python bench/priority.py [--preset tiny] [--max-num-seqs 8] [--batch-requests N] [--batch-max-tokens 256]
                             [--chats 20] [--chat-max-tokens 16] [--chat-interval 0.5] [--threads 1]
                             [--interactive-step-budget N|auto|off] [--service-env NAME=VALUE ...] [--keep DIR]
                             [--compare NAME=VALUE ...]

One service (bench/intake.py's Sandbox: a throwaway database and Redis prefix, dropped at
the end; `rein api` and one `rein worker` as subprocesses, cpu fp32, --threads torch threads;
`--interactive-step-budget N|auto|off` sets the worker's REIN_INTERACTIVE_STEP_BUDGET, which holds a
step's batch work to N tokens while chats run: rein.engine.scheduler; auto, the default, is 4 on
a CPU; `off` gives rein's behaviour before issue 45), then in order:

1. idle: `--chats` chat completions (/v1/chat/completions, greedy, `--chat-max-tokens`), one at
   a time, 0.2 s apart: each one's latency is its HTTP round trip;
2. batch alone: a batch (Files + Batches API, priority 6 jobs) of `--batch-requests` lines
   (default 12 x max_num_seqs, beyond the 3x the target asks for), prompts of 4-120 random
   words, `--batch-max-tokens` each (ignore_eos, so every line does the same work);
3. batch + chats: the same batch again, and once its first jobs run, the chats again, sent
   on a fixed schedule (open loop, each on its own thread) every `--chat-interval` seconds
   (less when 60% of the batch-alone time is shorter, so they all arrive while the batch
   fills the worker; spaced out, so that each meets the batch, not the other chats);
4. batch alone again (the machine drifts: the two batch-alone runs bracket the mixed one).

Figures: interactive p50 and p99 latency under the batch against idle (targets: p50 <= 1.5x,
p99 <= 2x), the slowest chat under the batch against the idle p50 (target 2x: issue 45's "worst
of six" with `--chats 6`), and batch throughput (output tokens over the span from the batch's first job
start to its last job end, read from the jobs table) with the chats against the mean of the
two batch-alone runs (target: not lower by more than 10% with the budget off, 15% with an
interactive step budget, which shrinks the batch's steps on purpose). The worker's priority
preemptions and the load average are printed; the last line of stdout is one JSON object.
Figures from a shared machine are noisy: compare them within one run. `--compare NAME=VALUE` runs
the whole bench twice, as given and with that variable set (`--compare
REIN_INTERACTIVE_STEP_BUDGET=off`: rein's defaults before issue 45 against today's), and prints
the two runs' figures side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import Service as BatchService  # noqa: E402  (bench helpers)
from intake import Sandbox, check_loopback, ensure_model, pct  # noqa: E402

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 1024
IDLE_GAP_SECONDS = 0.2
TARGET_P50, TARGET_P99 = 1.5, 2.0
# The batch may give up more with an interactive step budget, which shrinks its steps on purpose.
TARGET_BATCH, TARGET_BATCH_BUDGETED = 0.9, 0.85
SEED = 0
WORDS = ("river queue token batch engine model paged cache worker stream tenant harness rein "
         "prompt answer block request step budget sample decode prefill latency cloud night "
         "north mountain garden quiet letter number yellow window bridge music winter story").split()
QUESTIONS = ["What is a river?", "Name a winter story.", "Why is the night quiet?", "Describe a garden.",
             "How does a bridge work?", "Say something about music.", "What is a letter for?",
             "Tell me about mountains."]


def write_batch(path: Path, requests: int, max_tokens: int) -> None:
    rng = random.Random(SEED)
    with path.open("w") as out:
        for i in range(requests):
            body = {"model": MODEL_NAME, "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))),
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            out.write(json.dumps({"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/completions",
                                  "body": body}) + "\n")


class Service(BatchService):
    """bench/batch.py's service (`rein api` + one `rein worker`), with this bench's settings
    and the worker's heartbeat readable."""

    def __init__(self, sandbox: Sandbox, model_dir: Path, log_dir: Path, args: argparse.Namespace) -> None:
        env = {"REIN_BATCH_POLL_SECONDS": "0.2", "OMP_NUM_THREADS": str(args.threads)}
        if args.interactive_slots is not None:
            env["REIN_WORKER_INTERACTIVE_SLOTS"] = str(args.interactive_slots)
        if args.interactive_step_budget is not None:
            env["REIN_INTERACTIVE_STEP_BUDGET"] = str(args.interactive_step_budget)
        env |= dict(args.service_env or [])
        super().__init__(sandbox, model_dir, log_dir, args, name="priority", max_model_len=MAX_MODEL_LEN, env=env)

    def heartbeat(self, key: str) -> dict:
        import redis

        client = redis.Redis.from_url(self.env["REIN_REDIS_URL"])
        try:
            raw = client.get(key)
        finally:
            client.close()
        return json.loads(raw) if raw else {}


def chat(client, key: str, i: int, max_tokens: int) -> float:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    start = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                           timeout=300)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"chat {i}: HTTP {response.status_code}: {response.text[:500]}")
    return elapsed


def chats_open_loop(base_url: str, key: str, count: int, interval: float, max_tokens: int) -> list[float]:
    """`count` chats sent every `interval` seconds, each on its own thread; their latencies."""
    import httpx

    latencies: list[float | None] = [None] * count
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with httpx.Client(base_url=base_url) as client:
                latencies[i] = chat(client, key, i, max_tokens)
        except BaseException as exc:   # reported after the join
            errors.append(exc)

    threads = []
    start = time.perf_counter()
    for i in range(count):
        time.sleep(max(0.0, start + i * interval - time.perf_counter()))
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return [x for x in latencies if x is not None]


def batch_span(database_url: str, batch_id: str) -> tuple[float, int, int]:
    """(seconds from the batch's first job start to its last job end, jobs, output tokens)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            row = conn.execute(text(
                "SELECT EXTRACT(EPOCH FROM max(j.finished_at) - min(j.started_at)), count(*), "
                "coalesce(sum(u.completion_tokens), 0) FROM jobs j LEFT JOIN usage u ON u.job_id = j.id "
                "WHERE j.batch_id = :b AND j.status = 'succeeded'"), {"b": batch_id}).one()
    finally:
        engine.dispose()
    return float(row[0]), int(row[1]), int(row[2])


def jobs_running(database_url: str, batch_id: str) -> int:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT count(*) FROM jobs WHERE batch_id = :b AND status <> 'queued'"),
                                {"b": batch_id}).scalar_one()
    finally:
        engine.dispose()


def run_batch(client, sandbox: Sandbox, input_path: Path, during=None) -> dict:
    """Upload and run one batch to completion; `during(batch_id)` runs once its first job started."""
    uploaded = client.upload(input_path)
    batch = client.create_batch(uploaded["id"], "/v1/completions", "24h", None)
    result = None
    if during is not None:
        deadline = time.monotonic() + 120
        while jobs_running(sandbox.database_url, batch["id"]) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        result = during(batch["id"])
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.25)
        batch = client.batch(batch["id"])
    if batch["status"] != "completed":
        raise RuntimeError(f"the batch ended {batch['status']}: {json.dumps(batch)[:1000]}")
    span, jobs, tokens = batch_span(sandbox.database_url, batch["id"])
    return {"span_s": round(span, 2), "jobs": jobs, "output_tokens": tokens,
            "tokens_per_s": round(tokens / span, 1), "during": result}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def compare(args: argparse.Namespace) -> int:
    """The bench as given, then with `--compare`'s variables added (each a whole run of its own, in
    a child process, so each gets a fresh service); both runs' figures side by side."""
    import subprocess

    cleaned, skip = [], False
    for arg in sys.argv[1:]:   # the same arguments without --compare
        if skip:
            skip = False
            continue
        if arg == "--compare":
            skip = True
            continue
        if arg.startswith("--compare="):
            continue
        cleaned.append(arg)
    extra = [f"--service-env={name}={value}" for name, value in args.compare]
    runs = {}
    for label, argv in (("as given", cleaned), (" ".join(f"{n}={v}" for n, v in args.compare), cleaned + extra)):
        print(f"# {label}: bench/priority.py {' '.join(argv)}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, *argv], stdout=subprocess.PIPE, text=True)
        sys.stdout.write(done.stdout)
        if done.returncode != 0:
            print(f"error: the run {label!r} failed ({done.returncode})", file=sys.stderr)
            return done.returncode
        runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
    print()
    print("side by side (ratios against the same run's idle chats and batch-alone runs):")
    labels = list(runs)
    print(f"  {'':<28} " + " ".join(f"{label[:34]:>34}" for label in labels))
    rows = (("idle chat p50 s", lambda r: f"{r['idle_s']['p50']:.3f}"),
            ("chat p50 under the batch", lambda r: f"{r['busy_s']['p50']:.3f} s {r['ratios']['p50']:.2f}x"),
            (f"worst of {args.chats} under the batch", lambda r: f"{max(r['busy_each_s']):.3f} s "
                                                            f"{r['ratios']['worst']:.2f}x"),
            ("batch tok/s alone (mean)", lambda r: f"{sum(a['tokens_per_s'] for a in r['batch_alone']) / 2:.1f}"),
            ("batch tok/s with chats", lambda r: f"{r['batch_with_chats']['tokens_per_s']:.1f} "
                                                 f"{r['ratios']['batch']:.3f}x"),
            ("load average start-end", lambda r: f"{r['loadavg_1m']['start']:.1f}-{r['loadavg_1m']['end']:.1f}"))
    for name, cell in rows:
        print(f"  {name:<28} " + " ".join(f"{cell(runs[label]):>34}" for label in labels))
    print(json.dumps({"bench": "priority-compare", "runs": runs}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="bench model size (tiny)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the worker's engine sequences (8)")
    parser.add_argument("--interactive-slots", type=int, default=None,
                        help="REIN_WORKER_INTERACTIVE_SLOTS (default: the setting's, max_num_seqs / 4)")
    parser.add_argument("--interactive-step-budget", default=None, metavar="N|auto|off",
                        help="REIN_INTERACTIVE_STEP_BUDGET: batch tokens per step while chats run (default: "
                        "the setting's, auto: 4 on a CPU)")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--batch-requests", type=int, default=None, help="batch lines (12 x max_num_seqs)")
    parser.add_argument("--batch-max-tokens", type=int, default=256)
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--chat-max-tokens", type=int, default=16)
    parser.add_argument("--chat-interval", type=float, default=0.5, help="seconds between two chats (0.5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the worker (1)")
    parser.add_argument("--service-env", action="append", type=lambda text: tuple(text.split("=", 1)),
                        metavar="NAME=VALUE", help="an environment variable for the api and the worker "
                        "(e.g. REIN_WORKER_ENGINE_PROCESS=false; repeatable)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--keep", default=None, metavar="DIR", help="keep the batch file and service logs in DIR")
    parser.add_argument("--compare", action="append", type=lambda text: tuple(text.split("=", 1)),
                        metavar="NAME=VALUE", help="run the bench twice, as given and with this environment "
                        "variable added (e.g. REIN_INTERACTIVE_STEP_BUDGET=off, rein's defaults before issue 45; "
                        "repeatable), and print both runs' figures side by side")
    args = parser.parse_args()
    if args.compare:
        return compare(args)
    check_loopback(args.redis_url, "redis")
    check_loopback(args.postgres_url, "postgres")
    batch_requests = args.batch_requests or 12 * args.max_num_seqs
    t_start = time.monotonic()

    def phase(text: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f} s] {text}", file=sys.stderr, flush=True)

    import httpx
    from sqlalchemy.orm import sessionmaker
    from sqlalchemy.pool import NullPool

    from rein.cli.batch import BatchClient
    from rein.store.db import make_engine
    from rein.store.keys import create_key
    from rein.store.redis_keys import RedisKeys

    work_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rein-bench-priority-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    input_path = work_dir / "batch.jsonl"
    write_batch(input_path, batch_requests, args.batch_max_tokens)
    model_dir = ensure_model(args.preset)
    load = {"start": os.getloadavg()[0]}
    sandbox = Sandbox(args.postgres_url, args.redis_url)
    service = None
    try:
        sandbox.migrate()
        db = make_engine(sandbox.database_url, poolclass=NullPool)
        try:
            with sessionmaker(db).begin() as session:
                key = create_key(session, name="bench-priority", tenant="bench", scopes="inference,batch").key
        finally:
            db.dispose()
        service = Service(sandbox, model_dir, work_dir, args)
        heartbeat_key = RedisKeys(sandbox.prefix.rstrip(":")).worker_heartbeat(service.hostname)
        service.wait_ready(heartbeat_key)
        phase(f"rein api and rein worker ready ({args.preset} llama, max_num_seqs {args.max_num_seqs})")

        with httpx.Client(base_url=service.base_url) as http:
            for i in range(3):   # warm up (first requests compile nothing on CPU, but fill caches)
                chat(http, key, i, args.chat_max_tokens)
            idle = []
            for i in range(args.chats):
                idle.append(chat(http, key, i, args.chat_max_tokens))
                time.sleep(IDLE_GAP_SECONDS)
        # The heartbeat's mean step time covers its last 5 s: the idle chats' steps.
        step_ms = {"idle": _round(service.heartbeat(heartbeat_key).get("step_ms"))}
        phase(f"idle: p50 {pct(idle, 50):.3f} s, p99 {pct(idle, 99):.3f} s")

        with BatchClient(service.base_url, key) as client:
            warmup_path = work_dir / "warmup.jsonl"
            write_batch(warmup_path, 2 * args.max_num_seqs, 16)
            run_batch(client, sandbox, warmup_path)   # first-use costs of the batch path, not timed
            alone_1 = run_batch(client, sandbox, input_path)
            phase(f"batch alone: {alone_1['span_s']} s, {alone_1['tokens_per_s']} tok/s")
            preempted_before = service.heartbeat(heartbeat_key).get("preemptions", 0)
            interval = min(args.chat_interval, 0.6 * alone_1["span_s"] / args.chats)

            def send_chats(batch_id: str) -> list[float]:
                phase(f"batch + chats: first batch job started; {args.chats} chats, one every {interval:.2f} s")
                latencies = chats_open_loop(service.base_url, key, args.chats, interval, args.chat_max_tokens)
                step_ms["under the batch"] = _round(service.heartbeat(heartbeat_key).get("step_ms"))
                return latencies

            mixed = run_batch(client, sandbox, input_path, during=send_chats)
            time.sleep(6)   # one heartbeat, for the preemption count
            preemptions = service.heartbeat(heartbeat_key).get("preemptions", 0) - preempted_before
            busy = mixed.pop("during")
            phase(f"batch + chats: {mixed['span_s']} s, {mixed['tokens_per_s']} tok/s; chats p50 "
                  f"{pct(busy, 50):.3f} s, p99 {pct(busy, 99):.3f} s")
            alone_2 = run_batch(client, sandbox, input_path)
            phase(f"batch alone again: {alone_2['span_s']} s, {alone_2['tokens_per_s']} tok/s")
    finally:
        if service is not None:
            service.stop()
        try:
            sandbox.delete_keys()
            sandbox.drop_database()
        except Exception as exc:
            print(f"warning: cleanup of {sandbox.db_name} failed: {exc}", file=sys.stderr)
    load["end"] = os.getloadavg()[0]

    alone_tps = (alone_1["tokens_per_s"] + alone_2["tokens_per_s"]) / 2
    # worst: the slowest chat under the batch against the idle median (the "worst of six").
    ratios = {"p50": pct(busy, 50) / pct(idle, 50), "p99": pct(busy, 99) / pct(idle, 99),
              "worst": max(busy) / pct(idle, 50),
              "batch": mixed["tokens_per_s"] / alone_tps,
              "batch_vs_faster_alone": mixed["tokens_per_s"] / max(alone_1["tokens_per_s"], alone_2["tokens_per_s"])}
    # The interactive step budget is on by default on a CPU (rein.engine.config), unless set off.
    budget_off = args.interactive_step_budget == "off" or \
        dict(args.service_env or []).get("REIN_INTERACTIVE_STEP_BUDGET") == "off"
    target_batch = TARGET_BATCH if budget_off else TARGET_BATCH_BUDGETED
    passed = {"p50": ratios["p50"] <= TARGET_P50, "p99": ratios["p99"] <= TARGET_P99,
              "worst": ratios["worst"] <= TARGET_P99,
              "batch": ratios["batch"] >= target_batch}

    print()
    print(f"priority: {args.preset} llama, cpu fp32, {args.threads} torch thread(s), max_num_seqs "
          f"{args.max_num_seqs}; batch {batch_requests} x {args.batch_max_tokens} tokens; {args.chats} chats "
          f"of {args.chat_max_tokens} tokens; interactive step budget "
          f"{'default (auto)' if args.interactive_step_budget is None else args.interactive_step_budget}; "
          f"service env {dict(args.service_env or {})}")
    print(f"  {'interactive latency':<34} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for label, values in (("idle", idle), ("under the batch", busy)):
        print(f"  {label:<34} {pct(values, 50):>8.3f} {pct(values, 99):>8.3f} {max(values):>8.3f}")
    print(f"  {'ratio (targets 1.5x / 2x)':<34} {ratios['p50']:>7.2f}x {ratios['p99']:>7.2f}x   "
          f"{'PASS' if passed['p50'] else 'MISS'} / {'PASS' if passed['p99'] else 'MISS'}")
    print(f"  {f'worst of {len(busy)} / idle p50 (target 2x)':<34} {ratios['worst']:>16.2f}x   "
          f"{'PASS' if passed['worst'] else 'MISS'}")
    print(f"  {'batch throughput':<34} {'span s':>8} {'tok/s':>8}")
    for label, run in (("alone", alone_1), ("with the chats", mixed), ("alone again", alone_2)):
        print(f"  {label:<34} {run['span_s']:>8.2f} {run['tokens_per_s']:>8.1f}")
    print(f"  {f'ratio with chats / alone (>= {target_batch})':<34} {ratios['batch']:>16.3f}x  "
          f"{'PASS' if passed['batch'] else 'MISS'} (mean of the two alone runs; "
          f"{ratios['batch_vs_faster_alone']:.3f}x against the faster one)")
    print(f"  engine step, mean of the last heartbeat: idle {step_ms['idle']} ms, under the batch "
          f"{step_ms.get('under the batch')} ms (a chat takes {args.chat_max_tokens} steps)")
    print(f"  engine preemptions during the mixed run: {preemptions}")
    print(f"  1-minute load average: {load['start']:.2f} at start, {load['end']:.2f} at the end "
          f"({os.cpu_count()} CPUs, shared machine)")
    result = {
        "bench": "priority", "preset": args.preset, "max_num_seqs": args.max_num_seqs, "threads": args.threads,
        "batch_requests": batch_requests, "batch_max_tokens": args.batch_max_tokens, "chats": args.chats,
        "chat_max_tokens": args.chat_max_tokens, "chat_interval_s": round(interval, 3),
        "interactive_step_budget": args.interactive_step_budget, "service_env": dict(args.service_env or []),
        "idle_s": {"p50": round(pct(idle, 50), 4), "p99": round(pct(idle, 99), 4)},
        "busy_s": {"p50": round(pct(busy, 50), 4), "p99": round(pct(busy, 99), 4)},
        "busy_each_s": [round(x, 3) for x in busy],   # in the order the chats were sent
        "batch_alone": [alone_1, alone_2], "batch_with_chats": mixed, "preemptions": preemptions,
        "step_ms": step_ms,
        "ratios": {k: round(v, 3) for k, v in ratios.items()}, "pass": passed,
        "loadavg_1m": {k: round(v, 2) for k, v in load.items()}, "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
