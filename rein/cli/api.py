"""`rein api`: serve the intake API with uvicorn (refuses an unmigrated database first)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("api", help="serve the HTTP API (uvicorn)",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--host", default=None, help="address to listen on (default: REIN_API_HOST)")
    parser.add_argument("--port", type=int, default=None, help="port to listen on (default: REIN_API_PORT)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rein.core.db import StoreError, check_migrations_current, make_engine
    from rein.core.settings import SettingsError, load_settings

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
    uvicorn.run(create_app(settings), host=settings.api_host, port=settings.api_port,
                log_level="info", log_config=None, proxy_headers=True)
    return 0
