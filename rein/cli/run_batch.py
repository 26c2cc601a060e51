"""`rein run-batch IN.jsonl -o OUT.jsonl --model DIR`: an OpenAI batch file, offline."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rein.cli.engine_flags import (
    CLIError,
    add_engine_options,
    add_lora_modules_option,
    add_model_option,
    add_served_model_name_option,
    build_engine,
    generation_defaults_of,
)
from rein.offline.locations import check_input, check_output
from rein.offline.prefix_order import DEFAULT_WINDOW, ORDERS
from rein.offline.run_batch import format_summary, run_batch


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch input file through the engine, offline",
        description="Answer every line of an OpenAI batch input file (/v1/chat/completions and "
                    "/v1/completions) with an in-process engine. Output lines follow OpenAI's batch "
                    "output format, in the order requests finish; bad lines get error lines naming "
                    "their line number.")
    parser.add_argument("input", metavar="IN.jsonl",
                        help="batch input file, one request per line: a path, s3://bucket/key or an "
                             "https:// URL (streamed)")
    parser.add_argument("-o", "--output", required=True, metavar="OUT.jsonl",
                        help="where the answers go: a path or s3://bucket/key (S3 endpoint and credentials "
                             "from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION)")
    parser.add_argument("--errors", default=None, metavar="ERR.jsonl",
                        help="write error lines here instead of into the output file (a path or s3:// URL)")
    parser.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                        help="requests read ahead into the engine (default 4 x --max-num-seqs)")
    parser.add_argument("--order", choices=ORDERS, default="prefix",
                        help="prefix (default): lines whose prompts share a prefix run together, so the "
                             "prefix cache computes it once, whatever the file's order; file: the file's order")
    parser.add_argument("--order-window", type=int, default=DEFAULT_WINDOW, metavar="LINES",
                        help=f"lines read ahead and ordered by prompt prefix (default {DEFAULT_WINDOW}); "
                             "their tokenized prompts are held in memory")
    add_served_model_name_option(parser)
    add_lora_modules_option(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_model_option(parser)
    add_engine_options(parser, "run-batch")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.order_window < 1:
        print(f"error: --order-window {args.order_window}: want at least 1 line", file=sys.stderr)
        return 2
    try:
        check_input(args.input)
        for output in (args.output, args.errors):
            if output:
                check_output(output)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        adapters = lora_requests(args.lora_modules)
    except ValueError as exc:
        print(f"error: --lora-modules: {exc}", file=sys.stderr)
        return 2
    if adapters:
        args.enable_lora = True
    try:
        engine = build_engine(args, "run-batch")
        defaults = generation_defaults_of(engine)
    except CLIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_batch(engine, args.input, args.output, model_name=args.served_model_name,
                            error_path=args.errors, max_in_flight=args.max_in_flight,
                            progress=not args.no_progress, generation_defaults=defaults, order=args.order,
                            order_window=args.order_window, adapters=adapters)
    except (FileNotFoundError, ValueError) as exc:   # a missing object or URL, a bad location
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {args.output} holds the answers finished so far", file=sys.stderr)
        return 130
    print(format_summary(summary), file=sys.stderr)
    return 0


def lora_requests(text: str | None) -> dict[str, Any]:
    """--lora-modules (else REIN_LORA_MODULES) as name -> LoRARequest; ValueError on a bad entry."""
    from rein.core.settings import parse_lora_modules, setting_or_default
    from rein.jobs.adapters import lora_int_id
    from rein.model.lora.request import LoRARequest

    modules = parse_lora_modules(text) if text else setting_or_default("lora_modules")
    return {m.name: LoRARequest(m.name, lora_int_id(m.name, m.path), m.path) for m in modules}
