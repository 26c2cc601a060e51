"""Batch lines that share long prefixes: the file's layout (grouped or interleaved) and the
order `rein run-batch` takes them in (--order file or prefix).

    python bench/batch_order.py [--part layout|order|sweep|all] [--prefixes 8] [--lines 96]
                                [--prefix-tokens 500] [--max-num-seqs 4] [--kv-cache-memory 200MiB]
                                [--order-lines 400] [--order-kv-cache-memory 100MiB]
                                [--sweep 2,3,4,6,8] [--sweep-lines 96] [--threads 2]

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

Part "order": more distinct prompts than the KV cache holds. --order-lines lines, interleaved
over --prefixes prompts, through `rein.offline.run_batch` (the code behind `rein run-batch`) with
--order file and --order prefix, a KV cache of --order-kv-cache-memory (100 MiB: about 2,200
tokens of SmolLM2's float32 KV, four of the 500-token prompts, while the four running lines of
the file's order hold four different ones). It prints output tok/s and prompt tokens computed for
each order, prefix over file, and whether every line got the same tokens. Part "sweep": the same
for --sweep-lines lines over each count of prompts in --sweep, to show where the file's order
starts to lose.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import ensure_f32_model  # noqa: E402  (bench helpers)

from rein.engine.config import EngineConfig  # noqa: E402
from rein.engine.engine import LLMEngine  # noqa: E402
from rein.engine.sampling_params import SamplingParams  # noqa: E402
from rein.offline.run_batch import run_batch  # noqa: E402

MAX_TOKENS = 16


def run(folder: Path, lines: list[list[int]], args: argparse.Namespace) -> tuple[dict, dict[int, list[int]]]:
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", max_num_seqs=args.max_num_seqs,
                                    kv_cache_memory=args.kv_cache_memory, max_model_len=2048))
    started = time.perf_counter()
    for i, prompt in enumerate(lines):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(int(out.request_id), []).extend(out.new_token_ids)
    stats = engine.stats
    return {"wall_s": time.perf_counter() - started, "prompt_tokens_computed": stats.prompt_tokens,
            "cache_hits": stats.prefix_cache_hits, "cache_queries": stats.prefix_cache_queries}, tokens


def prompts_of(args: argparse.Namespace, count: int, lines: int, rng: random.Random
               ) -> tuple[list[list[int]], dict[tuple[int, int], list[int]]]:
    """`count` shared prompts and each line's own tokens after its prompt (lines // count a prompt)."""
    prefixes = [[rng.randrange(100, 40000) for _ in range(args.prefix_tokens)] for _ in range(count)]
    own = {(p, j): [rng.randrange(100, 40000) for _ in range(rng.randint(10, 30))]
           for p in range(count) for j in range(lines // count)}
    return prefixes, own


def layout(folder: Path, args: argparse.Namespace) -> None:
    """The same lines grouped by prompt or interleaved, all handed to one engine at once."""
    prefixes, own = prompts_of(args, args.prefixes, args.lines, random.Random(0))
    per_prefix = args.lines // args.prefixes
    orders = {"grouped": [(p, j) for p in range(args.prefixes) for j in range(per_prefix)],
              "interleaved": [(p, j) for j in range(per_prefix) for p in range(args.prefixes)]}
    results = {}
    for name, order in orders.items():
        row, tokens = run(folder, [prefixes[p] + own[(p, j)] for p, j in order], args)
        results[name] = {key: tokens[i] for i, key in enumerate(order)}
        print(f"{name:11s}: {row['wall_s']:6.1f} s, prompt tokens computed {row['prompt_tokens_computed']:,}, "
              f"prefix cache hits {row['cache_hits']:,} of {row['cache_queries']:,}", flush=True)
    print(f"same tokens for every line: {results['grouped'] == results['interleaved']}")


def run_batch_orders(folder: Path, args: argparse.Namespace, count: int, lines: int, work: Path) -> dict:
    """`lines` lines interleaved over `count` prompts through run_batch, in file and prefix order."""
    prefixes, own = prompts_of(args, count, lines, random.Random(count))
    source = work / f"in-{count}.jsonl"
    with source.open("w") as f:
        for j in range(lines // count):
            for p in range(count):
                f.write(json.dumps({"custom_id": f"p{p}-{j}", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": prefixes[p] + own[(p, j)], "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "ignore_eos": True}}) + "\n")
    row: dict = {"prompts": count, "lines": lines}
    texts = {}
    for order in ("file", "prefix"):
        engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", max_num_seqs=args.max_num_seqs,
                                        kv_cache_memory=args.order_kv_cache_memory, max_model_len=1024))
        out = work / f"out-{count}-{order}.jsonl"
        summary = run_batch(engine, source, out, progress=False, order=order)
        answers = [json.loads(line) for line in out.read_text().splitlines()]
        texts[order] = {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers
                        if a["error"] is None}
        row[order] = {"output_tok_s": summary.output_tokens_per_second, "wall_s": summary.wall_seconds,
                      "prompt_tokens_computed": engine.stats.prompt_tokens, "failed": summary.requests_failed}
        print(f"  {count} prompts, {order:6s} order: {summary.output_tokens_per_second:6.1f} output tok/s, "
              f"{summary.wall_seconds:6.1f} s, prompt tokens computed {engine.stats.prompt_tokens:,}", flush=True)
    row["prefix_over_file"] = row["prefix"]["output_tok_s"] / row["file"]["output_tok_s"]
    row["same_tokens"] = texts["file"] == texts["prefix"] and len(texts["file"]) == lines
    print(f"  prefix / file: {row['prefix_over_file']:.2f}x, same answers for every line: {row['same_tokens']}",
          flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("layout", "order", "sweep", "all"), default="all")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--lines", type=int, default=96)
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--kv-cache-memory", default="200MiB")
    ap.add_argument("--order-lines", type=int, default=400)
    ap.add_argument("--order-kv-cache-memory", default="100MiB")
    ap.add_argument("--sweep", default="2,3,4,6,8", help="prompt counts for the sweep")
    ap.add_argument("--sweep-lines", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=Path("~/.cache/rein/bench").expanduser())
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder = ensure_f32_model(args.cache_dir)
    report: dict = {}
    if args.part in ("layout", "all"):
        print("# the file's layout: grouped by prompt or interleaved, all lines in one engine")
        layout(folder, args)
    with tempfile.TemporaryDirectory() as work:
        if args.part in ("order", "all"):
            print(f"# run-batch --order file vs prefix: {args.order_lines} lines over {args.prefixes} prompts, "
                  f"KV cache {args.order_kv_cache_memory}")
            report["order"] = run_batch_orders(folder, args, args.prefixes, args.order_lines, Path(work))
        if args.part in ("sweep", "all"):
            print(f"# where the file's order starts to lose: {args.sweep_lines} lines, KV cache "
                  f"{args.order_kv_cache_memory}")
            report["sweep"] = [run_batch_orders(folder, args, int(count), args.sweep_lines, Path(work))
                               for count in args.sweep.split(",")]
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
