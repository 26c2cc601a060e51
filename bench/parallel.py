"""Tensor parallelism on the CPU: N ranks of one thread each against one rank of N threads.

    python bench/parallel.py [--requests 16] [--sizes 2] [--model FOLDER] [--cache-dir ~/.cache/rein/bench]

The peers' mixed workload (bench/peers.py: prompts of 16-384 tokens cut from its text, 16-192
output tokens, greedy, EOS ignored) runs in one process, one engine after the other:

* TP=1 with as many torch threads as this process has cores;
* TP=N (each of --sizes) with the cores split between the ranks (rein.engine.rank_processes:
  cores // N threads each; one thread per rank on a 2-core machine at N=2), gloo between them.

vLLM's CPU backend splits a model across cores and sockets this way. It prints output tok/s of
each, TP=N over TP=1, and whether both gave the same tokens. There is no target on the CPU:
the point is what the collectives cost against what the split saves.

The model is SmolLM2-135M's shape with 8 query and 4 KV heads (head_dim 72) in place of its 9
and 3, random weights, SmolLM2's tokenizer: SmolLM2's own heads split by 3 but not by 2, and
Gemma 3 270M's one KV head by neither, so neither real model runs at TP=2. With --model, a
model folder of your own (its heads must divide by each size). On a GPU host the same script
measures NCCL ranks on GPUs (--device cuda; one GPU per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import Text, ensure_f32_model, make_workload  # noqa: E402  (bench helpers)
from throughput import rein_generate  # noqa: E402

from rein.engine.config import EngineConfig  # noqa: E402
from rein.engine.engine import LLMEngine  # noqa: E402

SHAPED_FOLDER = "smollm2-shape-8h4kv"


def shaped_model(cache_dir: Path) -> Path:
    """SmolLM2-135M's shape with 8/4 heads, random weights, its tokenizer (made once, cached)."""
    folder = cache_dir / SHAPED_FOLDER
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM

    source = ensure_f32_model(cache_dir)
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, config.hidden_size // 8
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = folder.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(source / name, tmp / name)
    tmp.rename(folder)
    return folder


def run(folder: Path, size: int, device: str, wl, threads: int) -> dict:
    torch.set_num_threads(threads)   # TP=1's; a larger size splits the cores itself
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), device=device, tensor_parallel_size=size,
                                    max_model_len=2048, kv_cache_memory="512MiB", max_num_seqs=64))
    load_s = time.perf_counter() - started
    try:
        rein_generate(engine, [p[:8] for p in wl.prompts[:3]], [4, 4, 4])   # warm-up
        t0 = time.perf_counter()
        tokens = rein_generate(engine, wl.prompts, wl.output_lens)
        wall = time.perf_counter() - t0
        rank_threads = torch.get_num_threads()
    finally:
        engine.close()
    outs = [tokens[f"r{i}"] for i in range(wl.num_requests)]
    produced = sum(map(len, outs))
    return {"tensor_parallel_size": size, "threads_per_rank": rank_threads, "tps": produced / wall,
            "wall_s": wall, "load_s": load_s, "output_tokens": produced, "_tokens": outs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--sizes", default="2", help="comma-separated tensor-parallel sizes to set against TP=1")
    ap.add_argument("--model", type=Path, default=None, help="a model folder (default: SmolLM2's shape, 8/4 heads)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cache-dir", type=Path, default=Path("~/.cache/rein/bench").expanduser())
    args = ap.parse_args(argv)
    folder = args.model or shaped_model(args.cache_dir)
    from transformers import AutoTokenizer

    wl = make_workload("mixed", Text(AutoTokenizer.from_pretrained(folder)), args.requests, 1)
    cores = len(os.sched_getaffinity(0))
    print(f"# {folder.name}: {wl.num_requests} requests (mixed), {cores} cores, device {args.device}", flush=True)
    one = run(folder, 1, args.device, wl, cores)
    print(f"TP=1 ({one['threads_per_rank']} threads): {one['tps']:.1f} tok/s", flush=True)
    report = {"model": str(folder), "cores": cores, "requests": wl.num_requests, "tp1": one, "sizes": {}}
    for size in map(int, args.sizes.split(",")):
        many = run(folder, size, args.device, wl, cores)
        same = many["_tokens"] == one["_tokens"]
        report["sizes"][size] = {**many, "over_tp1": many["tps"] / one["tps"], "same_tokens": same}
        print(f"TP={size} ({many['threads_per_rank']} thread(s) per rank): {many['tps']:.1f} tok/s = "
              f"{many['tps'] / one['tps']:.2f}x TP=1 | same tokens: {same}", flush=True)
    for row in (one, *report["sizes"].values()):
        row.pop("_tokens")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
