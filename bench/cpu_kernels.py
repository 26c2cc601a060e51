"""rein's CPU kernels against the torch code they replace, side by side in one process.

    python bench/cpu_kernels.py [--threads 1] [--repeat 5] [--parts decode,prefill,elementwise,projections]

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, hidden 576, intermediate
1536, 30 layers), float32, random data, glibc malloc set up as the engine sets it
(rein.model.cpu_allocator). Each figure is the best of --repeat timings of
CPU time (time.process_time: what the thread itself spent, so neighbours on a shared
machine disturb it less than wall time); the variants of one figure are timed in interleaved
rounds (`interleaved_best_ms`), the others back to back:

* decode attention, per layer: `rein.kernels.cpu_native.paged_decode_attention` (reads K/V
  in place from the cache blocks) against `rein.kernels.reference.paged_decode_attention`
  (gathers K/V into a padded copy, then torch SDPA), and the C kernel on the same cache in
  float16 and bfloat16 (`--kv-cache-dtype`), batch x context, each request's blocks
  scattered, context lengths varied +-25%; the timing cycles through several layers' caches
  (256 MiB or 30 layers) so that, as in a real step, K and V come from memory, not the L3;
* prefill attention, one layer of a 2048-token step (8 prompts of 256 or 2 of 1024) and of
  one 4096-token prompt: `cpu_native.paged_prefill_attention` (float32, float16 and bfloat16
  caches) against the reference (torch's flash kernel), with the C kernel's rate in GFLOP/s
  (4 x head_dim flops per query head and visible key: the causal half);
* a layer's element-wise work at 32 rows (a decode step) and 2048 rows (a prefill step):
  RMSNorm, rotary on the fused Q/K projection, residual add + RMSNorm, SiLU-and-multiply and
  the last residual add, as rein.model.architectures.llama runs them with and without the kernels;
* the projections of all 30 layers (weights streamed from memory, not cache): oneDNN on the
  dense weight (before) against oneDNN on the weight prepacked at load
  (rein.model.architectures.linear.pack_weights), and torch's F.linear (MKL) for reference.

Prints one line per figure and, last, one JSON object with all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rein.kernels import cpu_native, reference  # noqa: E402
from rein.model.architectures.rope import apply_rotary  # noqa: E402
from rein.model.cpu_allocator import keep_freed_memory  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, LAYERS, BLOCK = 9, 3, 64, 576, 1536, 30, 16
PROJECTIONS = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN), (HIDDEN, 2 * INTER),
               (INTER, HIDDEN)]


def best_ms(fn, repeat: int, inner: int = 1, args: tuple = ()) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(inner):
            fn(*args)
        best = min(best, (time.process_time() - start) / inner)
    return best * 1e3


def interleaved_best_ms(fns: dict, repeat: int) -> dict[str, float]:
    """Each of `fns`' best CPU time in ms, timed in `repeat` rounds that run each once in turn
    (a neighbour's load then falls on all of them alike)."""
    best = {}
    for name, fn in fns.items():
        fn()
        best[name] = float("inf")
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            best[name] = min(best[name], time.process_time() - start)
    return {name: t * 1e3 for name, t in best.items()}


KV_DTYPES = (torch.float16, torch.bfloat16)


def paged_cache(lengths: list[int], gen: torch.Generator):
    """K and V caches holding `lengths` tokens per request, each request's blocks scattered."""
    per = [(int(n) + BLOCK - 1) // BLOCK for n in lengths]
    num_blocks = sum(per) + 8
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lengths), max(per), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per):
        tables[i, :n] = order[used:used + n].to(torch.int32)
        used += n
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    return k, v, tables, torch.tensor(lengths, dtype=torch.int32)


# A decode step's K/V of all layers is far larger than the CPU's caches, so each layer's is read
# from memory: the bench cycles through enough layers' caches (up to LAYERS) to exceed this.
STREAMED_BYTES = 256 << 20


def bench_decode(repeat: int, gen: torch.Generator) -> list[dict]:
    rows = []
    for batch in (8, 32, 64):
        for ctx in (128, 512, 1024):
            lengths = torch.randint(max(1, ctx * 3 // 4), ctx * 5 // 4 + 1, (batch,), generator=gen).tolist()
            layer_bytes = sum(lengths) * KV_HEADS * HEAD_DIM * 4 * 2
            layers = [(torch.randn(batch, HEADS, HEAD_DIM, generator=gen), *paged_cache(lengths, gen))
                      for _ in range(min(LAYERS, max(2, -(-STREAMED_BYTES // layer_bytes))))]

            half = {dtype: [(q, k.to(dtype), v.to(dtype), tables, lens) for q, k, v, tables, lens in layers]
                    for dtype in KV_DTYPES}

            def run(attention, layers=layers):
                for q, k, v, tables, lens in layers:
                    attention(q, k, v, tables, lens, 0.125)

            ms = interleaved_best_ms({
                "torch": lambda: run(reference.paged_decode_attention),
                "native": lambda: run(cpu_native.paged_decode_attention),
                **{str(dtype): lambda cache=half[dtype]: run(cpu_native.paged_decode_attention, cache)
                   for dtype in KV_DTYPES}}, repeat)
            torch_ms, native_ms = ms["torch"] / len(layers), ms["native"] / len(layers)
            f16_ms, bf16_ms = (ms[str(dtype)] / len(layers) for dtype in KV_DTYPES)
            row = {"batch": batch, "context": ctx, "torch_ms": torch_ms, "native_ms": native_ms,
                   "speedup": torch_ms / native_ms, "native_f16_ms": f16_ms, "native_bf16_ms": bf16_ms}
            print(f"decode attention  batch {batch:3d} context ~{ctx:5d}: torch {torch_ms:7.3f} ms   "
                  f"native {native_ms:7.3f} ms   {row['speedup']:5.2f}x   f16 cache {f16_ms:7.3f} ms   "
                  f"bf16 cache {bf16_ms:7.3f} ms  (a layer, {len(layers)} layers' caches)", flush=True)
            rows.append(row)
    return rows


def bench_prefill(repeat: int, gen: torch.Generator) -> list[dict]:
    """One layer's attention over a 2048-token prefill step (whole prompts of 256 or 1024 tokens)
    and over one 4096-token prompt."""
    rows = []
    for prompt, count in ((256, 8), (1024, 2), (4096, 1)):
        lengths = [prompt] * count
        k, v, tables, lens = paged_cache(lengths, gen)
        query = torch.randn(sum(lengths), HEADS, HEAD_DIM, generator=gen)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        gflop = 4 * HEAD_DIM * HEADS * count * prompt * (prompt + 1) / 2 / 1e9

        def native(cache_k, cache_v, query=query, tables=tables, cu=cu, lens=lens):
            return lambda: cpu_native.paged_prefill_attention(query, cache_k, cache_v, tables, cu, lens, 0.125)

        ms = interleaved_best_ms({
            "torch": lambda case=(query, k, v, tables, cu, lens): reference.paged_prefill_attention(*case, 0.125),
            "native": native(k, v),
            **{str(dtype): native(k.to(dtype), v.to(dtype)) for dtype in KV_DTYPES}}, repeat)
        torch_ms, native_ms = ms["torch"], ms["native"]
        f16_ms, bf16_ms = (ms[str(dtype)] for dtype in KV_DTYPES)
        row = {"prompt": prompt, "prompts": count, "torch_ms": torch_ms, "native_ms": native_ms,
               "speedup": torch_ms / native_ms, "native_gflops": gflop / native_ms * 1e3,
               "native_f16_ms": f16_ms, "native_bf16_ms": bf16_ms}
        print(f"prefill attention {count:2d} prompts of {prompt:4d}: torch {torch_ms:8.3f} ms   "
              f"native {native_ms:8.3f} ms ({row['native_gflops']:5.1f} GFLOP/s)   {row['speedup']:5.2f}x   "
              f"f16 cache {f16_ms:8.3f} ms   bf16 cache {bf16_ms:8.3f} ms  (a layer)", flush=True)
        rows.append(row)
    return rows


def bench_elementwise(repeat: int, gen: torch.Generator) -> list[dict]:
    rows = []
    eps = 1e-5
    for tokens in (32, 2048):
        x = torch.randn(tokens, HIDDEN, generator=gen)
        attended = torch.randn(tokens, HIDDEN, generator=gen)
        mlp_out = torch.randn(tokens, HIDDEN, generator=gen)
        weight = torch.randn(HIDDEN, generator=gen)
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
        gate_up = torch.randn(tokens, 2 * INTER, generator=gen)
        angles = torch.rand(tokens, 1, HEAD_DIM // 2, generator=gen) * 100
        cos, sin = angles.cos(), angles.sin()

        def norm(t, weight=weight):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True).add_(eps)) * weight

        def with_torch(x=x, attended=attended, mlp_out=mlp_out, weight=weight, qkv=qkv, gate_up=gate_up,
                       cos=cos, sin=sin, tokens=tokens, norm=norm):
            norm(x)
            apply_rotary(qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM), cos, sin)
            residual = x + attended
            norm(residual)
            gate, up = gate_up.split(INTER, dim=-1)
            torch.nn.functional.silu(gate) * up
            residual + mlp_out

        def with_native(x=x, attended=attended, mlp_out=mlp_out, weight=weight, qkv=qkv, gate_up=gate_up,
                        cos=cos, sin=sin, tokens=tokens):
            cpu_native.rms_norm(x, weight, eps)
            cpu_native.rotary_(qkv[:, :(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, HEADS + KV_HEADS, HEAD_DIM),
                               cos, sin)
            residual = x.clone()   # the layer's own residual, updated in place
            cpu_native.add_rms_norm(residual, attended, weight, eps)
            cpu_native.silu_and_mul(gate_up)
            residual + mlp_out

        torch_ms = best_ms(with_torch, repeat, 5)
        native_ms = best_ms(with_native, repeat, 5)
        row = {"tokens": tokens, "torch_ms": torch_ms, "native_ms": native_ms, "speedup": torch_ms / native_ms}
        print(f"element-wise of one layer, {tokens:4d} rows: torch {torch_ms:7.3f} ms   native {native_ms:7.3f} ms"
              f"   {row['speedup']:5.2f}x", flush=True)
        rows.append(row)
    return rows


def bench_linear(repeat: int, gen: torch.Generator) -> list[dict]:
    dense = [[torch.randn(n, k, generator=gen) for k, n in PROJECTIONS] for _ in range(LAYERS)]
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in layer] for layer in dense]
    rows = []
    for tokens in (8, 32, 64, 2048):
        xs = [torch.randn(tokens, k, generator=gen) for k, _ in PROJECTIONS]

        def run(weights, op, xs=xs):
            def forward():
                for layer in weights:
                    for x, w in zip(xs, layer, strict=True):
                        op(x, w)
            return forward

        def onednn(x, w):
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        reps = max(2, repeat // 2) if tokens >= 1024 else repeat
        figures = {
            "onednn_dense_ms": best_ms(run(dense, onednn), reps),
            "onednn_packed_ms": best_ms(run(packed, onednn), reps),
            "mkl_f_linear_ms": best_ms(run(dense, torch.nn.functional.linear), reps),
        }
        row = {"tokens": tokens, **figures, "speedup": figures["onednn_dense_ms"] / figures["onednn_packed_ms"]}
        print(f"projections, {LAYERS} layers, {tokens:4d} rows: oneDNN dense {figures['onednn_dense_ms']:8.1f} ms   "
              f"packed {figures['onednn_packed_ms']:8.1f} ms ({row['speedup']:.2f}x)   "
              f"F.linear {figures['mkl_f_linear_ms']:8.1f} ms", flush=True)
        rows.append(row)
    return rows


PARTS = {"decode": ("decode_attention", bench_decode), "prefill": ("prefill_attention", bench_prefill),
         "elementwise": ("elementwise", bench_elementwise), "projections": ("projections", bench_linear)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--parts", default=",".join(PARTS), help="which figures, comma-separated")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()   # as the engine does on CPU: the reference's large gathers reuse memory
    if cpu_native.library() is None:
        print("error: the native CPU kernels did not build (see the warning above)", file=sys.stderr)
        return 1
    print(f"# cpu kernels bench: torch {torch.__version__}, threads {args.threads}, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    gen = torch.Generator().manual_seed(0)
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
    with torch.inference_mode():
        results = {PARTS[name][0]: PARTS[name][1](args.repeat, gen) for name in parts}
    print(f"# load at end {os.getloadavg()[0]:.2f}", flush=True)
    print(json.dumps({"bench": "cpu_kernels", "threads": args.threads, "torch": torch.__version__, **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
