"""`rein top`: a live view of the service's queues and workers, read from Redis.

Per model: the jobs waiting in its queue, by priority (interactive / batch), and how many
of its workers are up. Per worker: its state, its engine's running and waiting requests,
KV cache usage, tokens/s, preemptions and mean step time, and how long ago it last beat.
Refreshes every second (clear and redraw on a terminal, one snapshot after another
otherwise); `--once` prints one snapshot and exits, `--json` prints snapshots as JSON.

Where the figures come from (nothing here talks to a worker or to Postgres):

* queue depth: the LLEN of the model's Celery priority lists (rein.jobs.queues.queue_keys);
* workers: the registry hash RedisKeys.workers() (worker name -> its last heartbeat JSON,
  written every HEARTBEAT_SECONDS by rein.worker.heartbeat), and whether the worker's own
  heartbeat key still exists. That key expires 3 heartbeats after the last one, on the
  Redis server's clock, so a worker's state does not depend on clocks agreeing:

  UP      beat within the last 2 heartbeat intervals (10 s);
  STALE   its key is alive but the last beat is older than that (a beat was missed);
  DOWN    it beats, but its engine died and a new one is starting (it takes no jobs);
  LOST    its key expired (no beat for 15 s) without a clean stop: the process died or
          cannot reach Redis; its jobs come back (see docs/operations.md, troubleshooting: "job stuck in `running`");
  STOPPED it stopped cleanly (warm shutdown handed its jobs back).

  LOST and STOPPED workers stay listed for FORGET_AFTER_SECONDS (10 min) after their last
  beat; then `rein top` deletes their registry entry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rein.core.priorities import PRIORITY_BATCH
from rein.core.settings import Settings, SettingsError, load_settings
from rein.store.redis_client import redis_client, redis_location
from rein.store.redis_keys import RedisKeys

if TYPE_CHECKING:
    from redis import Redis

FORGET_AFTER_SECONDS = 600.0
DEFAULT_INTERVAL_SECONDS = 1.0
# Heartbeat period assumed for a beat that does not say (rein.worker.heartbeat.HEARTBEAT_SECONDS).
DEFAULT_HEARTBEAT_SECONDS = 5.0

UP, STALE, LOST, STOPPED, DOWN = "UP", "STALE", "LOST", "STOPPED", "DOWN"
_CLEAR = "\x1b[H\x1b[2J"

MODEL_COLUMNS = ("MODEL", "QUEUED", "INTERACTIVE", "BATCH", "WORKERS", "RUN", "WAIT")
WORKER_COLUMNS = ("WORKER", "MODEL", "STATE", "RUN", "WAIT", "KV%", "TOK/S", "PREEMPT", "STEP ms", "AGE")


@dataclass
class ModelView:
    """One served model: its queue by priority and its workers' engines together."""

    name: str
    queued: int
    interactive: int          # priority steps before PRIORITY_BATCH (interactive jobs: 0)
    batch: int                # PRIORITY_BATCH and after
    workers_up: int
    workers_known: int
    running: int
    waiting: int


@dataclass
class WorkerView:
    """One worker, as its last heartbeat describes it."""

    name: str
    model: str
    state: str
    age_seconds: float        # since its last heartbeat
    running: int | None = None
    max_num_seqs: int | None = None
    waiting: int | None = None
    kv_usage: float | None = None
    tokens_per_second: float | None = None
    preemptions: int | None = None
    step_ms: float | None = None


@dataclass
class Snapshot:
    taken_at: float
    models: list[ModelView]
    workers: list[WorkerView]


# -- reading ----------------------------------------------------------------------------------


def worker_view(beat: dict[str, Any], ttl_ms: int, now: float) -> WorkerView:
    """A worker's view from its last heartbeat and the PTTL of its heartbeat key (-2: gone)."""
    interval = float(beat.get("interval") or DEFAULT_HEARTBEAT_SECONDS)
    if ttl_ms > 0:
        # The key is set with a TTL of 3 intervals at each beat: what is left dates the beat.
        age = max(0.0, 3 * interval - ttl_ms / 1000)
        state = UP if age <= 2 * interval else STALE
        if beat.get("state") == "down":   # the worker lives, its engine died: a new one is starting
            state = DOWN
    else:
        age = max(0.0, now - float(beat.get("time") or 0.0))
        state = STOPPED if beat.get("state") == "stopped" else LOST
    return WorkerView(
        name=str(beat.get("worker")), model=str(beat.get("model")), state=state, age_seconds=age,
        running=beat.get("running"), max_num_seqs=beat.get("max_num_seqs"), waiting=beat.get("waiting"),
        kv_usage=beat.get("kv_usage"), tokens_per_second=beat.get("tokens_per_second"),
        preemptions=beat.get("preemptions"), step_ms=beat.get("step_ms"))


def read_snapshot(redis: Redis, settings: Settings, now: float | None = None) -> Snapshot:
    """Queues and workers as Redis holds them now (two round trips, plus a cleanup if due)."""
    from rein.jobs.queues import queue_keys  # Celery: only for `rein top`

    keys = RedisKeys.from_settings(settings)
    now = time.time() if now is None else now
    beats: dict[str, dict[str, Any]] = {}
    for name, raw in redis.hgetall(keys.workers()).items():
        try:
            beats[name.decode()] = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            continue   # not a heartbeat: skip rather than fail the whole view
    names = sorted(beats)
    model_names = [m.name for m in settings.models]
    model_names += sorted({str(b.get("model")) for b in beats.values()} - set(model_names))

    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.pttl(keys.worker_heartbeat(name))
    for model in model_names:
        for key in queue_keys(settings, model):
            pipe.llen(key)
    replies = pipe.execute()
    ttls, lengths = replies[:len(names)], replies[len(names):]

    workers = [worker_view(beats[name] | {"worker": name}, ttl, now) for name, ttl in zip(names, ttls, strict=True)]
    forgotten = [w.name for w in workers if w.state in (LOST, STOPPED) and w.age_seconds > FORGET_AFTER_SECONDS]
    if forgotten:
        redis.hdel(keys.workers(), *forgotten)
        workers = [w for w in workers if w.name not in forgotten]
    workers.sort(key=lambda w: (w.model, w.name))

    steps = len(lengths) // len(model_names) if model_names else 0
    models = []
    for i, model in enumerate(model_names):
        # queue_keys lists one key per interactive step, then the batch steps' (a key per shard).
        depths = lengths[i * steps:(i + 1) * steps]
        up = [w for w in workers if w.model == model and w.state in (UP, STALE)]
        models.append(ModelView(
            name=model, queued=sum(depths), interactive=sum(depths[:PRIORITY_BATCH]),
            batch=sum(depths[PRIORITY_BATCH:]), workers_up=len(up),
            workers_known=sum(1 for w in workers if w.model == model),
            running=sum(w.running or 0 for w in up), waiting=sum(w.waiting or 0 for w in up)))
    return Snapshot(taken_at=now, models=models, workers=workers)


# -- rendering --------------------------------------------------------------------------------


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


def _or_dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    # Names left-aligned, figures right-aligned: the first column is a name, and so is MODEL/STATE.
    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(cell.ljust(w) if not _numeric(h) else cell.rjust(w)
                         for cell, w, h in zip(cells, widths, header, strict=True)).rstrip()
    return [line(header), *(line(row) for row in rows)]


def _numeric(column: str) -> bool:
    return column not in ("MODEL", "WORKER", "STATE")


def render(snapshot: Snapshot, where: str = "") -> str:
    """The snapshot as the text `rein top` shows: a header, the models, the workers."""
    moment = datetime.fromtimestamp(snapshot.taken_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [f"rein top  {moment}" + (f"  {where}" if where else ""), ""]
    if snapshot.models:
        lines += _table(MODEL_COLUMNS, [
            (m.name, str(m.queued), str(m.interactive), str(m.batch), f"{m.workers_up}/{m.workers_known}",
             str(m.running), str(m.waiting)) for m in snapshot.models])
    else:
        lines.append("no models: REIN_MODELS is empty and no worker has reported")
    lines.append("")
    if snapshot.workers:
        lines += _table(WORKER_COLUMNS, [
            (w.name, w.model, w.state,
             "-" if w.running is None else f"{w.running}/{_or_dash(w.max_num_seqs)}",
             _or_dash(w.waiting), _or_dash(None if w.kv_usage is None else 100 * w.kv_usage, "{:.1f}"),
             _or_dash(w.tokens_per_second, "{:.1f}"), _or_dash(w.preemptions),
             _or_dash(w.step_ms, "{:.1f}"), _age(w.age_seconds)) for w in snapshot.workers])
    else:
        lines.append("no workers have reported (start one with `rein worker --model NAME`)")
    return "\n".join(lines) + "\n"


# -- the command ------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("top", help="live view of queues and workers",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print snapshots as JSON, one per line")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_SECONDS, metavar="SECONDS",
                        help=f"seconds between refreshes (default {DEFAULT_INTERVAL_SECONDS:g})")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from redis.exceptions import RedisError

    if args.interval <= 0:
        print(f"error: --interval must be positive, got {args.interval}", file=sys.stderr)
        return 2
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    redis = redis_client(settings.redis_url, socket_connect_timeout=3, socket_timeout=3)
    location = redis_location(settings.redis_url)
    where = f"redis {location}  prefix {settings.redis_key_prefix}"
    live = sys.stdout.isatty() and not args.json and not args.once
    try:
        while True:
            try:
                snapshot = read_snapshot(redis, settings)
            except RedisError as exc:
                message = (f"error: cannot read from Redis at {location} ({exc}); is it running, and "
                           f"is REIN_REDIS_URL right?")
                if args.once:
                    print(message, file=sys.stderr)
                    return 1
                print((_CLEAR if live else "") + message, file=sys.stderr, flush=True)
            else:
                if args.json:
                    text = json.dumps(asdict(snapshot)) + "\n"
                else:
                    text = (_CLEAR if live else "") + render(snapshot, where)
                sys.stdout.write(text if live or args.once or args.json else text + "\n")
                sys.stdout.flush()
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        redis.close()
