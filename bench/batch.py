"""Batch throughput: one OpenAI batch file through the service (Files + Batches API, one worker)
beside the same file through `rein run-batch`'s runner in this process.

    python bench/batch.py [--requests 2000] [--rounds 3] [--preset tiny] [--max-num-seqs 64] [--kv-cache-memory 256MiB]
                          [--batch-queue-window N] [--batch-poll-seconds S] [--service-env NAME=VALUE ...]
                          [--profile-worker FILE [--profile-all-threads]] [--redis-url URL] [--postgres-url URL] [--keep DIR]

The workload is generated from a fixed seed: `--requests` /v1/completions lines, prompts of
4 to 120 random words, max_tokens 16 to 64, greedy with ignore_eos (every request produces
exactly its max_tokens, so both sides do the same work and output tokens are comparable).
The model is the tiny llama (.cache/bench-models/llama-tiny, rein.fixtures.tiny_model; `--preset
small` for the larger one, .cache/bench-models/llama-small) capped at 512
tokens of context; both engines have the same settings (device cpu, fp32, --max-num-seqs,
2048 batched tokens a step, --kv-cache-memory) and one torch thread (the worker gets
OMP_NUM_THREADS=1; this process calls torch.set_num_threads(1)).

* service: a throwaway database `rein_bench_<random>` and Redis prefix (bench/intake.py's
  Sandbox: dropped and deleted at the end, even on failure), a key with the batch scope,
  then `rein api` and one `rein worker` as subprocesses. Timed from the start of the upload
  (POST /v1/files) until the output file is downloaded: upload, POST /v1/batches, polling
  GET /v1/batches/{id} every 0.5 s until `completed`, GET /v1/files/{output}/content.
  Process start and model load are not timed (the worker's heartbeat is awaited first).
* offline: rein.offline.run_batch.run_batch on an LLMEngine built in this process (model
  load not timed), the same input file, written to a file like `rein run-batch -o`.

Figures: requests/s and output tokens/s of each (tokens counted from each output file's
usage), and their ratio service / offline (targets: ≥ 0.8 tiny, ≥ 0.95 small). `--rounds`
runs both sides that many times, alternating which goes first (each service round on a fresh
sandbox and processes), and reports the median ratio: on a shared machine one side's speed
drifts by a quarter between runs. Greedy outputs are compared by custom_id as a check that
both answered the same requests (fp32 sums depend on which requests share a step, so a
near-tie can go either way: a few differ). Per round: the 1-minute load average, the CPU
seconds each side used while timed (the API and worker processes and the worker's engine
process, read from /proc, and the rest of the machine's busy time: Postgres, Redis, this
client; this process for offline), and the engine's steps and output tokens per step (the
worker's heartbeat; the offline engine's stats). `--profile-worker` samples the worker and its
engine process with py-spy (it slows the worker: use it to see where time goes, not for figures). The last line of stdout is one JSON object with
every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intake import Sandbox, check_loopback, ensure_model, free_port  # noqa: E402  (bench helpers)

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
ENDPOINT = "/v1/completions"
MAX_NUM_BATCHED_TOKENS = 2048
POLL_SECONDS = 0.5
HEARTBEAT_WAIT_SECONDS = 5.5    # rein.worker.heartbeat.HEARTBEAT_SECONDS, and a little
STARTUP_TIMEOUT = 180.0
TARGET_RATIO = {"tiny": 0.8, "small": 0.95}   # service / offline, by preset (the targets)
SEED = 0
WORDS = ("river queue token batch engine model paged cache worker stream tenant harness rein "
         "prompt answer block request step budget sample decode prefill latency cloud night "
         "north mountain garden quiet letter number yellow window bridge music winter story").split()


# -- the workload -----------------------------------------------------------------------------


def write_workload(path: Path, requests: int) -> dict[str, int]:
    """The seeded batch file; returns each custom_id's max_tokens."""
    rng = random.Random(SEED)
    max_tokens: dict[str, int] = {}
    with path.open("w") as out:
        for i in range(requests):
            custom_id = f"req-{i:05d}"
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120)))
            max_tokens[custom_id] = rng.randint(16, 64)
            body = {"model": MODEL_NAME, "prompt": words, "max_tokens": max_tokens[custom_id],
                    "temperature": 0.0, "ignore_eos": True}
            out.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                                  "body": body}) + "\n")
    return max_tokens


def read_output(path: Path) -> tuple[dict[str, str], int, list[str]]:
    """(custom_id -> text, output tokens, custom_ids that failed) of an output file."""
    texts: dict[str, str] = {}
    tokens = 0
    failed: list[str] = []
    with path.open() as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            response = row.get("response")
            if row.get("error") or not response or response.get("status_code") != 200:
                failed.append(row.get("custom_id"))
                continue
            body = response["body"]
            texts[row["custom_id"]] = body["choices"][0]["text"]
            tokens += body["usage"]["completion_tokens"]
    return texts, tokens, failed


# -- the service ------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu_seconds(pid: int, *, children: bool = True) -> float | None:
    """User + system CPU seconds of `pid` and (`children`) its live descendants: the worker's
    engine runs in a child process of its own (rein.engine.process_client)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime
    if children:
        total += sum(process_cpu_seconds(child, children=True) or 0.0 for child in child_pids(pid))
    return total


def machine_busy_seconds() -> float | None:
    """CPU seconds every core has spent busy since boot (Linux /proc/stat: all but idle and
    iowait), so that what the service's own processes do not account for (Postgres, Redis,
    this client) shows as the rest."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


class Service:
    """`rein api` and one `rein worker` on the sandbox; `stop()` ends both. `env` adds to or
    overrides the environment they get (bench/priority.py uses this class too)."""

    def __init__(self, sandbox: Sandbox, model_dir: Path, log_dir: Path, args: argparse.Namespace, *,
                 name: str = "batch", max_model_len: int = MAX_MODEL_LEN, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.hostname = f"bench-{name}-{sandbox.tag}@localhost"
        self.log_dir = log_dir
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")} | {
            "REIN_DATABASE_URL": sandbox.database_url,
            "REIN_REDIS_URL": sandbox.redis_url,
            "REIN_REDIS_KEY_PREFIX": sandbox.prefix,
            "REIN_MODELS": f"{MODEL_NAME}={model_dir}@{max_model_len}",
            "REIN_API_HOST": "127.0.0.1",
            "REIN_API_PORT": str(self.port),
            "REIN_MAX_QUEUE_DEPTH": "100000",
            "REIN_MAX_NUM_SEQS": str(args.max_num_seqs),
            "REIN_MAX_NUM_BATCHED_TOKENS": str(MAX_NUM_BATCHED_TOKENS),
            "REIN_KV_CACHE_MEMORY": args.kv_cache_memory,
            "REIN_DEVICE": "cpu",
            "REIN_DTYPE": "float32",
            "REIN_FILES_DIR": str(log_dir / "files"),
            "OMP_NUM_THREADS": "1",
        } | {f"REIN_{setting.upper()}": str(value) for setting, value in (
            ("batch_queue_window", getattr(args, "batch_queue_window", None)),
            ("batch_poll_seconds", getattr(args, "batch_poll_seconds", None)),
        ) if value is not None} | (env or {})
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []
        self.worker = self._spawn("worker", "worker", "--model", MODEL_NAME, "--hostname", self.hostname,
                                  "--loglevel", "warning")
        self.api = self._spawn("api", "api")

    def _spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop)
        self._logs.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "rein.cli.main", *args], env=self.env, cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, heartbeat_key: str) -> None:
        import httpx
        import redis

        client = redis.Redis.from_url(self.env["REIN_REDIS_URL"])
        deadline = time.monotonic() + STARTUP_TIMEOUT
        try:
            while time.monotonic() < deadline:
                for name, proc in (("worker", self.worker), ("api", self.api)):
                    if proc.poll() is not None:
                        raise RuntimeError(f"rein {name} exited with {proc.returncode}:\n{self.tail(name)}")
                try:
                    api_ok = httpx.get(f"{self.base_url}/readyz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    api_ok = False
                if api_ok and client.exists(heartbeat_key):
                    return
                time.sleep(0.25)
        finally:
            client.close()
        raise RuntimeError(f"service not ready after {STARTUP_TIMEOUT:.0f} s:\n{self.tail('worker')}"
                           f"\n{self.tail('api')}")

    def cpu_seconds(self) -> dict[str, float | None]:
        """User + system CPU seconds each process has used so far (Linux /proc; None elsewhere)."""
        return {"api": process_cpu_seconds(self.api.pid), "worker": process_cpu_seconds(self.worker.pid),
                "worker_process": process_cpu_seconds(self.worker.pid, children=False),
                "machine": machine_busy_seconds()}

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for log in self._logs:
            log.close()


def run_service(sandbox: Sandbox, model_dir: Path, input_path: Path, output_path: Path,
                log_dir: Path, args: argparse.Namespace, phase) -> dict:
    from sqlalchemy.orm import sessionmaker
    from sqlalchemy.pool import NullPool

    from rein.cli.batch import BatchClient
    from rein.store.db import make_engine
    from rein.store.keys import create_key
    from rein.store.redis_keys import RedisKeys

    report = sandbox.migrate()
    phase(f"database {sandbox.db_name}: migrated to {report.after}; redis prefix {sandbox.prefix!r}")
    engine = make_engine(sandbox.database_url, poolclass=NullPool)
    try:
        with sessionmaker(engine).begin() as session:
            key = create_key(session, name="bench-batch", tenant="bench", scopes="batch").key
    finally:
        engine.dispose()
    service = Service(sandbox, model_dir, log_dir, args, env=dict(args.service_env or []))
    try:
        keys = RedisKeys(sandbox.prefix.rstrip(":"))
        service.wait_ready(keys.worker_heartbeat(service.hostname))
        phase(f"rein api ({service.base_url}) and rein worker ready")
        profiler = None
        if args.profile_worker:
            # py-spy without pausing the worker (--nonblocking: pausing ~70 threads per sample
            # slowed it several-fold), sampling only the thread that holds the GIL (--gil): the
            # worker's Python work is serialised on the GIL, so that is where its time goes.
            # --profile-all-threads samples every thread instead (waits included). --subprocesses:
            # the engine process too (its stacks start with its own process line).
            mode = [] if args.profile_all_threads else ["--gil"]
            profiler = subprocess.Popen(["py-spy", "record", "--pid", str(service.worker.pid), "--format", "raw",
                                         "--output", args.profile_worker, "--rate", "100", "--nonblocking",
                                         "--subprocesses", *mode],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        heartbeat_key = keys.worker_heartbeat(service.hostname)
        with BatchClient(service.base_url, key) as client:
            steps_before = engine_steps(service, heartbeat_key)
            cpu_before = service.cpu_seconds()
            start = time.perf_counter()
            uploaded = client.upload(input_path)
            batch = client.create_batch(uploaded["id"], ENDPOINT, "24h", None)
            last_report = start
            while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(POLL_SECONDS)
                batch = client.batch(batch["id"])
                if time.perf_counter() - last_report > 15:
                    last_report = time.perf_counter()
                    counts = batch.get("request_counts") or {}
                    phase(f"  {batch['status']}: {counts.get('completed', 0)}/{counts.get('total', 0)} "
                          f"completed, {counts.get('failed', 0)} failed")
            if batch["status"] != "completed" or not batch.get("output_file_id"):
                raise RuntimeError(f"the batch ended {batch['status']}: {json.dumps(batch)[:1000]}"
                                   f"\n{service.tail('worker')}")
            client.download(batch["output_file_id"], output_path)
            wall = time.perf_counter() - start
            cpu_after = service.cpu_seconds()
        time.sleep(HEARTBEAT_WAIT_SECONDS)     # the idle engine's next heartbeat has every step
        steps_after = engine_steps(service, heartbeat_key)
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)   # py-spy writes its file on SIGINT
            profiler.wait(timeout=60)
            phase(f"worker profile (py-spy, collapsed stacks): {args.profile_worker}")
    finally:
        service.stop()
    cpu = {name: None if cpu_after[name] is None or cpu_before[name] is None
           else round(cpu_after[name] - cpu_before[name], 1) for name in cpu_after}
    in_server = None
    if batch.get("completed_at") and batch.get("created_at"):
        in_server = batch["completed_at"] - batch["created_at"]
    return {"wall_s": wall, "in_server_s": in_server, "batch": batch, "cpu_s": cpu,
            "engine": step_figures(*(after - before for after, before in zip(steps_after, steps_before,
                                                                              strict=True)))}


def engine_steps(service: Service, heartbeat_key: str) -> tuple[int, int]:
    """(engine steps, output tokens) so far, from the worker's heartbeat (rein.worker.heartbeat)."""
    import redis

    client = redis.Redis.from_url(service.env["REIN_REDIS_URL"])
    try:
        beat = json.loads(client.get(heartbeat_key) or "{}")
    finally:
        client.close()
    return int(beat.get("steps", 0)), int(beat.get("generation_tokens", 0))


def step_figures(steps: int, tokens: int) -> dict[str, float]:
    return {"steps": steps, "output_tokens_per_step": round(tokens / steps, 1) if steps else 0.0}


# -- offline ----------------------------------------------------------------------------------


def run_offline(model_dir: Path, input_path: Path, output_path: Path, args: argparse.Namespace) -> dict:
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    from rein.offline.run_batch import run_batch

    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_model_len=MAX_MODEL_LEN))
    cpu_before = time.process_time()
    start = time.perf_counter()
    summary = run_batch(engine, input_path, output_path, model_name=MODEL_NAME, progress=False)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "ok": summary.requests_ok, "failed": summary.requests_failed,
            "cpu_s": round(time.process_time() - cpu_before, 1),
            "engine": step_figures(engine.stats.steps, engine.stats.generation_tokens)}


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="lines in the batch file (2000)")
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                        help="model size (tiny: hidden 64 / 2 layers; small: 512 / 8, ~30x the work "
                             "per token, which shows the service's cost per request in proportion)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="service and offline runs each, alternating which goes first (3); the ratio "
                             "reported is the median of the rounds'")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="engine sequences, both sides (64)")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache, both sides (256MiB)")
    parser.add_argument("--batch-queue-window", type=int, default=None, metavar="N",
                        help="REIN_BATCH_QUEUE_WINDOW of the service (default: the setting's default)")
    parser.add_argument("--batch-poll-seconds", type=float, default=None, metavar="S",
                        help="REIN_BATCH_POLL_SECONDS of the service (default: the setting's default)")
    parser.add_argument("--service-env", action="append", type=lambda text: tuple(text.split("=", 1)),
                        metavar="NAME=VALUE", help="an environment variable for the api and the worker "
                        "(e.g. REIN_WORKER_INTERACTIVE_SLOTS=0; repeatable)")
    parser.add_argument("--profile-worker", default=None, metavar="FILE",
                        help="sample the worker with py-spy while the batch runs; collapsed stacks to FILE")
    parser.add_argument("--profile-all-threads", action="store_true",
                        help="with --profile-worker: sample every thread, not only the GIL holder")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
                        help="the Postgres server (its maintenance database); the bench database is made on it")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="keep the input, both outputs and the service logs in DIR")
    args = parser.parse_args()
    check_loopback(args.redis_url, "redis")
    check_loopback(args.postgres_url, "postgres")

    import torch

    torch.set_num_threads(1)   # as the worker (OMP_NUM_THREADS=1)
    t_start = time.monotonic()

    def phase(text: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f} s] {text}", file=sys.stderr, flush=True)

    work_dir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rein-bench-batch-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    input_path = work_dir / "input.jsonl"
    max_tokens = write_workload(input_path, args.requests)
    expected_tokens = sum(max_tokens.values())
    model_dir = ensure_model(args.preset)
    phase(f"{args.requests} requests ({expected_tokens} output tokens) in {input_path}")

    rounds = []
    for number in range(1, args.rounds + 1):
        # Alternate which side goes first, so a drift of the machine's speed evens out.
        order = ("service", "offline") if number % 2 else ("offline", "service")
        rounds.append(one_round(args, model_dir, input_path, work_dir, order, phase))
        phase(f"round {number}: service {rounds[-1]['service']['wall_s']:.1f} s, offline "
              f"{rounds[-1]['offline']['wall_s']:.1f} s, ratio {rounds[-1]['ratio']:.3f}x")
    report(args, rounds, max_tokens, expected_tokens)
    return 0


def one_round(args: argparse.Namespace, model_dir: Path, input_path: Path, work_dir: Path,
              order: tuple[str, str], phase) -> dict:
    """Both sides once, in `order`; their figures and the ratio of output tokens/s."""
    results: dict[str, dict] = {}
    for side in order:
        load_before = os.getloadavg()[0]
        if side == "service":
            sandbox = Sandbox(args.postgres_url, args.redis_url)
            try:
                results[side] = run_service(sandbox, model_dir, input_path, work_dir / "service-output.jsonl",
                                            work_dir, args, phase)
            finally:
                try:
                    sandbox.delete_keys()
                    sandbox.drop_database()
                except Exception as exc:
                    print(f"warning: cleanup of {sandbox.db_name} / {sandbox.prefix!r} failed: {exc}",
                          file=sys.stderr)
        else:
            results[side] = run_offline(model_dir, input_path, work_dir / "offline-output.jsonl", args)
        results[side]["load_1m"] = (round(load_before, 2), round(os.getloadavg()[0], 2))
    service, offline = results["service"], results["offline"]
    service_texts, service_tokens, service_failed = read_output(work_dir / "service-output.jsonl")
    offline_texts, offline_tokens, _ = read_output(work_dir / "offline-output.jsonl")
    answered = set(service_texts) | set(service_failed)
    for result, tokens, ok in ((service, service_tokens, len(service_texts)),
                               (offline, offline_tokens, len(offline_texts))):
        wall = result["wall_s"]
        result.update(requests_ok=ok, output_tokens=tokens, requests_per_s=round(ok / wall, 2),
                      output_tokens_per_s=round(tokens / wall, 1), wall_s=round(wall, 2))
    service.update(failed=len(service_failed), answered=len(answered),
                   same_greedy_text=sum(service_texts.get(cid) == text for cid, text in offline_texts.items()))
    service.pop("batch", None)
    return {"service": service, "offline": offline,
            "ratio": service["output_tokens_per_s"] / offline["output_tokens_per_s"]}


def report(args: argparse.Namespace, rounds: list[dict], max_tokens: dict[str, int], expected_tokens: int) -> None:
    """The rounds' table, the median ratio and the JSON line."""
    print()
    print(f"batch: {args.requests} /v1/completions requests, prompts 4-120 words, max_tokens 16-64, "
          f"greedy + ignore_eos ({expected_tokens} output tokens expected); {args.preset} llama, cpu fp32, "
          f"1 torch thread, max_num_seqs {args.max_num_seqs}, KV {args.kv_cache_memory}; {len(rounds)} "
          f"round(s), service and offline alternating")
    print(f"  {'round':>5} {'service s':>9} {'offline s':>9} {'ratio':>7}  {'service CPU: api + worker (engine) + rest':<42} "
          f"{'offline CPU':>11}  {'tokens/step s|o':>15}  {'load 1m':>9}")
    for number, one in enumerate(rounds, 1):
        service, offline = one["service"], one["offline"]
        cpu = service["cpu_s"]
        engine_cpu = (f" ({cpu['worker'] - cpu['worker_process']:.1f})"
                      if None not in (cpu["worker"], cpu["worker_process"]) and cpu["worker"] > cpu["worker_process"]
                      else "")
        rest = (f" + {cpu['machine'] - cpu['api'] - cpu['worker']:.1f}"
                if None not in (cpu["machine"], cpu["api"], cpu["worker"]) else "")
        service_cpu = f"{cpu['api']} + {cpu['worker']}{engine_cpu}{rest}"
        print(f"  {number:>5} {service['wall_s']:>9.2f} {offline['wall_s']:>9.2f} {one['ratio']:>6.3f}x  "
              f"{service_cpu:<42} {offline['cpu_s']:>11}  "
              f"{service['engine']['output_tokens_per_step']:>7}|{offline['engine']['output_tokens_per_step']:<7}  "
              f"{max(service['load_1m'] + offline['load_1m']):>9.2f}")
    ratios = sorted(one["ratio"] for one in rounds)
    median = statistics.median(ratios)
    target = TARGET_RATIO[args.preset]
    print(f"  ratio service / offline (output tokens/s): median {median:.3f}x [{ratios[0]:.3f}-{ratios[-1]:.3f}] "
          f"(target >= {target}x): {'PASS' if median >= target else 'MISS'}")
    last = rounds[-1]["service"]
    print(f"  checks (last round): service answered {last['answered']}/{args.requests} ({last['failed']} failed); "
          f"output tokens {last['output_tokens']} / {rounds[-1]['offline']['output_tokens']} (expected "
          f"{expected_tokens}); same greedy text for {last['same_greedy_text']}/{args.requests} (fp32 near-ties "
          f"follow the step's batch)")
    print("  CPU: seconds while timed; the worker's includes its engine process's (in brackets); the rest is "
          "every other process on the machine (Postgres, Redis, this client), from /proc/stat")
    print(json.dumps({
        "bench": "batch", "preset": args.preset, "requests": args.requests,
        "expected_output_tokens": expected_tokens, "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory": args.kv_cache_memory, "cpus": os.cpu_count(), "rounds": rounds,
        "ratio_median": round(median, 4), "ratio_range": [round(ratios[0], 4), round(ratios[-1], 4)],
        "target": {"ratio_min": target, "pass": median >= target},
    }))


if __name__ == "__main__":
    sys.exit(main())
