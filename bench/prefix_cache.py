"""What automatic prefix caching buys on a batch whose requests share a long system prompt.

    python bench/prefix_cache.py [--preset tiny|small] [--requests 64] [--system-tokens 448]
                                 [--max-tokens 16] [--rounds 3] [--threads 1]

The workload (seeded): `--requests` prompts, each one system prompt of `--system-tokens`
random tokens (shared by all) followed by 8 to 48 tokens of its own, all added at once,
greedy with ignore_eos, `--max-tokens` each: the shape of an offline classification or
extraction job. The same LLMEngine settings run it with prefix caching on and off (cpu
fp32, the model of `rein.fixtures.tiny_model` for `--preset`, 2048 tokens a step, 64 sequences),
alternating for `--rounds` rounds after one warm-up of each; figures are the medians.

Reported for each side: wall seconds, requests/s, prompt tokens actually computed (the
engine's counter: cached ones are skipped), the prefix-cache hit rate (hit tokens / prompt
tokens looked up) and the mean time to first token. Printed ratio: caching on / off in
requests/s. The outputs of both sides are compared token for token (they must be equal:
the cache changes what is computed, not what comes out). The last line of stdout is one
JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_model import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 1024


def workload(requests: int, system_tokens: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids below 2000 avoid the tiny vocabulary's special tokens (2043..2047).
    system = [rng.randrange(10, 2000) for _ in range(system_tokens)]
    return [system + [rng.randrange(10, 2000) for _ in range(rng.randint(8, 48))] for _ in range(requests)]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    computed_before = engine.stats.prompt_tokens
    queries_before, hits_before = engine.stats.prefix_cache_queries, engine.stats.prefix_cache_hits
    tokens: dict[str, list[int]] = {}
    first_token: dict[str, float] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.perf_counter() - start
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    wall = time.perf_counter() - start
    if engine.pool.num_used:
        raise RuntimeError(f"{engine.pool.num_used} KV blocks still held after the run")
    queries = engine.stats.prefix_cache_queries - queries_before
    return {"wall_s": wall, "requests_per_s": len(prompts) / wall,
            "prompt_tokens_computed": engine.stats.prompt_tokens - computed_before,
            "hit_rate": (engine.stats.prefix_cache_hits - hits_before) / queries if queries else 0.0,
            "mean_ttft_s": statistics.fmean(first_token.values()), "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=448)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: comparable on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model_dir = ensure_tiny_model(ROOT / ".cache" / "bench-models" / f"llama-{args.preset}", preset=args.preset)
    prompts = workload(args.requests, args.system_tokens)
    engines = {name: LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                            kv_cache_memory="512MiB", max_model_len=MAX_MODEL_LEN,
                                            max_num_seqs=64, enable_prefix_caching=caching))
               for name, caching in (("cached", True), ("uncached", False))}
    for engine in engines.values():   # warm-up
        run(engine, workload(8, args.system_tokens, seed=99), args.max_tokens)
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (("cached", "uncached") if r % 2 == 0 else ("uncached", "cached")):
            engine = engines[name]
            engine.pool.reset_cache()   # each round starts cold: the system prompt is new to it
            rounds[name].append(run(engine, prompts, args.max_tokens))
            print(f"[round {r + 1}] {name:>9}: {rounds[name][-1]['wall_s']:.2f} s", file=sys.stderr, flush=True)

    same = sum(rounds["cached"][0]["tokens"][k] == rounds["uncached"][0]["tokens"][k] for k in rounds["cached"][0]["tokens"])
    figures: dict = {"bench": "prefix_cache", "preset": args.preset, "requests": args.requests,
                     "system_tokens": args.system_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds,
                     "threads": args.threads, "identical_outputs": same}
    print(f"\nprefix caching: {args.requests} requests, a {args.system_tokens}-token shared system prompt + "
          f"8-48 own tokens, {args.max_tokens} output tokens, greedy; {args.preset} llama, cpu fp32, "
          f"{args.threads} torch thread(s); median of {args.rounds} rounds")
    print(f"  {'':10} {'wall s':>8} {'req/s':>8} {'prompt tok computed':>20} {'hit rate':>9} {'mean TTFT s':>12}")
    for name in ("cached", "uncached"):
        side = {key: statistics.median(r[key] for r in rounds[name])
                for key in ("wall_s", "requests_per_s", "prompt_tokens_computed", "hit_rate", "mean_ttft_s")}
        figures[name] = side
        print(f"  {name:10} {side['wall_s']:8.2f} {side['requests_per_s']:8.2f} {side['prompt_tokens_computed']:20.0f} "
              f"{side['hit_rate']:9.1%} {side['mean_ttft_s']:12.3f}")
    figures["ratio_requests_per_s"] = figures["cached"]["requests_per_s"] / figures["uncached"]["requests_per_s"]
    print(f"  caching on / off: {figures['ratio_requests_per_s']:.2f}x requests/s; "
          f"identical outputs: {same}/{args.requests}")
    print(json.dumps(figures))
    return 0 if same == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
