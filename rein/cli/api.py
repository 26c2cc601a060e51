"""`rein api`: serve the intake API with uvicorn (refuses placeholder passwords in its
connection URLs and an unmigrated database first)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

from rein.cli.engine_flags import add_engine_options, add_lora_modules_option
from rein.core.logging import configure_logging
from rein.core.settings import (
    SettingsError,
    load_settings,
    refuse_placeholder_secrets,
    share_prometheus_multiproc_dir,
    share_settings_overrides,
)
from rein.engine.options import API, options_for


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("api", help="serve the HTTP API (uvicorn)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="address to listen on (default: REIN_API_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default: REIN_API_PORT)")
    parser.add_argument("--workers", type=int, default=None,
                        help="API processes on the port (uvicorn workers; default: REIN_API_WORKERS, 1)")
    parser.add_argument("--root-path", default=None,
                        help="path prefix a proxy serves the API under, e.g. /rein (default: REIN_API_ROOT_PATH)")
    parser.add_argument("--forwarded-allow-ips", default=None,
                        help="proxies whose X-Forwarded-* headers are trusted, comma separated or '*' "
                             "(default: REIN_FORWARDED_ALLOW_IPS, else uvicorn's 127.0.0.1)")
    parser.add_argument("--allowed-origins", default=None,
                        help="origins browser pages may call the API from (CORS), comma separated or '*' "
                             "(default: REIN_ALLOWED_ORIGINS, none: no CORS headers)")
    # The API applies the model's generation defaults and checks the context length itself.
    add_engine_options(parser, API)
    add_lora_modules_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # SQLAlchemy loads when the API starts, not with every command.
    from rein.store.db import StoreError, check_migrations_current, make_engine
    from rein.store.s3 import BucketUnusableError, check_files_url

    flags = (("api_host", args.host), ("api_port", args.port), ("api_workers", args.workers),
             ("api_root_path", args.root_path), ("forwarded_allow_ips", args.forwarded_allow_ips),
             ("allowed_origins", args.allowed_origins), ("lora_modules", args.lora_modules),
             *((option.name, getattr(args, option.name)) for option in options_for(API)))
    overrides = {name: value for name, value in flags if value is not None}
    try:
        settings = load_settings(**overrides)
        refuse_placeholder_secrets(settings)
        engine = make_engine(settings.database_url)
        try:
            check_migrations_current(engine)
        finally:
            engine.dispose()
        # Here too (the app checks again in each process): a refusal in one line, not under
        # uvicorn's traceback.
        check_files_url(settings, log_refusal=False)
    except (SettingsError, StoreError, BucketUnusableError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    # The app's processes (this one too) build their settings from the environment.
    share_settings_overrides(**overrides)
    # log_config=None: uvicorn's loggers propagate to rein's handler (rein.core.logging)
    # instead of getting uvicorn's own, so its lines come out as JSON like the rest.
    # Always an import string and an explicit worker count: uvicorn reads WEB_CONCURRENCY when
    # `workers` is not given, and refuses an app object with more than one worker.
    options = uvicorn_options(settings)
    metrics_dir = None
    if settings.api_workers > 1:
        # Several processes on one socket share a directory for their Prometheus values, so
        # /metrics on any reports all.
        metrics_dir = tempfile.mkdtemp(prefix="rein-api-metrics-")
        share_prometheus_multiproc_dir(metrics_dir)   # inherited by the processes
    try:
        uvicorn.run(f"{__name__}:app_for_worker_process", factory=True, **options)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def uvicorn_options(settings) -> dict:
    """uvicorn.run's options for these settings (the app itself: `app_for_worker_process`)."""
    options = {"host": settings.api_host, "port": settings.api_port, "log_level": "info",
               "log_config": None, "proxy_headers": True, "workers": settings.api_workers,
               "root_path": settings.api_root_path}
    if settings.forwarded_allow_ips is not None:
        options["forwarded_allow_ips"] = settings.forwarded_allow_ips
    return options


def app_for_worker_process():
    """The app of an API process: uvicorn calls this in the process that serves it (each of
    them, with REIN_API_WORKERS > 1), which reads the settings and sets up logging itself."""
    import logging

    from rein.api.app import create_app  # FastAPI, SQLAlchemy, Celery: only in an API process

    settings = load_settings()
    if not any(getattr(h, "rein_handler", False) for h in logging.getLogger().handlers):
        configure_logging(logging.INFO, settings.log_format)   # a fresh process (not `rein api` itself)
    return create_app(settings)
