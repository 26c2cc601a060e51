"""`rein generate --model DIR "prompt"`: one request, its text streamed to the terminal.

The prompt goes through the same OpenAI request mapping as the API (a completions
prompt, or with --chat a one-message chat), so defaults and errors match.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from rein.cli.engine_flags import (
    CLIError,
    add_engine_options,
    add_model_option,
    build_engine,
    generation_defaults_of,
)
from rein.engine.errors import EngineRequestError
from rein.openai.errors import RequestError
from rein.openai.request import parse_request

DEFAULT_MAX_TOKENS = 128


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate from one prompt, streaming the text",
                                   description="Generate from one prompt and stream the text to stdout; a "
                                               "stats line (tokens, tokens/s, finish reason) goes to stderr.")
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the model's chat template")
    parser.add_argument("--system", default=None, help="with --chat: a system message first")
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help=f"default {DEFAULT_MAX_TOKENS}, or what is left of the context if less")
    # Sampling flags left out take the model's defaults (--generation-config), then rein's.
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="0 is greedy (default: the model's generation_config.json, else 1)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P", help="default: the model's, else 1")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="default: the model's, else none")
    parser.add_argument("--min-p", type=float, default=None, metavar="P", help="default: the model's, else 0")
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                        help="default: the model's, else 1")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="stop before this text (repeatable, up to 4)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    add_model_option(parser)
    # --seed (an engine option) also seeds this request when given, as an API request's seed would.
    add_engine_options(parser, "generate")
    parser.set_defaults(func=run)


def request_body(args: argparse.Namespace) -> tuple[str, dict]:
    """The OpenAI endpoint and body these arguments stand for."""
    body: dict = {
        # Without --max-tokens: parse with 1 (the prompt must leave room for one token), then
        # give it DEFAULT_MAX_TOKENS or what is left of the context.
        "max_tokens": 1 if args.max_tokens is None else args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "repetition_penalty": args.repetition_penalty,
        "stop": args.stop, "seed": args.seed, "ignore_eos": args.ignore_eos or None,
    }
    body = {k: v for k, v in body.items() if v is not None}
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.prompt})
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": args.prompt}


def run(args: argparse.Namespace) -> int:
    try:
        engine = build_engine(args, "generate")
        defaults = generation_defaults_of(engine)
    except CLIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    endpoint, body = request_body(args)
    try:
        parsed = parse_request(endpoint, body, engine.tokenizer, engine.max_model_len, defaults)
        if args.max_tokens is None:
            room = engine.max_model_len - len(parsed.prompt_token_ids)
            parsed.params = dataclasses.replace(parsed.params, max_tokens=max(1, min(DEFAULT_MAX_TOKENS, room)))
        started = time.perf_counter()
        engine.add_request("generate", parsed.prompt_token_ids, parsed.params)
    except (RequestError, EngineRequestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    out = sys.stdout
    first_token = None
    tokens = 0
    finish_reason = None
    try:
        while engine.has_unfinished():
            for output in engine.step():
                if first_token is None and output.new_token_ids:
                    first_token = time.perf_counter()
                tokens += len(output.new_token_ids)
                if output.text_delta:
                    out.write(output.text_delta)
                    out.flush()
                if output.finished:
                    finish_reason = output.finish_reason
    except KeyboardInterrupt:
        finish_reason = "interrupted"
    elapsed = time.perf_counter() - started
    out.write("\n")
    out.flush()
    ttft = f", first token {first_token - started:.2f} s" if first_token is not None else ""
    rate = tokens / elapsed if elapsed > 0 else 0.0
    print(f"[{len(parsed.prompt_token_ids)} prompt tokens, {tokens} tokens in {elapsed:.2f} s "
          f"({rate:.1f} tokens/s{ttft}), finish reason: {finish_reason}]", file=sys.stderr)
    return 130 if finish_reason == "interrupted" else 0
