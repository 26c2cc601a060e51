"""`rein api`: serve the intake API with uvicorn (refuses an unmigrated database first)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("api", help="serve the HTTP API (uvicorn)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="address to listen on (default: REIN_API_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default: REIN_API_PORT)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rein.core.db import StoreError, check_migrations_current, make_engine
    from rein.core.settings import SettingsError, load_settings, share_prometheus_multiproc_dir

    overrides = {k: v for k, v in (("api_host", args.host), ("api_port", args.port)) if v is not None}
    try:
        settings = load_settings(**overrides)
        engine = make_engine(settings.database_url)
        try:
            check_migrations_current(engine)
        finally:
            engine.dispose()
    except (SettingsError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from rein.api.app import create_app

    # log_config=None: uvicorn's loggers propagate to rein's handler (rein.core.logging)
    # instead of getting uvicorn's own, so its lines come out as JSON like the rest.
    options = {"host": settings.api_host, "port": settings.api_port, "log_level": "info",
               "log_config": None, "proxy_headers": True}
    if settings.api_workers > 1:
        # Several processes on one socket: uvicorn starts each from the factory below. They
        # share a directory for their Prometheus values, so /metrics on any reports all.
        metrics_dir = tempfile.mkdtemp(prefix="rein-api-metrics-")
        share_prometheus_multiproc_dir(metrics_dir)   # inherited by the processes
        try:
            uvicorn.run(f"{__name__}:app_for_worker_process", factory=True,
                        workers=settings.api_workers, **options)
        finally:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    else:
        uvicorn.run(create_app(settings), **options)
    return 0


def app_for_worker_process():
    """The app of one of several API processes (REIN_API_WORKERS > 1): uvicorn calls this in
    each freshly started process, which reads the settings and sets up logging itself."""
    import logging

    from rein.api.app import create_app
    from rein.core.logging import configure_logging
    from rein.core.settings import load_settings

    settings = load_settings()
    configure_logging(logging.INFO, settings.log_format)
    return create_app(settings)
