"""Entry point of the `rein` console script.

Each subcommand lives in its own module under rein/cli/ exposing
`register(subparsers)`, which adds its parser and sets `func` to a callable taking the
parsed args and returning an exit code. Modules are imported lazily by name so that
`rein --help` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from rein.core.logging import LogFormat, configure_logging, configured_elsewhere
from rein.core.settings import SettingsError, get_settings

SUBCOMMANDS = {
    "make-tiny-model": "rein.cli.make_tiny_model",
    "fetch-model": "rein.cli.fetch_model",
    "run-batch": "rein.cli.run_batch",
    "generate": "rein.cli.generate",
    "estimate": "rein.cli.estimate",
    "worker": "rein.cli.worker",
    "migrate": "rein.cli.migrate",
    "keys": "rein.cli.keys",
    "api": "rein.cli.api",
    "up": "rein.cli.up",
    "batch": "rein.cli.batch",
    "top": "rein.cli.top",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rein", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not configured_elsewhere():
        configure_logging(logging.DEBUG if args.verbose else logging.INFO, _log_format())
    return int(args.func(args) or 0)


def _log_format() -> LogFormat:
    """REIN_LOG_FORMAT; 'auto' when the settings cannot load (the subcommand says why)."""
    try:
        return get_settings().log_format
    except SettingsError:
        return "auto"


if __name__ == "__main__":
    sys.exit(main())
