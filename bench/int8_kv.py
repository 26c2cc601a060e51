"""What an int8 KV cache buys (capacity) and costs (output drift) in rein's engine.

    python bench/int8_kv.py [--small] [--prompts N] [--max-tokens N] [--no-teacher-forcing]
                            [--out-dir DIR] [--threads N]

The same seeded greedy workload (--prompts prompts of 16-128 random non-special tokens,
--max-tokens output tokens each, ignore_eos, logprobs=5) runs through LLMEngine twice on
the random-weight llama model(s) built by `rein.fixtures.tiny_model.make_tiny_model` (reused from
--out-dir when present): once with a full-precision cache (fp32 on CPU, bf16 on CUDA; the
model dtype is the engine's "auto" either way) and once with kv_cache_dtype="int8", both
with the same kv_cache_memory. Reported:

* capacity: bytes per token and pool blocks for each cache dtype. int8 stores one fp32
  scale per token, head and K/V beside the int8 values, so the gain over a 16-bit cache
  is 2d / (d + 4) (d = head_dim: 1.6x at d=16, 1.88x at d=64, 1.94x at d=128), and over
  fp32 4d / (d + 4).
* tokens: share of output tokens identical position-wise before each request's first
  divergence (sum of the matching prefix lengths / all output tokens), share identical
  overall (position-wise, including after a divergence, where matches are only chance),
  and share of requests fully identical.
* logprobs, free-running: max / mean |logprob difference| of the chosen token at the
  positions before the first divergence. There both runs have the same context, so this
  is a like-for-like comparison; positions after a divergence are left out.
* logprobs, teacher-forced (unless --no-teacher-forcing): each request's prompt + the
  full-precision run's output is prefilled in one step by both engines, and the logits of
  every output position are taken from the model's hidden states (captured around the
  model's forward; the engine itself only computes the last position's). So at every
  position both caches see the same context, the full-precision run's: top-1 agreement
  with the full-precision token, and |logprob of that token| difference, over all
  positions, not only those before a divergence. The prefill path stores K/V (quantized
  for int8) before attending over the cache, as decode does. The "path floor" row compares
  the full-precision cache's teacher-forced logprobs with its own free-running ones: what
  prefill versus decode attention alone changes, the noise below which int8's error is
  invisible.

It also checks that every block is back in the pool after each run. Not a test: it prints
a table and, as the last line of stdout, one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_model import ensure_tiny_model
from rein.model.spec import ModelSpec

SEED = 0
BLOCK_SIZE = 16
TOP_LOGPROBS = 5


@dataclass
class RunResult:
    """One engine pass over the workload: per request, its tokens and logprobs."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    seconds: float


def ensure_model(cache_dir: Path, preset: str) -> Path:
    return ensure_tiny_model(cache_dir / f"llama-{preset}", arch="llama", seed=SEED, preset=preset)


def make_prompts(tokenizer, vocab_size: int, count: int) -> list[list[int]]:
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    allowed = [i for i in range(vocab_size) if i not in special]
    rng = random.Random(f"{SEED}-int8-kv")
    return [[rng.choice(allowed) for _ in range(rng.randint(16, 128))] for _ in range(count)]


def make_engine(model_dir: Path, kv_cache_dtype: str, memory: int, max_model_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_dtype=kv_cache_dtype,
                                  kv_cache_memory=memory, max_model_len=max_model_len,
                                  block_size=BLOCK_SIZE, max_num_seqs=256, seed=SEED))


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> RunResult:
    """Greedy, ignore_eos, logprobs=5; every request added up front, step() until done."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            i = int(out.request_id[1:])
            tokens[i].extend(out.new_token_ids)
            logprobs[i].extend(lp.logprob for lp in out.logprobs or [])
    seconds = time.perf_counter() - t0
    leaked = engine.pool.num_used
    if leaked:
        raise RuntimeError(f"{leaked} KV blocks still in use after every request finished")
    return RunResult(tokens, logprobs, seconds)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def compare_free_running(base: RunResult, int8: RunResult) -> dict:
    total = sum(len(t) for t in base.tokens)
    prefix = [first_divergence(a, b) for a, b in zip(base.tokens, int8.tokens, strict=True)]
    same_anywhere = sum(x == y for a, b in zip(base.tokens, int8.tokens, strict=True)
                        for x, y in zip(a, b, strict=True))
    diffs = [abs(base.logprobs[i][j] - int8.logprobs[i][j])
             for i, d in enumerate(prefix) for j in range(d)]
    return {
        "output_tokens": total,
        "identical_before_divergence": sum(prefix) / total,
        "identical_overall": same_anywhere / total,
        "requests_identical": sum(d == len(t) for d, t in zip(prefix, base.tokens, strict=True)),
        "requests": len(prefix),
        "first_divergence_positions": prefix,
        "logprob_positions": len(diffs),
        "max_abs_logprob_diff": max(diffs) if diffs else None,
        "mean_abs_logprob_diff": statistics.fmean(diffs) if diffs else None,
    }


def teacher_forced(engine: LLMEngine, prompts: list[list[int]],
                   outputs: list[list[int]]) -> tuple[list[float], list[int]]:
    """log p(outputs[i][j] | prompts[i] + outputs[i][:j]) under `engine`, and the argmax
    token there, for every i and j (flattened in that order).

    Each request's prompt + output is prefilled alone in one step (the prefill path stores
    K/V in the cache, quantized for int8, then attends over the cache, as decode does);
    the model's hidden states for every position of that step are captured and turned
    into logits here, since the engine itself only computes logits for the last one.
    """
    model = engine.runner.model
    captured: list[torch.Tensor] = []
    original = model.forward

    def capture(*args, **kwargs):
        hidden = original(*args, **kwargs)
        captured.append(hidden)
        return hidden

    model.forward = capture  # instance attribute: nn.Module.__call__ finds it first
    try:
        logprobs_out: list[float] = []
        top1_out: list[int] = []
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            seq = prompt + out
            if len(seq) > engine.config.max_num_batched_tokens:
                raise ValueError(f"{len(seq)} tokens do not fit one prefill step")
            captured.clear()
            engine.add_request(f"tf{i}", seq, SamplingParams(max_tokens=1, temperature=0.0,
                                                              ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            if len(captured) != 1 or captured[0].shape[0] != len(seq):
                raise RuntimeError("the teacher-forced prefill did not run as one step")
            with torch.inference_mode():
                rows = captured[0][len(prompt) - 1:len(seq) - 1]
                logprobs = torch.log_softmax(model.compute_logits(rows).float(), dim=-1)
                targets = torch.tensor(out, device=logprobs.device).unsqueeze(1)
                logprobs_out.extend(logprobs.gather(1, targets).squeeze(1).tolist())
                top1_out.extend(logprobs.argmax(dim=-1).tolist())
    finally:
        del model.forward
    if engine.pool.num_used:
        raise RuntimeError(f"{engine.pool.num_used} KV blocks still in use after teacher forcing")
    return logprobs_out, top1_out


def compare_teacher_forced(reference: list[int], ref_logprobs: list[float],
                           logprobs: list[float], top1: list[int]) -> dict:
    """Same contexts everywhere: top-1 agreement with the reference token, |logprob| diff."""
    diffs = [abs(a - b) for a, b in zip(ref_logprobs, logprobs, strict=True)]
    return {
        "positions": len(reference),
        "top1_agreement": sum(a == b for a, b in zip(reference, top1, strict=True)) / len(reference),
        "max_abs_logprob_diff": max(diffs),
        "mean_abs_logprob_diff": statistics.fmean(diffs),
    }


def bench_model(preset: str, args: argparse.Namespace, device: str) -> dict:
    model_dir = ensure_model(Path(args.out_dir), preset)
    spec = ModelSpec.from_dir(model_dir)
    base_name = "bfloat16" if device == "cuda" else "float32"
    base_dtype = getattr(torch, base_name)
    # + 1: teacher forcing prefills prompt + the whole output and samples one more token.
    max_model_len = 128 + args.max_tokens + 1
    # Same bytes for both caches: what the base cache needs for the whole workload at once
    # (no preemption), plus a quarter.
    tokens_needed = args.prompts * (max_model_len + BLOCK_SIZE)
    memory = int(tokens_needed * 1.25) * spec.kv_bytes_per_token(base_dtype)

    base_engine = make_engine(model_dir, base_name, memory, max_model_len)
    prompts = make_prompts(base_engine.tokenizer, spec.vocab_size, args.prompts)
    base = generate(base_engine, prompts, args.max_tokens)
    int8_engine = make_engine(model_dir, "int8", memory, max_model_len)
    int8 = generate(int8_engine, prompts, args.max_tokens)

    d = spec.head_dim
    cap = {
        "memory_bytes": memory,
        f"{base_name}_bytes_per_token": spec.kv_bytes_per_token(base_dtype),
        "int8_bytes_per_token": spec.kv_bytes_per_token(torch.int8),
        f"{base_name}_blocks": base_engine.pool.num_blocks,
        "int8_blocks": int8_engine.pool.num_blocks,
        "int8_over_base_blocks": int8_engine.pool.num_blocks / base_engine.pool.num_blocks,
        "expected_over_16bit": 2 * d / (d + 4),
        "expected_over_fp32": 4 * d / (d + 4),
    }
    row: dict = {
        "model": f"llama-{preset}", "layers": spec.num_layers, "kv_heads": spec.num_kv_heads,
        "head_dim": d, "device": device, "base_cache": base_name, "capacity": cap,
        "free_running": compare_free_running(base, int8),
        "seconds": {"base_run": base.seconds, "int8_run": int8.seconds},
    }
    if not args.no_teacher_forcing:
        t0 = time.perf_counter()
        reference = [t for out in base.tokens for t in out]
        base_lp, base_top1 = teacher_forced(base_engine, prompts, base.tokens)
        int8_lp, int8_top1 = teacher_forced(int8_engine, prompts, base.tokens)
        free_lp = [v for lps in base.logprobs for v in lps]
        row["teacher_forced"] = {
            # int8 against the base cache on the same (prefill) path and the same contexts.
            "int8_vs_base": compare_teacher_forced(reference, base_lp, int8_lp, int8_top1),
            # the base cache's prefill path against its own free run (decode path).
            "path_floor": compare_teacher_forced(reference, free_lp, base_lp, base_top1),
        }
        row["seconds"]["teacher_forced"] = time.perf_counter() - t0
    return row


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_tables(rows: list[dict]) -> None:
    print("\n== capacity: same kv_cache_memory for both caches")
    print(f"{'model':<12} {'d':>3} {'MiB':>6} {'base':>9} {'B/tok':>6} {'blocks':>7} "
          f"{'int8 B/tok':>10} {'blocks':>7} {'ratio':>6} {'expected':>8}")
    for r in rows:
        c, base = r["capacity"], r["base_cache"]
        expected = c["expected_over_16bit"] if base != "float32" else c["expected_over_fp32"]
        print(f"{r['model']:<12} {r['head_dim']:>3} {c['memory_bytes'] / 2**20:6.1f} {base:>9} "
              f"{c[f'{base}_bytes_per_token']:>6} {c[f'{base}_blocks']:>7} "
              f"{c['int8_bytes_per_token']:>10} {c['int8_blocks']:>7} "
              f"{c['int8_over_base_blocks']:5.2f}x {expected:7.2f}x")
    print("\n== output drift, int8 vs base cache (greedy)")
    print(f"{'model':<12} {'comparison':<26} {'tokens same':>11} {'overall':>8} {'req same':>8} "
          f"{'positions':>9} {'max|dlp|':>9} {'mean|dlp|':>9}")
    for r in rows:
        f = r["free_running"]
        print(f"{r['model']:<12} {'free-run, pre-divergence':<26} "
              f"{100 * f['identical_before_divergence']:10.1f}% {100 * f['identical_overall']:7.1f}% "
              f"{f['requests_identical']:>3}/{f['requests']:<4} {f['logprob_positions']:>9} "
              f"{fmt(f['max_abs_logprob_diff'], '9.2e')} {fmt(f['mean_abs_logprob_diff'], '9.2e')}")
        tf = r.get("teacher_forced")
        if tf:
            for name, label in (("int8_vs_base", "teacher-forced int8"),
                                ("path_floor", "path floor (base TF/free)")):
                t = tf[name]
                print(f"{r['model']:<12} {label:<26} {100 * t['top1_agreement']:10.1f}% "
                      f"{'':>8} {'':>8} {t['positions']:>9} "
                      f"{fmt(t['max_abs_logprob_diff'], '9.2e')} "
                      f"{fmt(t['mean_abs_logprob_diff'], '9.2e')}")
    print("('tokens same' is the top-1 agreement for the teacher-forced rows; |dlp| is the "
          "chosen token's |logprob difference|)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="also run the 'small' preset (about 5 minutes on a 2-core CPU)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--no-teacher-forcing", action="store_true",
                        help="skip the teacher-forced comparison (prompts x max-tokens extra requests)")
    parser.add_argument("--out-dir", default=".cache/bench-models", help="where models are built/reused")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        parser.error("--prompts and --max-tokens must be at least 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    print(f"# int8 KV cache bench: device {device}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, {args.prompts} prompts x {args.max_tokens} tokens",
          flush=True)
    rows = [bench_model(preset, args, device) for preset in (["tiny", "small"] if args.small else ["tiny"])]
    print_tables(rows)
    wall = time.perf_counter() - started
    print(f"\ntotal {wall:.1f}s")
    print(json.dumps({"device": device, "prompts": args.prompts, "max_tokens": args.max_tokens,
                      "models": rows, "wall_s": wall}, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
