"""Engine decode speed on a 0.5B-shaped model against the HBM bandwidth bound (part of gpu_check).

    python bench/gpu_decode.py [--device cuda|cpu] [--hbm-tbps 4.8] [--batches 64,256] [--vocab 151936]
                               [--profile STEPS [--trace trace.json]]

A random-weight model of Qwen2-0.5B's shape (Qwen2ForCausalLM from transformers' own config
class: hidden 896, 24 layers, 14 heads, 2 KV heads, head_dim 64, intermediate 4864, tied
embeddings, q/k/v bias, the full 151,936-token vocabulary: 494M parameters) with the tiny
model's tokenizer (token ids past its vocabulary decode to nothing). One engine (bf16
weights and KV cache, CUDA graphs, max_num_seqs = the largest batch) runs, for each batch
size B, B requests of 128 random prompt tokens, greedy, ignore_eos, all added at once; after
the prefill steps every step is a decode of B rows. The first decode steps are a warm-up;
over the next ones it takes the median of

* the engine step (`engine.step()`: schedule, forward, sampling, detokenize), and
* the runner's `execute` alone (synchronized before and after, as bench/attention_kernels.py's
  DecodeProbe does; replaying the CUDA graph of the batch),

and compares them with the bandwidth bound of the step: (weight bytes + K/V bytes read) /
HBM bandwidth, where weight bytes = every parameter once in the weights' dtype (an untied
input embedding left out: only its looked-up rows are read) and K/V bytes = the requests'
context lengths summed x the cache's bytes per token (K and V, all layers). ratio = bound /
step time (1.0 would be a step that only streams its bytes at the peak). Target: the batch-64
engine step at >= 35% of the bound (issue 47). The 8B shape's decode, prefill and the GPU's
idle share are bench/gpu_targets.py.

With --device cpu (gpu_check's CPU mode) the same code runs on a tiny shape at batches 4 and
8; the ratio is printed but not judged.

--profile STEPS then splits a decode step of the first batch size (`profile_batch`: the plan,
the host copies with the graph replay, the replay alone (forward, logits and argmax: the graph
is the whole step, rein/engine/cuda_graphs.py), each synchronized) and
prints torch.profiler's tables over STEPS engine steps (docs/benchmarks.md has the H200's).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Qwen2-0.5B (Qwen/Qwen2-0.5B config.json); max_position_embeddings cut to what the check uses.
QWEN2_05B_SHAPE = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936}
CPU_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096}
TARGET_RATIO = 0.35     # of the bound, for the batch-64 engine step (issue 47)
TARGET_BATCH = 64
BATCHED_TOKENS = 2048   # the engine's step budget (EngineConfig.max_num_batched_tokens default)


def sizes(device: str) -> dict:
    """What the check runs: the full shape on CUDA, a tiny one on CPU."""
    if device == "cuda":
        return {"shape": dict(QWEN2_05B_SHAPE), "batches": [64, 256], "prompt_len": 128, "warmup_steps": 8,
                "timed_steps": 40, "dtype": "bfloat16", "name": "qwen2-0.5b-shape"}
    return {"shape": dict(CPU_SHAPE), "batches": [4, 8], "prompt_len": 16, "warmup_steps": 2,
            "timed_steps": 6, "dtype": "float32", "name": "qwen2-tiny-shape"}


class StepTimer:
    """Per engine step: the step's wall time, and (for steps that only decode) the runner's
    execute time, synchronized, with the batch and the summed context length."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.cuda = self.runner.device.type == "cuda"
        self.last: tuple[int, int, float] | None = None

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.runner.device)

    def __enter__(self) -> StepTimer:
        execute = self.runner.execute

        def timed(scheduled):
            self._sync()
            start = time.perf_counter()
            result = execute(scheduled)
            self._sync()
            if all(s.num_new_tokens == 1 for s in scheduled):
                self.last = (len(scheduled), sum(s.end for s in scheduled), time.perf_counter() - start)
            else:
                self.last = None
            return result

        self.runner.execute = timed   # an instance attribute shadowing the method; removed on exit
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute

    def step(self) -> tuple[int, int, float, float] | None:
        """One engine step; (batch, context sum, step s, execute s) when it only decoded."""
        self.last = None
        start = time.perf_counter()
        self.engine.step()
        wall = time.perf_counter() - start
        if self.last is None:
            return None
        batch, context, execute_s = self.last
        return batch, context, wall, execute_s


def max_tokens(batch: int, prompt_len: int, warmup_steps: int, timed_steps: int) -> int:
    """Output tokens per request such that all `batch` requests still decode together for
    warmup + timed steps after the last prefill: the prefill chunks (a 2048-token budget per
    step) let the first requests start decoding that many steps earlier."""
    prefill_steps = -(-batch * prompt_len // BATCHED_TOKENS)
    return 1 + prefill_steps + warmup_steps + timed_steps + 2


def run_batch(engine, batch: int, prompt_len: int, warmup_steps: int, timed_steps: int,
              weight_bytes: int, kv_per_token: int, tbps: float, seed: int) -> dict:
    from rein.engine import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens(batch, prompt_len, warmup_steps, timed_steps),
                            temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [rng.randrange(10, 2000) for _ in range(prompt_len)], params)
    decodes: list[tuple[int, int, float, float]] = []
    started = time.perf_counter()
    steps = 0
    with StepTimer(engine) as timer:
        while engine.has_unfinished():
            record = timer.step()
            steps += 1
            if record is not None and record[0] == batch:
                decodes.append(record)
    wall = time.perf_counter() - started
    if engine.pool.num_used:
        raise RuntimeError(f"{engine.pool.num_used} KV blocks still in use after the batch-{batch} run")
    timed = decodes[warmup_steps:warmup_steps + timed_steps]
    if not timed:
        raise RuntimeError(f"no decode-only steps of {batch} rows were seen ({steps} steps, "
                           f"{engine.stats.preemptions} preemptions)")
    step_s = statistics.median(r[2] for r in timed)
    execute_s = statistics.median(r[3] for r in timed)
    context = statistics.median(r[1] for r in timed)
    nbytes = weight_bytes + context * kv_per_token
    bound_s = nbytes / (tbps * 1e12)
    return {
        "batch": batch, "decode_steps_timed": len(timed), "median_context_sum": context,
        "step_ms": 1e3 * step_s, "execute_ms": 1e3 * execute_s,
        "bound_ms": 1e3 * bound_s, "weight_gb": weight_bytes / 1e9, "kv_gb": context * kv_per_token / 1e9,
        "ratio": bound_s / step_s, "execute_ratio": bound_s / execute_s,
        "decode_tokens_per_s": batch / step_s,
        "wall_s": wall, "preemptions": engine.stats.preemptions,
    }


def profile_batch(engine, batch: int, prompt_len: int, warmup_steps: int, steps: int, trace: Path | None) -> None:
    """Where a decode step of `batch` rows spends its time: the step split into the runner's
    parts, each synchronized and timed alone over the same decode (the plan and host copies,
    the replay of the greedy graph: forward, logits and argmax), then
    torch.profiler's CPU and CUDA tables over `steps` engine steps (and a Chrome trace to
    `trace`)."""
    from torch.profiler import ProfilerActivity, profile

    from rein.engine import SamplingParams
    from rein.engine.cuda_graphs import GREEDY

    runner = engine.runner
    rng = random.Random(batch + 1)
    params = SamplingParams(max_tokens=max_tokens(batch, prompt_len, warmup_steps, 2 * steps + 2),
                            temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"p{batch}-{i}", [rng.randrange(10, 2000) for _ in range(prompt_len)], params)
    decoded = 0
    with StepTimer(engine) as timer:
        while decoded < warmup_steps:
            record = timer.step()
            decoded += record is not None and record[0] == batch
    sync = (lambda: torch.cuda.synchronize(runner.device)) if runner.device.type == "cuda" else (lambda: None)
    graphs = runner.decode_graphs
    parts: dict[str, list[float]] = {"engine step": [], "plan (python)": [], "graph replay (host copies + replay)": [],
                                     "replay call (host side)": [], "replay alone": []}
    plan_of = runner._plan
    seen: list = []

    def timed_plan(scheduled, *rest):
        start = time.perf_counter()
        out = plan_of(scheduled, *rest)
        parts["plan (python)"].append(time.perf_counter() - start)
        seen[:] = [out[0]]
        return out

    runner._plan = timed_plan          # an instance attribute shadowing the method; removed below
    try:
        for _ in range(steps):
            sync()
            start = time.perf_counter()
            engine.step()
            sync()
            parts["engine step"].append(time.perf_counter() - start)
    finally:
        del runner._plan
    # The runner's pieces, on the last step's plan: replaying it again writes the same K/V to
    # the same slots, so the requests are unchanged.
    if seen and not seen[0].prefill_lens and graphs is not None and graphs.fits(len(seen[0].decode_lens)):
        plan = seen[0]
        size = graphs.size_for(len(plan.input_ids))
        with torch.inference_mode():      # as ModelRunner.execute runs
            for _ in range(steps):
                sync()
                start = time.perf_counter()
                # The greedy graph: the forward, the logits and their argmax (rein.engine.cuda_graphs).
                graphs.run(plan.input_ids, plan.positions, plan.slots, plan.decode_lens, plan.decode_rows)
                sync()
                parts["graph replay (host copies + replay)"].append(time.perf_counter() - start)
                start = time.perf_counter()
                graphs.graphs[size][GREEDY].replay()
                parts["replay call (host side)"].append(time.perf_counter() - start)
                sync()
                parts["replay alone"].append(time.perf_counter() - start)
    print(f"profile: batch {batch}, medians over {steps} steps:", flush=True)
    for name, values in parts.items():
        if values:
            print(f"profile:   {name:40s} {1e3 * statistics.median(values):8.3f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    if runner.device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    while engine.has_unfinished():
        engine.step()


def decode_check(device: str, hbm_tbps: float, models_dir: Path, batches: list[int] | None = None,
                 vocab: int | None = None, tokenizer_dir: Path | None = None, on_batch=None,
                 profile_steps: int = 0, trace: Path | None = None, idle_steps: int = 0) -> dict:
    """Build the model, run each batch, return a gpu_check part result (status, reason, figures);
    `on_batch(result so far)` after each batch; with `idle_steps`, then the GPU's idle shares
    over that many decode steps of the first batch size (bench/gpu_targets.py's profile_idle;
    reported, not judged); with `profile_steps`, then `profile_batch` on the first batch size."""
    from attention_kernels import build_qwen2_model  # bench/ is on sys.path, as for gpu_check.py

    from rein.engine import EngineConfig, LLMEngine
    from rein.fixtures.tiny_model import ensure_tiny_model

    plan = sizes(device)
    if batches:
        plan["batches"] = batches
    if vocab:
        plan["shape"]["vocab_size"] = vocab
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[plan["dtype"]]
    tokenizer_dir = tokenizer_dir or ensure_tiny_model(models_dir / "qwen2", arch="qwen2")
    started = time.perf_counter()
    model_dir = build_qwen2_model(models_dir / f"{plan['name']}-v{plan['shape']['vocab_size']}", tokenizer_dir,
                                  device, plan["shape"], dtype)
    build_s = time.perf_counter() - started
    top = max(plan["batches"])
    steps = max(plan["timed_steps"], 2 * profile_steps + 2)     # profile_batch's decodes
    max_len = plan["prompt_len"] + max_tokens(top, plan["prompt_len"], plan["warmup_steps"], steps)
    max_model_len = 1 << (max_len - 1).bit_length()
    from rein.model.spec import ModelSpec

    spec = ModelSpec.from_dir(model_dir)
    kv_per_token = spec.kv_bytes_per_token(dtype)
    kv_memory = int(1.2 * top * (max_len + 16) * kv_per_token) + (1 << 20)
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype=plan["dtype"],
                                    kv_cache_memory=kv_memory, max_model_len=max_model_len,
                                    max_num_seqs=top, max_num_batched_tokens=BATCHED_TOKENS, seed=0))
    load_s = time.perf_counter() - started
    elem = torch.empty((), dtype=engine.runner.dtype).element_size()
    weight_bytes = spec.num_parameters() * elem
    if not spec.tie_word_embeddings:
        weight_bytes -= spec.vocab_size * spec.hidden_size * elem
    result: dict = {"model": plan["name"], "parameters": spec.num_parameters(), "dtype": plan["dtype"],
                    "hbm_tbps": hbm_tbps, "cuda_graphs": engine.runner.decode_graphs is not None,
                    "build_s": round(build_s, 1), "load_s": round(load_s, 1), "batches": {}}
    print(f"decode: {plan['name']} ({spec.num_parameters() / 1e6:.0f}M parameters, {plan['dtype']}, "
          f"vocab {spec.vocab_size}), CUDA graphs {result['cuda_graphs']}, built in {build_s:.1f} s, "
          f"engine loaded in {load_s:.1f} s; bound = (weights + K/V read) / {hbm_tbps:g} TB/s", flush=True)
    try:
        for batch in plan["batches"]:
            generated = engine.stats.generation_tokens
            row = run_batch(engine, batch, plan["prompt_len"], plan["warmup_steps"], plan["timed_steps"],
                            weight_bytes, kv_per_token, hbm_tbps, seed=batch)
            row["run_tokens_per_s"] = (engine.stats.generation_tokens - generated) / row["wall_s"]
            result["batches"][str(batch)] = row
            if on_batch is not None:
                on_batch(result)
            print(f"decode: batch {batch:4d}: engine step {row['step_ms']:.3f} ms "
                  f"({row['decode_tokens_per_s']:,.0f} tok/s), runner execute {row['execute_ms']:.3f} ms; "
                  f"bound {row['bound_ms']:.3f} ms ({row['weight_gb']:.3f} GB weights + {row['kv_gb']:.3f} GB K/V); "
                  f"step at {100 * row['ratio']:.1f}% of the bound (execute {100 * row['execute_ratio']:.1f}%); "
                  f"whole run {row['run_tokens_per_s']:,.0f} tok/s incl. prefill", flush=True)
        if idle_steps:
            from gpu_targets import profile_idle

            shares = profile_idle(engine, plan["batches"][0], plan["prompt_len"], plan["warmup_steps"], idle_steps,
                                  seed=7)
            result["idle"] = shares
            print(f"decode: GPU idle over {shares['steps']} decode steps of {plan['batches'][0]} ({shares['source']}): "
                  f"between steps {shares.get('between_steps_pct', float('nan')):.1f}%, all idle "
                  f"{shares.get('idle_pct', float('nan')):.1f}%", flush=True)
        if profile_steps:
            profile_batch(engine, plan["batches"][0], plan["prompt_len"], plan["warmup_steps"], profile_steps, trace)
    finally:
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    judged = str(TARGET_BATCH) in result["batches"]
    if device != "cuda":
        result["status"] = "PASS"
        result["reason"] = ("ran on CPU (tiny shape, batches " + ", ".join(result["batches"]) +
                            "); the >= 35% target applies on CUDA only")
    elif not judged:
        result["status"] = "PASS"
        result["reason"] = f"ran batches {', '.join(result['batches'])}; batch {TARGET_BATCH} not run, target not judged"
    else:
        row = result["batches"][str(TARGET_BATCH)]
        figures = "; ".join(f"batch {b}: {r['step_ms']:.2f} ms/step, {r['decode_tokens_per_s']:,.0f} tok/s, "
                            f"{100 * r['ratio']:.0f}% of the {r['bound_ms']:.2f} ms bound"
                            for b, r in result["batches"].items())
        result["status"] = "PASS" if row["ratio"] >= TARGET_RATIO else "FAIL"
        result["reason"] = (figures + f" (target: batch {TARGET_BATCH} >= {100 * TARGET_RATIO:.0f}%"
                            + ("" if row["ratio"] >= TARGET_RATIO else ", not met") + ")")
        if "between_steps_pct" in result.get("idle", {}):
            result["reason"] += (f"; GPU idle between steps {result['idle']['between_steps_pct']:.1f}% "
                                 f"(all idle {result['idle']['idle_pct']:.1f}%)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the bound, TB/s (H200: 4.8)")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 64,256; CPU 4,8)")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default Qwen2's 151936)")
    parser.add_argument("--models-dir", default=None, help="where the model is built (default: a temp dir)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after the timed runs, profile STEPS decode steps of the first batch size")
    parser.add_argument("--trace", default=None, help="with --profile: write a Chrome trace here")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else None
    with tempfile.TemporaryDirectory(prefix="rein-gpu-decode-") as tmp:
        result = decode_check(args.device, args.hbm_tbps, Path(args.models_dir or tmp), batches, args.vocab,
                              profile_steps=args.profile, trace=Path(args.trace) if args.trace else None)
    print(f"{result['status']}: {result['reason']}")
    print(json.dumps(result))
    return 0 if result["status"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
