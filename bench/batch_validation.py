"""How long the batch manager takes to turn a 50,000-line batch file into queued jobs.

    python bench/batch_validation.py [--lines 50000] [--endpoint /v1/chat/completions]
                                     [--long-line-mb 20] [--postgres-url URL] [--redis-url URL]

Writes a batch input file of `--lines` small requests (max_tokens 16) for the tiny llama
(.cache/bench-models/llama-tiny, built if missing), records a batch for it in a throwaway
database `rein_bench_<random>` (dropped at the end) and times one step of the real
BatchManager: read and validate every line (tokenize, context check), then COPY the jobs in
and mark the batch in_progress. Then one feed step (the first REIN_BATCH_QUEUE_WINDOW
messages sent, under a throwaway Redis key prefix, deleted at the end). Then the memory a
long line costs: a file of a few lines and one of `--long-line-mb` MB (numbers, as JSON
parses dearly) checked under the default REIN_MAX_REQUEST_BYTES, its peak of Python allocations
(tracemalloc) beside that of json.loads on the same line, which is what reading the line
whole would cost at the least (0: skip). Prints the figures, then one JSON object. No worker runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import secrets
import tempfile
import time
import tracemalloc
from datetime import timedelta
from pathlib import Path

MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache" / "bench-models" / "llama-tiny"


def request_body(endpoint: str, i: int) -> dict:
    text = f"Tell me about item {i} in a few words"
    if endpoint == "/v1/chat/completions":
        return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 16}
    return {"model": "tiny", "prompt": text, "max_tokens": 16}


def long_line_memory(registry, endpoint: str, megabytes: float, max_line_bytes: int) -> dict:
    """Peak Python allocations validating a file with one `megabytes` MB line, against json.loads of it."""
    from rein.batches.validation import validate_lines
    from rein.openai.batch_lines import read_lines

    def line(i: int, **extra) -> str:
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": endpoint,
                           "body": request_body(endpoint, i), **extra}, separators=(",", ":"))

    long_line = line(1, pad=[0] * int(megabytes * 1e6 / 2))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "long.jsonl"
        path.write_text("\n".join([line(0), long_line, line(2)]) + "\n")
        gc.collect()
        tracemalloc.start()
        with open(path, "rb") as source:
            result = validate_lines(read_lines(source, max_line_bytes), endpoint, registry, 10)
        validation_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    tracemalloc.start()
    json.loads(long_line)
    parse_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"long_line_bytes": len(long_line), "max_line_bytes": max_line_bytes,
            "long_line_errors": [error["code"] for error in result.errors],
            "long_line_validation_peak_mib": round(validation_peak / 2**20, 2),
            "long_line_parse_peak_mib": round(parse_peak / 2**20, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--endpoint", default="/v1/chat/completions",
                        choices=["/v1/chat/completions", "/v1/completions"])
    parser.add_argument("--long-line-mb", type=float, default=20.0,
                        help="size of the long line whose validation memory is measured (0: skip)")
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    args = parser.parse_args()

    from redis import Redis
    from sqlalchemy import func, select
    from sqlalchemy.engine import make_url
    from sqlalchemy.orm import sessionmaker

    from rein.batches.manager import BatchManager
    from rein.core.settings import Settings
    from rein.fixtures.tiny_model import ensure_tiny_model
    from rein.jobs.queues import make_celery
    from rein.jobs.registry import ModelRegistry
    from rein.store.db import make_engine, psycopg_conninfo
    from rein.store.filestore import LocalFileStore
    from rein.store.keys import create_key
    from rein.store.migrate import upgrade
    from rein.store.tables import Batch, File, Job

    model = ensure_tiny_model(MODEL_DIR, arch="llama", seed=0, preset="tiny")
    run = secrets.token_hex(4)
    server = make_url(args.postgres_url)
    database = server.set(database=f"rein_bench_{run}").render_as_string(hide_password=False)
    files = tempfile.TemporaryDirectory()
    settings = Settings(database_url=database, redis_url=args.redis_url, redis_key_prefix=f"rein_bench_{run}:",
                        models=f"tiny={model}@1024", files_dir=files.name)
    redis = Redis.from_url(args.redis_url)
    engine = None
    try:
        upgrade(settings)
        engine = make_engine(database)
        sessions = sessionmaker(engine, expire_on_commit=False)
        store = LocalFileStore(settings.files_dir)
        content = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": args.endpoint,
                                      "body": request_body(args.endpoint, i)}) + "\n"
                          for i in range(args.lines)).encode()
        with sessions.begin() as session:
            key = create_key(session, name="bench", tenant="bench", scopes="batch").info
            file = File(tenant="bench", key_id=key.key_id, filename="in.jsonl", purpose="batch",
                        bytes=store.save("file-bench", [content]), id="file-bench")
            session.add(file)
            batch = Batch(tenant="bench", key_id=key.key_id, endpoint=args.endpoint, input_file_id=file.id,
                          completion_window="24h", expires_at=func.now() + timedelta(days=1))
            session.add(batch)
        registry = ModelRegistry.load(settings)
        manager = BatchManager(settings, sessions, redis, make_celery(settings), registry, store)
        started = time.perf_counter()
        manager.advance(batch.id)
        validated_and_stored = time.perf_counter() - started
        started = time.perf_counter()
        manager.advance(batch.id)
        fed = time.perf_counter() - started
        with sessions() as session:
            status = session.scalar(select(Batch.status).where(Batch.id == batch.id))
            jobs = session.scalar(select(func.count()).select_from(Job).where(Job.batch_id == batch.id))
            sent = session.scalar(select(func.count()).select_from(Job)
                                  .where(Job.batch_id == batch.id, Job.sent_at.is_not(None)))
        print(f"{args.lines} lines ({len(content) / 1e6:.1f} MB, {args.endpoint}): validated and stored in "
              f"{validated_and_stored:.1f} s ({args.lines / validated_and_stored:.0f} lines/s); status {status}, "
              f"{jobs} jobs; first feed: {sent} messages in {fed * 1000:.0f} ms")
        figures = {"lines": args.lines, "endpoint": args.endpoint, "status": status, "jobs": jobs,
                   "validate_and_store_seconds": round(validated_and_stored, 2),
                   "first_feed_messages": sent, "first_feed_ms": round(fed * 1000, 1)}
        if args.long_line_mb > 0:
            memory = long_line_memory(registry, args.endpoint, args.long_line_mb, settings.max_request_bytes)
            print(f"a {memory['long_line_bytes'] / 1e6:.1f} MB line under a {settings.max_request_bytes / 2**20:.0f} "
                  f"MiB cap: {', '.join(memory['long_line_errors']) or 'no error'}; validation peak "
                  f"{memory['long_line_validation_peak_mib']:.2f} MiB, json.loads of the line alone "
                  f"{memory['long_line_parse_peak_mib']:.0f} MiB")
            figures |= memory
        print(json.dumps(figures))
    finally:
        if engine is not None:
            engine.dispose()
        for key in redis.scan_iter(match=f"rein_bench_{run}:*"):
            redis.delete(key)
        redis.close()
        import psycopg

        with psycopg.connect(autocommit=True, **psycopg_conninfo(server)) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "rein_bench_{run}" WITH (FORCE)')
        files.cleanup()


if __name__ == "__main__":
    main()
