"""`rein worker --model NAME`: a Celery worker serving one model from its queue.

NAME is a served model (REIN_MODELS); without --model, the first one. The worker uses
the threads pool with one thread per engine sequence (REIN_MAX_NUM_SEQS, or
--concurrency, which sets both), loads the engine once, and refuses to start when the
database is not migrated. SIGTERM (or Ctrl-C) is a warm shutdown that hands running jobs
back to the queue and exits within seconds.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("worker", help="run a worker for one served model",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="a model name from REIN_MODELS (default: the first)")
    parser.add_argument("--concurrency", type=int, default=None, metavar="N",
                        help="jobs run at once, and the engine's max sequences (default: REIN_MAX_NUM_SEQS)")
    parser.add_argument("--loglevel", default="info", choices=("debug", "info", "warning", "error"),
                        help="worker log level (default info)")
    parser.add_argument("--hostname", default=None, metavar="NAME",
                        help="worker node name (default MODEL@host)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on PORT at /metrics; 0: none "
                             "(default: REIN_WORKER_METRICS_PORT, unset: none)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rein.core.db import StoreError, check_migrations_current, make_engine
    from rein.core.settings import SettingsError, get_settings

    try:
        settings = get_settings()
        served = settings.served_model(args.model) if args.model else settings.default_model
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if served is None:
        names = ", ".join(m.name for m in settings.models) or "none (REIN_MODELS is empty)"
        print(f"error: model {args.model!r} is not served; served models: {names}", file=sys.stderr)
        return 2
    if args.concurrency is not None:
        if args.concurrency < 1:
            print(f"error: --concurrency must be at least 1, got {args.concurrency}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"max_num_seqs": args.concurrency})
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port <= 65535:
            print(f"error: --metrics-port must be 0 (none) to 65535, got {args.metrics_port}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"worker_metrics_port": args.metrics_port})

    db = make_engine(settings.database_url)
    try:
        check_migrations_current(db)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        db.dispose()

    from rein.engine.config import EngineConfig
    from rein.model_files import resolve_model
    from rein.worker.app import make_celery
    from rein.worker.bootstep import EngineThreadPool, WorkerSpec, configure_worker

    try:
        # The bootstep loads the engine; a model that cannot be found fails here, in one line.
        resolve_model(served.source)
        config = EngineConfig(
            model=served.source, device=settings.device, dtype=settings.dtype,
            kv_cache_dtype=settings.kv_cache_dtype, kv_cache_memory=settings.kv_cache_memory,
            max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=served.max_model_len, enforce_eager=settings.enforce_eager,
            enable_prefix_caching=settings.enable_prefix_caching)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    app = make_celery(settings)
    _keep_rein_logging(app, args.loglevel)
    configure_worker(app, WorkerSpec(settings=settings, model_name=served.name, engine_config=config))
    from rein.core.redis_keys import RedisKeys

    worker = app.Worker(
        hostname=args.hostname or f"{served.name}@{socket.gethostname()}",
        queues=[RedisKeys.from_settings(settings).queue(served.name)],
        pool_cls=EngineThreadPool,
        concurrency=settings.max_num_seqs,
        loglevel=args.loglevel.upper(),
        without_gossip=True,
        without_mingle=True,
        optimization="fair",
    )
    worker.start()
    return int(worker.exitcode or 0)


def _keep_rein_logging(app: Any, loglevel: str) -> None:
    """Celery logs through rein's handler (rein.core.logging) instead of replacing it.

    A receiver of Celery's `setup_logging` signal stops Celery from configuring logging at
    all (it would otherwise hijack the root logger with its own format); without the
    stdout redirect, rein's handler writing to stderr cannot loop back into logging.
    """
    import logging

    from celery.signals import setup_logging

    setup_logging.connect(_logging_is_configured, weak=False)
    app.conf.worker_hijack_root_logger = False
    app.conf.worker_redirect_stdouts = False
    logging.getLogger().setLevel(loglevel.upper())


def _logging_is_configured(**_: object) -> None:
    """Celery's setup_logging receiver: rein.cli.main has configured logging already."""
