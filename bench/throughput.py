"""Offline throughput: rein's engine against Hugging Face static batching and continuous batching.

    python bench/throughput.py [--models tiny,small] [--workloads mixed,uniform] [--quick]
                               [--out-dir DIR] [--profile MODEL:WORKLOAD]

Everything runs in one process, on the same random-weight llama models (built once with
`rein.fixtures.tiny_model.make_tiny_model` into --out-dir), on the same seeded workloads, one system
after the other for each (model, workload):

* rein: LLMEngine, every request added up front, `step()` until done; greedy, ignore_eos,
  max_tokens = the request's own output length.
* HF static: `model.generate()` on fixed-size batches in arrival order, left padding,
  max_new_tokens = min_new_tokens = the longest output of the batch (so EOS cannot end a
  row early). A user only wants each request's own length, so only that counts as useful
  output; the rest of each row is padding work.
* HF continuous batching: transformers' ContinuousBatchingManager (the engine behind
  `model.generate_batch`). `generate_batch` takes one max_new_tokens for every request,
  but the manager's `add_request` takes it per request, so we drive the manager directly
  (`continuous_batching_context_manager`) and every request stops at its own length: no
  wasted tokens, a fair comparison. Same budgets as rein: 64 requests, 2048 tokens a step.

Throughput is useful output tokens / wall seconds, timed from handing over the first
request to receiving the last token (model load, cache allocation and warm-up excluded).
The machine may be shared, so compare the figures of one run with each other rather than
across runs. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import math
import os
import platform
import pstats
import random
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rein.engine.config import EngineConfig
from rein.engine.engine import EngineStats, LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_model import ensure_tiny_model

SEED = 0
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
HF_CB_PAGE_SIZE = 256          # transformers' default page size

TARGETS = {
    "mixed_rein_over_static": 2.0,
    "mixed_rein_over_hf_batch": 3.0,
    "uniform_rein_over_static": 1.0,
    "overhead_share_at_64_max": 0.15,
    "peak_kv_utilization_min": 0.95,
}


# Rounds for the short (uniform) workloads; see main().
SHORT_WORKLOAD_ROUNDS = 5


def median_run(runs: list[dict]) -> dict | None:
    """The run with the median throughput, or None when the system did not run."""
    if not runs:
        return None
    return sorted(runs, key=lambda r: r["tps"])[len(runs) // 2]


# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    hf_batch_size: int

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(name: str, allowed_ids: list[int], quick: bool) -> Workload:
    """Seeded random token ids (no special ids); the same workload for every model."""
    rng = random.Random(f"{SEED}-{name}")
    if name == "mixed":
        n, (plo, phi), (olo, ohi), bs = (8, (16, 64), (8, 32), 4) if quick else (64, (16, 512), (16, 256), 16)
        plens = [rng.randint(plo, phi) for _ in range(n)]
        olens = [rng.randint(olo, ohi) for _ in range(n)]
    elif name == "uniform":
        n, plen, olen, bs = (8, 16, 16, 8) if quick else (32, 64, 64, 32)
        plens, olens = [plen] * n, [olen] * n
    elif name == "decode64":
        # 64 requests with short prompts and long outputs: most steps decode all 64 at once.
        n, plen, olen, bs = (64, 16, 16, 64) if quick else (64, 16, 128, 64)
        plens, olens = [plen] * n, [olen] * n
    else:
        raise SystemExit(f"unknown workload {name!r}: use mixed, uniform")
    prompts = [[rng.choice(allowed_ids) for _ in range(p)] for p in plens]
    return Workload(name, prompts, olens, bs)


def allowed_token_ids(tokenizer, vocab_size: int) -> list[int]:
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return [i for i in range(vocab_size) if i not in special]


# --------------------------------------------------------------------------- models


def ensure_model(cache_dir: Path, preset: str) -> Path:
    return ensure_tiny_model(cache_dir / f"llama-{preset}", arch="llama", seed=SEED, preset=preset)


# --------------------------------------------------------------------------- rein


def make_engine(model_dir: Path, kv_tokens: int) -> LLMEngine:
    # KV pool big enough for the whole workload at once (no preemption), at least 64 MiB.
    from rein.model.spec import ModelSpec
    spec = ModelSpec.from_dir(model_dir)
    per_token = spec.kv_bytes_per_token(torch.float32)
    memory = max(64 * 1024**2, int(kv_tokens * 1.25) * per_token)
    return LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                  kv_cache_memory=memory, seed=SEED))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def rein_generate(engine: LLMEngine, prompts, output_lens, on_step=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, (prompt, olen) in enumerate(zip(prompts, output_lens, strict=True)):
        engine.add_request(f"r{i}", prompt, greedy(olen))
        tokens[f"r{i}"] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        if on_step is not None:
            on_step(time.perf_counter() - started)
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def rein_warmup(engine: LLMEngine, allowed: list[int]) -> None:
    rng = random.Random(1)
    prompts = [[rng.choice(allowed) for _ in range(n)] for n in (8, 40, 24)]
    rein_generate(engine, prompts, [6, 3, 5])
    engine.stats = EngineStats()


def run_rein(engine: LLMEngine, wl: Workload, allowed: list[int]) -> dict:
    rein_warmup(engine, allowed)
    with torch.inference_mode():
        t0 = time.perf_counter()
        tokens = rein_generate(engine, wl.prompts, wl.output_lens)
        wall = time.perf_counter() - t0
    st = engine.stats
    outs = [tokens[f"r{i}"] for i in range(wl.num_requests)]
    produced = sum(len(t) for t in outs)
    if produced != wl.useful_tokens:
        print(f"# WARNING rein produced {produced} tokens, expected {wl.useful_tokens}", flush=True)
    return {
        "tps": produced / wall, "wall_s": wall, "output_tokens": produced,
        "steps": st.steps, "overhead_share": st.overhead_share,
        "peak_kv_utilization": st.peak_kv_utilization, "peak_kv_usage": st.peak_kv_usage,
        "preemptions": st.preemptions, "generation_tokens": st.generation_tokens,
        "_tokens": outs,
    }


def overhead_at_64(engine: LLMEngine, wl: Workload, allowed: list[int]) -> dict:
    """Run 64 short-prompt/long-output requests; over the steps that decoded all 64 at once,
    share of step time outside runner.execute (the model forward + input building)."""
    rein_warmup(engine, allowed)
    runner = engine.runner
    original = runner.execute
    records: list[tuple[int, bool, float]] = []

    def timed_execute(scheduled):
        t = time.perf_counter()
        result = original(scheduled)
        records.append((len(scheduled), all(s.num_new_tokens == 1 for s in scheduled),
                        time.perf_counter() - t))
        return result

    steps64 = {"n": 0, "step_s": 0.0, "exec_s": 0.0}

    def on_step(step_s: float) -> None:
        if records and records[-1] is not None:
            n, all_decode, exec_s = records[-1]
            if n == MAX_NUM_SEQS and all_decode:
                steps64["n"] += 1
                steps64["step_s"] += step_s
                steps64["exec_s"] += exec_s
            records.append(None)  # consumed

    runner.execute = timed_execute
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            tokens = rein_generate(engine, wl.prompts, wl.output_lens, on_step=on_step)
            wall = time.perf_counter() - t0
    finally:
        runner.execute = original
    produced = sum(len(t) for t in tokens.values())
    share = 1.0 - steps64["exec_s"] / steps64["step_s"] if steps64["step_s"] else None
    return {
        "overhead_share_at_64": share, "steps_at_64": steps64["n"],
        "step_ms_at_64": 1000 * steps64["step_s"] / steps64["n"] if steps64["n"] else None,
        "forward_ms_at_64": 1000 * steps64["exec_s"] / steps64["n"] if steps64["n"] else None,
        "overhead_share_run": engine.stats.overhead_share,
        "peak_kv_utilization": engine.stats.peak_kv_utilization,
        "tps": produced / wall, "wall_s": wall,
    }


# --------------------------------------------------------------------------- Hugging Face


def load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return model, tok


def hf_static_generate(model, pad_id: int, prompts, output_lens, batch_size: int) -> list[list[int]]:
    outs: list[list[int]] = []
    for b in range(0, len(prompts), batch_size):
        batch, olens = prompts[b:b + batch_size], output_lens[b:b + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], dtype=torch.long)
        longest = max(olens)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                             min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
        for row, olen in zip(gen[:, width:].tolist(), olens, strict=True):
            outs.append(row[:olen])   # what the user asked for; the rest is waste
    return outs


def run_hf_static(model, tok, wl: Workload) -> dict:
    pad = tok.pad_token_id
    with torch.inference_mode():
        hf_static_generate(model, pad, [[5, 6, 7], [8, 9, 10, 11, 12]], [4, 2], 2)   # warm-up
        t0 = time.perf_counter()
        outs = hf_static_generate(model, pad, wl.prompts, wl.output_lens, wl.hf_batch_size)
        wall = time.perf_counter() - t0
    computed = sum(max(wl.output_lens[b:b + wl.hf_batch_size]) * len(wl.output_lens[b:b + wl.hf_batch_size])
                   for b in range(0, wl.num_requests, wl.hf_batch_size))
    useful = sum(len(o) for o in outs)
    return {"tps": useful / wall, "wall_s": wall, "output_tokens": useful,
            "generated_tokens_incl_waste": computed, "batch_size": wl.hf_batch_size, "_tokens": outs}


def hf_cb_generate(manager, prompts, output_lens, prefix: str) -> dict[str, list[int]]:
    ids = []
    for i, (p, olen) in enumerate(zip(prompts, output_lens, strict=True)):
        rid = f"{prefix}{i}"
        manager.add_request(list(p), request_id=rid, max_new_tokens=olen, eos_token_id=-1)
        ids.append(rid)
    results: dict[str, list[int]] = {}
    while len(results) < len(ids):
        res = manager.get_result(timeout=1)
        if res is not None:
            if res.is_finished():
                if res.error is not None:
                    raise RuntimeError(f"HF continuous batching request {res.request_id} failed: {res.error}")
                results[res.request_id] = list(res.generated_tokens)
        elif not manager.is_running():
            raise RuntimeError("HF continuous batching: the generation thread died")
    return results


def run_hf_batch(model, wl: Workload) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    pages = sum(math.ceil((len(p) + o) / HF_CB_PAGE_SIZE) for p, o in zip(wl.prompts, wl.output_lens, strict=True))
    cb_config = ContinuousBatchingConfig(
        page_size=HF_CB_PAGE_SIZE, num_blocks=pages + 8, max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS, allow_block_sharing=False, seed=SEED)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1,
                                  pad_token_id=model.generation_config.pad_token_id)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in wl.prompts),
                          max_generated_length=max(wl.output_lens), num_requests=wl.num_requests)
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=30,
            warmup=True, workload_hints=hints) as manager:
        hf_cb_generate(manager, [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], [4, 2], "warm")   # warm-up
        t0 = time.perf_counter()
        results = hf_cb_generate(manager, wl.prompts, wl.output_lens, "r")
        wall = time.perf_counter() - t0
        attn = model.config._attn_implementation
    outs = [results[f"r{i}"] for i in range(wl.num_requests)]
    produced = sum(min(len(o), olen) for o, olen in zip(outs, wl.output_lens, strict=True))
    return {"tps": produced / wall, "wall_s": wall, "output_tokens": produced,
            "attn_implementation": attn, "page_size": HF_CB_PAGE_SIZE, "num_blocks": pages + 8,
            "_tokens": outs}


# --------------------------------------------------------------------------- report


def matches(a: list[list[int]], b: list[list[int]] | None) -> str | None:
    if b is None:
        return None
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def profile_rein(model_dir: Path, wl: Workload, allowed: list[int], top: int) -> str:
    engine = make_engine(model_dir, sum(len(p) + o for p, o in zip(wl.prompts, wl.output_lens, strict=True)))
    rein_warmup(engine, allowed)
    prof = cProfile.Profile()
    with torch.inference_mode():
        prof.enable()
        rein_generate(engine, wl.prompts, wl.output_lens)
        prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,small", help="comma list of presets: tiny, small")
    ap.add_argument("--workloads", default="mixed,uniform", help="comma list: mixed, uniform")
    ap.add_argument("--quick", action="store_true", help="a few short requests: a smoke run")
    ap.add_argument("--out-dir", default=".cache/bench-models", help="where the models are built/reused")
    ap.add_argument("--skip", default="", help="comma list of systems to skip: static, batch")
    ap.add_argument("--profile", default=None, metavar="MODEL:WORKLOAD",
                    help="also profile one extra rein run with cProfile (top entries by cumtime)")
    ap.add_argument("--profile-top", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every system (default 1: on a shared machine the "
                         "main thread's OpenMP team spins and can lose 5x, while HF continuous batching "
                         "runs its loop in a background thread that is hit differently; one thread puts "
                         "all three systems on the same footing)")
    args = ap.parse_args(argv)

    warnings.filterwarnings("ignore")
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    models = [m.strip() for m in args.models.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    cache_dir = Path(args.out_dir)
    t_start = time.perf_counter()
    print(f"# rein throughput bench: torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpus {os.cpu_count()}, python {platform.python_version()}, quick={args.quick}", flush=True)

    results: dict[str, dict] = {}
    overhead: dict[str, dict] = {}
    notes: list[str] = []
    timings: dict[str, float] = {}
    for preset in models:
        t = time.perf_counter()
        model_dir = ensure_model(cache_dir, preset)
        model, tok = load_hf(model_dir)
        allowed = allowed_token_ids(tok, model.config.vocab_size)
        wls = {name: make_workload(name, allowed, args.quick) for name in workloads}
        kv_tokens = max([sum(len(p) + o for p, o in zip(w.prompts, w.output_lens, strict=True)) for w in wls.values()]
                        + [64 * (16 + 128)])
        engine = make_engine(model_dir, kv_tokens)
        timings[f"{preset}/setup"] = time.perf_counter() - t
        results[preset] = {}
        for name, wl in wls.items():
            row: dict = {"requests": wl.num_requests, "useful_output_tokens": wl.useful_tokens,
                         "prompt_tokens": sum(len(p) for p in wl.prompts)}
            # A run of well under a second is at the mercy of this shared machine's noise:
            # short workloads run several rounds, the three systems interleaved, and each
            # system's median round is reported.
            rounds = 1 if name == "mixed" or args.quick else SHORT_WORKLOAD_ROUNDS
            row["rounds"] = rounds
            runs: dict[str, list[dict]] = {"rein": [], "static": [], "batch": []}
            for _ in range(rounds):
                print(f"# {preset}/{name}: rein ...", flush=True)
                t = time.perf_counter()
                runs["rein"].append(run_rein(engine, wl, allowed))
                timings[f"{preset}/{name}/rein"] = time.perf_counter() - t
                if "static" not in skip:
                    print(f"# {preset}/{name}: HF static (batch {wl.hf_batch_size}) ...", flush=True)
                    t = time.perf_counter()
                    runs["static"].append(run_hf_static(model, tok, wl))
                    timings[f"{preset}/{name}/hf_static"] = time.perf_counter() - t
                if "batch" not in skip and "hf_batch_error" not in row:
                    print(f"# {preset}/{name}: HF continuous batching ...", flush=True)
                    t = time.perf_counter()
                    try:
                        runs["batch"].append(run_hf_batch(model, wl))
                    except Exception as exc:  # report, don't die: the other figures still stand
                        row["hf_batch_error"] = f"{type(exc).__name__}: {exc}"
                        print(f"# HF continuous batching failed: {row['hf_batch_error']}", flush=True)
                    timings[f"{preset}/{name}/hf_batch"] = time.perf_counter() - t
            rein, static, batch = (median_run(runs[k]) for k in ("rein", "static", "batch"))
            row.update({
                "rein_tps": rein["tps"], "hf_static_tps": static and static["tps"],
                "hf_batch_tps": batch and batch["tps"],
                "rein_over_static": ratio(rein["tps"], static and static["tps"]),
                "rein_over_hf_batch": ratio(rein["tps"], batch and batch["tps"]),
                "rein_wall_s": rein["wall_s"], "hf_static_wall_s": static and static["wall_s"],
                "hf_batch_wall_s": batch and batch["wall_s"],
                "rein_steps": rein["steps"], "rein_overhead_share": rein["overhead_share"],
                "rein_peak_kv_utilization": rein["peak_kv_utilization"],
                "rein_peak_kv_usage": rein["peak_kv_usage"], "rein_preemptions": rein["preemptions"],
                "hf_static_batch_size": wl.hf_batch_size,
                "hf_static_generated_incl_waste": static and static["generated_tokens_incl_waste"],
                "rein_vs_hf_static_identical": matches(rein["_tokens"], static and static["_tokens"]),
                "rein_vs_hf_batch_identical": matches(rein["_tokens"], batch and batch["_tokens"]),
            })
            if batch:
                row["hf_batch_attn_implementation"] = batch["attn_implementation"]
            results[preset][name] = row
            print(f"#   rein {rein['tps']:.1f} tok/s ({rein['wall_s']:.1f}s), static "
                  f"{fmt(row['hf_static_tps'])} tok/s ({fmt(row['hf_static_wall_s'])}s), HF CB "
                  f"{fmt(row['hf_batch_tps'])} tok/s ({fmt(row['hf_batch_wall_s'])}s)", flush=True)
        print(f"# {preset}: rein overhead at 64 running ...", flush=True)
        t = time.perf_counter()
        overhead[preset] = overhead_at_64(engine, make_workload("decode64", allowed, args.quick), allowed)
        timings[f"{preset}/overhead64"] = time.perf_counter() - t
        del engine, model

    profile_text = None
    if args.profile:
        pm, pw = args.profile.split(":")
        model_dir = ensure_model(cache_dir, pm)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        allowed = allowed_token_ids(tok, len(tok))
        t = time.perf_counter()
        profile_text = profile_rein(model_dir, make_workload(pw, allowed, args.quick), allowed, args.profile_top)
        timings[f"profile/{args.profile}"] = time.perf_counter() - t

    # ------------------------------------------------------------------ table
    print()
    hdr = (f"{'model':<6} {'workload':<8} {'reqs':>4} {'out tok':>7} | {'rein tok/s':>10} {'static':>9} "
           f"{'HF CB':>9} | {'rein/static':>11} {'rein/CB':>8} | {'overhead':>8} {'peak KV':>7} "
           f"{'same as static':>14} {'same as CB':>10}")
    print(hdr)
    print("-" * len(hdr))
    checks: dict[str, bool | None] = {}
    for preset, by_wl in results.items():
        for name, r in by_wl.items():
            print(f"{preset:<6} {name:<8} {r['requests']:>4} {r['useful_output_tokens']:>7} | "
                  f"{r['rein_tps']:>10.1f} {fmt(r['hf_static_tps']):>9} {fmt(r['hf_batch_tps']):>9} | "
                  f"{fmt(r['rein_over_static'], '.2f'):>10}x {fmt(r['rein_over_hf_batch'], '.2f'):>7}x | "
                  f"{r['rein_overhead_share']:>8.1%} {r['rein_peak_kv_utilization']:>7.1%} "
                  f"{str(r['rein_vs_hf_static_identical']):>14} {str(r['rein_vs_hf_batch_identical']):>10}")
            if name == "mixed":
                so, bo = r["rein_over_static"], r["rein_over_hf_batch"]
                checks[f"{preset}/mixed rein >= 2x static"] = None if so is None else so >= 2.0
                checks[f"{preset}/mixed rein >= 3x HF CB"] = None if bo is None else bo >= 3.0
            if name == "uniform":
                so = r["rein_over_static"]
                checks[f"{preset}/uniform rein >= 1.0x static"] = None if so is None else so >= 1.0
            checks[f"{preset}/{name} peak KV utilization >= 95%"] = r["rein_peak_kv_utilization"] >= 0.95
    print()
    print("rein overhead at 64 running (64 requests x 16 prompt tokens, decode steps with all 64 running):")
    for preset, o in overhead.items():
        share = o["overhead_share_at_64"]
        print(f"  {preset:<6} overhead {fmt(share and 100 * share, '.1f')}% over {o['steps_at_64']} steps "
              f"(step {fmt(o['step_ms_at_64'], '.2f')} ms, forward {fmt(o['forward_ms_at_64'], '.2f')} ms); "
              f"whole run {o['overhead_share_run']:.1%}, peak KV utilization {o['peak_kv_utilization']:.1%}")
        checks[f"{preset} overhead at 64 running < 15%"] = None if share is None else share < 0.15
    print()
    print("targets:")
    for name, ok in checks.items():
        print(f"  {verdict(ok):<4}  {name}")

    notes += [
        "throughput = useful output tokens / wall seconds from the first request handed over to the last token "
        "(load, cache allocation, warm-up excluded); all three systems run greedy in fp32 on the same model.",
        f"HF static: generate() in arrival order, left padding, batch {'4' if args.quick else '16'} (mixed) / "
        f"{'8' if args.quick else '32'} (uniform) for every model; "
        "each batch runs max_new_tokens = min_new_tokens = its longest output; only each request's own length "
        "counts as useful (padding tokens are wasted work).",
        "HF CB: transformers' ContinuousBatchingManager (the engine of model.generate_batch); generate_batch takes "
        "one max_new_tokens for all requests, the manager's add_request takes it per request, so it is driven "
        "directly and every request stops at its own length (no waste counted against it). "
        f"page_size {HF_CB_PAGE_SIZE}, cache sized for the whole workload, max_batch_tokens "
        f"{MAX_NUM_BATCHED_TOKENS}, max_requests_per_batch {MAX_NUM_SEQS}, block sharing off, attention sdpa "
        "(no flash attention on CPU).",
        f"rein: max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS}, block 16, KV pool "
        "sized for the whole workload; greedy, ignore_eos; includes detokenization (HF systems do none).",
        "overhead = share of step time outside runner.execute (which includes building the inputs). "
        "tiny's forward is tiny, so its overhead share is large by nature; the target is meant for the small model.",
        "same as static / CB = requests whose greedy tokens are identical to rein's (padding in static "
        "batches changes fp32 rounding, so mixed can differ a little; uniform has no padding).",
    ]
    if args.quick:
        notes.append("--quick: a smoke run; the figures say nothing about the targets.")
    print()
    print("notes:")
    for n in notes:
        print(f"  - {n}")
    total = time.perf_counter() - t_start
    print()
    print("timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()) + f"; total {total:.1f}")
    if profile_text:
        print()
        print(f"cProfile of one rein run on {args.profile} (by cumtime, then by tottime):")
        print(profile_text)

    summary = {
        "bench": "throughput", "quick": args.quick, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "transformers": __import__("transformers").__version__,
        "config": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                   "hf_cb_page_size": HF_CB_PAGE_SIZE},
        "results": results,
        "overhead_share_at_64": {p: o["overhead_share_at_64"] for p, o in overhead.items()},
        "overhead_at_64": overhead,
        "peak_kv_utilization": {p: {w: r["rein_peak_kv_utilization"] for w, r in by.items()}
                                for p, by in results.items()},
        "targets": TARGETS,
        "checks": {k: verdict(v) for k, v in checks.items()},
        "timings_s": timings, "total_s": total,
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
