"""`rein make-tiny-model DIR`: write a random-weight model of a real architecture.

The model (plus a locally trained byte-level BPE tokenizer) loads with transformers'
Auto classes and with rein; see rein.fixtures.tiny_model. `--embedding` writes an embedding model
shaped like Qwen3-Embedding (sentence-transformers pooling files; `--pooling` picks the
pooling, last token by default; the arch defaults to qwen3). `--thinking` gives the tokenizer
<think> and </think> tokens and Qwen3's chat template (a reasoning model's, for --reasoning-parser).
`--arch qwen2_vl | qwen2_5_vl` writes a vision-language model (rein.fixtures.tiny_vision: its
processor files and a chat template writing the image placeholders). torch is imported only when the command runs, so `rein --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from rein.fixtures.tiny_model import (
    ARCHS,
    EMBEDDING_POOLINGS,
    PRESETS,
    make_tiny_model,
    model_summary,
)

# rein.fixtures.tiny_vision's families (imported when the command runs: it needs transformers).
VISION_ARCHS = ("qwen2_vl", "qwen2_5_vl")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny-model",
        help="write a random-weight model (" + "/".join(ARCHS + VISION_ARCHS) + ") for tests and benchmarks",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    parser.add_argument(
        "--arch", choices=ARCHS + VISION_ARCHS, default=None,
        help="architecture (default: llama; qwen3 with --embedding)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    parser.add_argument(
        "--preset", choices=tuple(PRESETS), default="tiny", help="model size (default: tiny)"
    )
    parser.add_argument(
        "--embedding", action="store_true",
        help="an embedding model for /v1/embeddings (sentence-transformers pooling files)",
    )
    parser.add_argument(
        "--pooling", choices=EMBEDDING_POOLINGS, default=None,
        help="with --embedding: how the model pools its hidden states (default: last)",
    )
    parser.add_argument(
        "--thinking", action="store_true",
        help="a reasoning model's tokenizer: <think> and </think> tokens, Qwen3's chat template (enable_thinking)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.pooling is not None and not args.embedding:
        print("rein make-tiny-model: --pooling needs --embedding", file=sys.stderr)
        return 2
    embedding = (args.pooling or "last") if args.embedding else None
    arch = args.arch or ("qwen3" if args.embedding else "llama")
    if arch in VISION_ARCHS:
        if args.embedding or args.thinking:
            print("rein make-tiny-model: --embedding and --thinking are for text archs", file=sys.stderr)
            return 2
        from rein.fixtures.tiny_vision import tiny_vision_model

        print(tiny_vision_model(args.dir, arch, seed=args.seed, preset=args.preset))
        print(f"arch={arch} vision preset={args.preset} seed={args.seed}")
        return 0
    out = make_tiny_model(args.dir, arch=arch, seed=args.seed, preset=args.preset, embedding=embedding,
                          thinking=args.thinking)
    info = model_summary(out)
    print(out)
    kind = f"embedding pooling={embedding} " if embedding else ""
    print(
        f"arch={info['arch']} {kind}preset={args.preset} seed={args.seed} "
        f"parameters={info['parameters']:,} vocab={info['vocab_size']} "
        f"hidden={info['hidden_size']} layers={info['num_hidden_layers']} "
        f"tied_embeddings={str(info['tie_word_embeddings']).lower()}"
    )
    return 0
