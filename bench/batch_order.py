"""Batch lines that share long prefixes, in the order a batch file has them: grouped or interleaved.

    python bench/batch_order.py [--prefixes 8] [--lines 96] [--prefix-tokens 500] [--max-num-seqs 4]
                                [--kv-cache-memory 200MiB] [--threads 2]

SmolLM2-135M (float32, the folder bench/peers.py makes once under ~/.cache/rein/bench), greedy,
16 output tokens a line, EOS ignored. The lines are --prefixes system prompts of random token
ids, each followed by 10-30 tokens of its own, --lines / --prefixes lines per prompt, all
handed to one engine at once (as `rein run-batch` hands a window of lines). Two orders of the
same lines:

* grouped: every line of prompt 0, then of prompt 1, ... (how batch files are usually laid out);
* interleaved: prompt i % prefixes for line i.

It prints, for each, the wall time, the prompt tokens the engine computed (cache hits are not
computed), the prefix cache's hits, and whether both orders gave every line the same tokens.
Lines that arrive together with the same uncached prefix used to compute it side by side
(the grouped order computed 2.3x the prompt tokens); the scheduler now holds the later ones
until the first has cached it (rein.engine.scheduler: `_computing_prefix`).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import ensure_f32_model  # noqa: E402  (bench helpers)

from rein.engine.config import EngineConfig  # noqa: E402
from rein.engine.engine import LLMEngine  # noqa: E402
from rein.engine.sampling_params import SamplingParams  # noqa: E402


def run(folder: Path, lines: list[list[int]], args: argparse.Namespace) -> tuple[dict, dict[int, list[int]]]:
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", max_num_seqs=args.max_num_seqs,
                                    kv_cache_memory=args.kv_cache_memory, max_model_len=2048))
    started = time.perf_counter()
    for i, prompt in enumerate(lines):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(int(out.request_id), []).extend(out.new_token_ids)
    stats = engine.stats
    return {"wall_s": time.perf_counter() - started, "prompt_tokens_computed": stats.prompt_tokens,
            "cache_hits": stats.prefix_cache_hits, "cache_queries": stats.prefix_cache_queries}, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--lines", type=int, default=96)
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="200MiB")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path("~/.cache/rein/bench").expanduser())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = ensure_f32_model(args.cache_dir)
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]
    per_prefix = args.lines // args.prefixes
    own = {(p, j): [rng.randrange(100, 40000) for _ in range(rng.randint(10, 30))]
           for p in range(args.prefixes) for j in range(per_prefix)}
    orders = {"grouped": [(p, j) for p in range(args.prefixes) for j in range(per_prefix)],
              "interleaved": [(p, j) for j in range(per_prefix) for p in range(args.prefixes)]}
    results = {}
    for name, order in orders.items():
        row, tokens = run(folder, [prefixes[p] + own[(p, j)] for p, j in order], args)
        results[name] = {key: tokens[i] for i, key in enumerate(order)}
        print(f"{name:11s}: {row['wall_s']:6.1f} s, prompt tokens computed {row['prompt_tokens_computed']:,}, "
              f"prefix cache hits {row['cache_hits']:,} of {row['cache_queries']:,}", flush=True)
    print(f"same tokens for every line: {results['grouped'] == results['interleaved']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
