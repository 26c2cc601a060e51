"""The CUDA kernels of issue 47's "fewer, fuller kernels", each against what it replaces, side by
side in one run on one GPU.

    python bench/fused_kernels.py [--rounds 5] [--sections gemm,mlp_down,rotary,decode,prefill] [--quick]

Sections (each row: both sides' microseconds per call, their ratio, the largest difference
between their outputs):

* gemm: `triton_small_gemm.small_m_linear` (split-K, REIN_CUDA_SMALL_GEMM=triton) against cuBLAS
  (`torch.nn.functional.linear`), bf16, M = 1, 8, 64 rows, the four projections of a layer of
  Qwen2-0.5B (hidden 896, intermediate 4864; q/k/v 14/2/2 heads of 64) and Llama-3-8B
  (hidden 4096, intermediate 14336; 32/8/8 heads of 128); GB/s = weight bytes / time, and the
  share of --hbm-tbps. Each timed call reads a different copy of the weight, cycling through
  copies totalling >= 256 MB, so the weight comes from HBM as in a model, not from L2.
* mlp_down: `triton_small_gemm.silu_and_mul_linear` (SiLU-and-multiply folded into the down
  projection's loads, one kernel) against `triton_elementwise.silu_and_mul` then cuBLAS, the same
  models and rows as gemm, the weight cycled the same way.
* rotary: `triton_rotary_store.rotary_store_kv` (one kernel) against `triton_elementwise.rotary_`
  on the fused q/k heads then `triton_store.store_kv` (two), bf16 cache, the two models' heads,
  64 and 256 tokens.
* decode: `triton_decode.paged_decode_attention` with the split merge folded into the main kernel
  (fold_reduce=True; the default is False until this has run on a device) against the separate reduce kernel (fold_reduce=False); batch
  1, 8, 64, context 1024, a block table as wide as 32k tokens (the CUDA graphs' shape).
* prefill: torch's flash varlen attention over the step's own K/V (REIN_CUDA_PREFILL_ATTENTION=
  flash) against `triton_prefill.paged_prefill_attention` over the paged cache, 4 prompts of
  512 and 1 of 2048 tokens without a cached prefix, the 8B model's heads.

Timing: every call is captured `--reps` times into a CUDA graph and the graph replayed, so the
figure is device time without Python's launch cost (what a decode step under CUDA graphs
sees); "eager" columns time the same calls launched one by one from Python (events around
--reps calls), where launch cost shows. A and B alternate round by round (--rounds); the figure
is each side's minimum over the rounds. The last line of stdout is one JSON object of all rows.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MODELS = {   # hidden, intermediate, heads, kv heads, head dim
    "qwen2-0.5b": (896, 4864, 14, 2, 64),
    "llama3-8b": (4096, 14336, 32, 8, 128),
}
BF16 = torch.bfloat16
COLD_BYTES = 256 << 20


def graph_us(fn, reps: int) -> float:
    """Device microseconds per call of fn, from a CUDA graph of `reps` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def eager_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def compare(name: str, a, b, reps: int, rounds: int, eager: bool = False) -> dict:
    """Minimum per-call time of a and b over alternating rounds (graph-captured; eager too)."""
    times = {"a": [], "b": [], "a_eager": [], "b_eager": []}
    for r in range(rounds):
        for side, fn in (("a", a), ("b", b)) if r % 2 == 0 else (("b", b), ("a", a)):
            times[side].append(graph_us(fn, reps))
            if eager:
                times[side + "_eager"].append(eager_us(fn, reps))
    row = {"case": name, "a_us": min(times["a"]), "b_us": min(times["b"])}
    if eager:
        row["a_eager_us"], row["b_eager_us"] = min(times["a_eager"]), min(times["b_eager"])
    row["b_over_a"] = row["b_us"] / row["a_us"]
    return row


def max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x.float() - y.float()).abs().max().item()


def bench_gemm(args, rows_out: list) -> None:
    from rein.kernels.triton_small_gemm import small_m_linear

    print("\n== gemm: a = small_m_linear (Triton split-K), b = F.linear (cuBLAS), bf16")
    print(f"{'model':>11} {'proj':>8} {'M':>3} {'triton us':>9} {'cublas us':>9} {'cublas/triton':>13} "
          f"{'triton %bw':>10} {'cublas %bw':>10} {'max diff':>8}")
    for model, (hidden, inter, heads, kv_heads, dim) in MODELS.items():
        shapes = {"qkv": (hidden, (heads + 2 * kv_heads) * dim), "o": (heads * dim, hidden),
                  "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}
        for proj, (k, n) in shapes.items():
            nbytes = n * k * 2
            copies = max(1, min(64, -(-COLD_BYTES // nbytes)))
            weights = [torch.randn(n, k, dtype=BF16, device="cuda") * 0.02 for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, k, dtype=BF16, device="cuda")
                row = compare(f"gemm {model} {proj} M={m}", cycling(small_m_linear, x, weights),
                              cycling(torch.nn.functional.linear, x, weights), args.reps, args.rounds)
                row["max_diff"] = max_diff(small_m_linear(x, weights[0]), torch.nn.functional.linear(x, weights[0]))
                bound = nbytes / (args.hbm_tbps * 1e6)
                row["triton_bw_share"], row["cublas_bw_share"] = bound / row["a_us"], bound / row["b_us"]
                rows_out.append(row)
                print(f"{model:>11} {proj:>8} {m:>3} {row['a_us']:>9.2f} {row['b_us']:>9.2f} {row['b_over_a']:>13.2f} "
                      f"{row['triton_bw_share']:>10.0%} {row['cublas_bw_share']:>10.0%} {row['max_diff']:>8.3g}")


def bench_mlp_down(args, rows_out: list) -> None:
    from rein.kernels.triton_small_gemm import silu_and_mul_linear

    print("\n== MLP down projection: a = silu_and_mul_linear (one kernel), b = silu_and_mul then F.linear")
    for model, (hidden, inter, *_) in MODELS.items():
        nbytes = hidden * inter * 2
        copies = max(1, min(64, -(-COLD_BYTES // nbytes)))
        weights = [torch.randn(hidden, inter, dtype=BF16, device="cuda") * 0.02 for _ in range(copies)]
        for m in args.rows:
            gate_up = torch.randn(m, 2 * inter, dtype=BF16, device="cuda")
            row = compare(f"mlp_down {model} M={m}", cycling(silu_and_mul_linear, gate_up, weights),
                          cycling(silu_then_linear, gate_up, weights), args.reps, args.rounds)
            row["max_diff"] = max_diff(silu_and_mul_linear(gate_up, weights[0]), silu_then_linear(gate_up, weights[0]))
            rows_out.append(row)
            print(f"{model:>11} M={m:>3}: fused {row['a_us']:.2f} us, two kernels {row['b_us']:.2f} us "
                  f"(x{row['b_over_a']:.2f}); max diff {row['max_diff']:.3g}")


def silu_then_linear(gate_up, weight):
    from rein.kernels.triton_elementwise import silu_and_mul

    return torch.nn.functional.linear(silu_and_mul(gate_up), weight)


def cycling(fn, x, weights):
    """fn(x, w) for the next of `weights` at each call (in a captured graph: each captured call
    reads its own copy, so the weight comes from HBM)."""
    turn = itertools.count()
    return lambda: fn(x, weights[next(turn) % len(weights)])


def bench_rotary(args, rows_out: list) -> None:
    from rein.kernels.triton_rotary_store import rotary_store_kv

    print("\n== rotary + K/V store: a = rotary_store_kv (one kernel), b = rotary_ then store_kv")
    for model, (_, _, heads, kv_heads, dim) in MODELS.items():
        for tokens in (64, 256):
            qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=BF16, device="cuda")
            qk = qkv[:, :(heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
            q, k = qk.split([heads, kv_heads], dim=1)
            v = qkv[:, (heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
            angles = torch.rand(tokens, 1, dim // 2, device="cuda") * 100
            cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
            blocks = 4096
            k_cache = torch.zeros(blocks, 16, kv_heads, dim, dtype=BF16, device="cuda")
            v_cache = torch.zeros_like(k_cache)
            slots = torch.randperm(blocks * 16, device="cuda")[:tokens]

            fused = functools.partial(rotary_store_kv, q, k, v, cos, sin, k_cache, v_cache, slots)
            separate = functools.partial(rotary_then_store, qk, k, v, cos, sin, k_cache, v_cache, slots)
            row = compare(f"rotary+store {model} T={tokens}", fused, separate, args.reps, args.rounds, eager=True)
            rows_out.append(row)
            print(f"{model:>11} T={tokens:>4}: fused {row['a_us']:.2f} us, separate {row['b_us']:.2f} us "
                  f"(x{row['b_over_a']:.2f}); eager {row['a_eager_us']:.1f} / {row['b_eager_us']:.1f} us")


def rotary_then_store(qk, k, v, cos, sin, k_cache, v_cache, slots) -> None:
    from rein.kernels import triton_elementwise, triton_store

    triton_elementwise.rotary_(qk, cos, sin)
    triton_store.store_kv(k, v, k_cache, v_cache, slots)


def bench_decode(args, rows_out: list) -> None:
    from rein.kernels.triton_decode import paged_decode_attention

    print("\n== decode attention: a = split merge folded (one launch), b = reduce kernel (two)")
    table_tokens, block, context = 32768, 16, 1024
    for model, (_, _, heads, kv_heads, dim) in MODELS.items():
        for batch in (1, 8, 64):
            width = table_tokens // block
            blocks = batch * (context // block) + 1
            k_cache = torch.randn(blocks, block, kv_heads, dim, dtype=BF16, device="cuda")
            v_cache = torch.randn_like(k_cache)
            tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            tables[:, :context // block] = torch.randperm(blocks - 1, device="cuda")[:batch * (context // block)] \
                .view(batch, -1).to(torch.int32)
            lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, heads, dim, dtype=BF16, device="cuda")
            folded = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, dim ** -0.5,
                                       fold_reduce=True)
            two = functools.partial(paged_decode_attention, q, k_cache, v_cache, tables, lens, dim ** -0.5,
                                    fold_reduce=False)
            row = compare(f"decode {model} B={batch} ctx={context}", folded, two, args.reps, args.rounds, eager=True)
            row["max_diff"] = max_diff(folded(), two())
            rows_out.append(row)
            print(f"{model:>11} B={batch:>3}: folded {row['a_us']:.2f} us, two kernels {row['b_us']:.2f} us "
                  f"(x{row['b_over_a']:.2f}); eager {row['a_eager_us']:.1f} / {row['b_eager_us']:.1f} us; "
                  f"max diff {row['max_diff']:.3g}")


def bench_prefill(args, rows_out: list) -> None:
    from torch.nn.attention.varlen import varlen_attn

    from rein.kernels.triton_prefill import paged_prefill_attention
    from rein.kernels.triton_store import store_kv

    _, _, heads, kv_heads, dim = MODELS["llama3-8b"]
    print("\n== prefill without a cached prefix: a = flash varlen (own K/V), b = Triton paged prefill")
    for lengths in ([512] * 4, [2048]):
        total, block = sum(lengths), 16
        q = torch.randn(total, heads, dim, dtype=BF16, device="cuda")
        k = torch.randn(total, kv_heads, dim, dtype=BF16, device="cuda")
        v = torch.randn_like(k)
        widths = [-(-n // block) for n in lengths]
        k_cache = torch.zeros(sum(widths) + 1, block, kv_heads, dim, dtype=BF16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        tables = torch.zeros(len(lengths), max(widths), dtype=torch.int32, device="cuda")
        slots, first = [], 0
        for i, (n, w) in enumerate(zip(lengths, widths, strict=True)):
            tables[i, :w] = torch.arange(first, first + w, dtype=torch.int32)
            slots += [first * block + t for t in range(n)]
            first += w
        store_kv(k, v, k_cache, v_cache, torch.tensor(slots, device="cuda"))
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        scale = dim ** -0.5
        flash = functools.partial(varlen_attn, q, k, v, cu, cu, total, total, scale=scale, window_size=(-1, 0),
                                  enable_gqa=True)
        triton_paged = functools.partial(paged_prefill_attention, q, k_cache, v_cache, tables, cu, lens, scale)

        row = compare(f"prefill {lengths}", flash, triton_paged, 1, args.rounds)
        row["max_diff"] = max_diff(flash(), triton_paged())
        flops = sum(4 * n * n / 2 * heads * dim for n in lengths)
        row["flash_tflops"], row["triton_tflops"] = flops / row["a_us"] / 1e6, flops / row["b_us"] / 1e6
        rows_out.append(row)
        print(f"{str(lengths):>22}: flash {row['a_us']:.1f} us ({row['flash_tflops']:.0f} TFLOP/s), "
              f"Triton {row['b_us']:.1f} us ({row['triton_tflops']:.0f} TFLOP/s); max diff {row['max_diff']:.3g}")


SECTIONS = {"gemm": bench_gemm, "mlp_down": bench_mlp_down, "rotary": bench_rotary, "decode": bench_decode, "prefill": bench_prefill}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="the device's HBM bandwidth (H200: 4.8)")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument("--quick", action="store_true", help="3 rounds, M = 1 and 64 only")
    args = parser.parse_args()
    args.rows = (1, 64) if args.quick else (1, 8, 64)
    if args.quick:
        args.rounds = min(args.rounds, 3)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows: list = []
    for name in args.sections.split(","):
        try:
            SECTIONS[name](args, rows)
        except Exception as exc:   # one section failing must not lose the others' figures
            print(f"section {name} failed: {type(exc).__name__}: {exc}")
            rows.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
