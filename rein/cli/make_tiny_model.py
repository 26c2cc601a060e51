"""`rein make-tiny-model DIR`: write a random-weight model of a real architecture.

The model (plus a locally trained byte-level BPE tokenizer) loads with transformers'
Auto classes and with rein; see rein.tiny_model. torch is imported only when the command
runs, so `rein --help` stays fast.
"""

from __future__ import annotations

import argparse

from rein.tiny_model import ARCHS, PRESETS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="write a random-weight model (llama/qwen2/qwen3/mistral) for tests and benchmarks",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument(
        "--arch", choices=ARCHS, default="llama", help="architecture (default: llama)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--preset", choices=tuple(PRESETS), default="tiny", help="model size (default: tiny)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rein.tiny_model import make_tiny_model, model_summary

    out = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, preset=args.preset)
    info = model_summary(out)
    print(out)
    print(
        f"arch={info['arch']} preset={args.preset} seed={args.seed} "
        f"parameters={info['parameters']:,} vocab={info['vocab_size']} "
        f"hidden={info['hidden_size']} layers={info['num_hidden_layers']} "
        f"tied_embeddings={str(info['tie_word_embeddings']).lower()}"
    )
    return 0
