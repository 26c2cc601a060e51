"""Micro-benchmarks of rein's Triton paged-attention kernels on one CUDA GPU.

    python bench/kernels.py [--peak-gbps GBPS] [--iters N] [--quick] [--no-flush]

Measured (each figure printed as it is taken; the last line of stdout is one JSON object
holding all of them):

* decode: `triton_ops.paged_decode_attention` against the torch reference
  (`reference.paged_decode_attention`, gather + SDPA) and against
  `scaled_dot_product_attention` on K/V already contiguous ([B, kv_heads, L, d], the GQA
  group folded into the query length, the best case for SDPA), over batch {1, 8, 64, 256}
  x context {128, 1k, 4k, 32k}; 32 query heads, 8 KV heads (GQA 4), head_dim 128, bf16,
  block size 16, each request's blocks scattered over the cache. Achieved bandwidth = K/V
  bytes read / kernel time, also as a share of the device's peak HBM bandwidth. Combos
  whose tensors do not fit in free memory are skipped (per implementation).
* prefill: `paged_prefill_attention` vs causal SDPA (contiguous, enable_gqa) for a few
  prompt lengths, plus a chunk-after-prefix case SDPA cannot express with is_causal.
* int8 vs bf16 cache for decode (same shapes), and store_kv for both cache dtypes.

Timing: CUDA events around each launch, after warm-up (which also compiles the kernels),
median of --iters; the L2 cache is flushed before every timed launch (--no-flush to keep
it) because in a model each layer's K/V is cold. Everything finishes in < 5 minutes on an
H100/H200; a deadline skips what is left if a slow machine runs over.

Without CUDA (or without triton) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time

import torch

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
DEADLINE_S = 270.0  # leave head-room under the 5-minute budget

# Peak HBM bandwidth in GB/s by device-name substring; first match wins, so more specific
# names come first ("GH200" contains "H200", "H100 PCIe" contains "H100").
PEAK_GBPS = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB", 1935.0),  # PCIe
    ("A100", 1555.0),  # 40GB
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
]


def engine_figures() -> dict:
    """Hook for end-to-end engine figures (tokens/s); the lead fills this in later.

    Whatever it returns is stored under "engine" in the final JSON line.
    """
    return {}


def peak_gbps_for(name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key.lower() in name.lower():
            return gbps
    return None


class Timer:
    """Median kernel time with CUDA events; optional L2 flush before each timed launch."""

    def __init__(self, iters: int, warmup: int, flush: bool, deadline: float):
        self.iters, self.warmup, self.deadline = iters, warmup, deadline
        # 256 MiB > any current L2 (H100 50 MB, H200 60 MB, B200 126 MB).
        self.flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush else None

    def __call__(self, fn, *args, **kwargs) -> float:
        """Microseconds per call of fn(*args, **kwargs) (median)."""
        if args or kwargs:
            fn = functools.partial(fn, *args, **kwargs)
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        # Fewer iterations for slow calls so the whole script stays within budget.
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one = time.perf_counter() - t0
        iters = max(3, min(self.iters, int(0.5 / max(one, 1e-6))))
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(iters)]
        for start, end in pairs:
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3

    def expired(self) -> bool:
        return time.perf_counter() > self.deadline


def free_bytes() -> int:
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def make_paged(batch: int, ctx: int, cache_dtype: torch.dtype, gen: torch.Generator):
    """K/V cache holding `batch` requests of `ctx` tokens in shuffled blocks, + block tables."""
    blocks_per_req = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if cache_dtype == torch.int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
        v = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
        ks = torch.rand(shape[:3], device="cuda", generator=gen) / 64
        vs = torch.rand(shape[:3], device="cuda", generator=gen) / 64
    else:
        k = torch.empty(shape, dtype=cache_dtype, device="cuda").normal_(generator=gen)
        v = torch.empty(shape, dtype=cache_dtype, device="cuda").normal_(generator=gen)
        ks = vs = None
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(batch, blocks_per_req)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k, v, ks, vs, tables, lens


def kv_bytes(batch: int, ctx: int, cache_dtype: torch.dtype) -> int:
    per_token = 2 * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=cache_dtype).element_size()
    if cache_dtype == torch.int8:
        per_token += 2 * NUM_KV_HEADS * 4  # scales
    return batch * ctx * per_token


def fmt(us: float | None) -> str:
    return f"{us:9.1f}us" if us is not None else "      -    "


def bench_decode(timer: Timer, peak: float, quick: bool, gen: torch.Generator, results: dict):
    from rein.kernels import reference, triton_ops

    batches = [1, 8, 64, 256]
    contexts = [128, 1024, 4096, 32768]
    if quick:
        batches, contexts = [1, 64], [1024, 32768]
    scale = HEAD_DIM ** -0.5
    print(f"\n== decode: {NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, d={HEAD_DIM}, {DTYPE_NAME}, "
          f"block {BLOCK_SIZE}; peak {peak:.0f} GB/s")
    print(f"{'batch':>6} {'ctx':>6} {'triton':>11} {'GB/s':>7} {'%peak':>6} {'reference':>11} "
          f"{'sdpa':>11} {'sdpa %pk':>8} {'max err':>8}")
    for batch in batches:
        for ctx in contexts:
            row = {"batch": batch, "context": ctx}
            nbytes = kv_bytes(batch, ctx, DTYPE)
            if timer.expired():
                row["skipped"] = "time budget"
                results["decode"].append(row)
                continue
            if nbytes * 1.1 > free_bytes():
                row["skipped"] = "cache exceeds free memory"
                print(f"{batch:>6} {ctx:>6} skipped: {nbytes / 1e9:.1f} GB cache exceeds free memory")
                results["decode"].append(row)
                continue
            k, v, _, _, tables, lens = make_paged(batch, ctx, DTYPE, gen)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
            out = triton_ops.paged_decode_attention(q, k, v, tables, lens, scale)
            t_tri = timer(triton_ops.paged_decode_attention, q, k, v, tables, lens, scale)
            row.update(triton_us=t_tri, triton_gbps=nbytes / t_tri / 1e3,
                       triton_pct_peak=100 * nbytes / t_tri / 1e3 / peak, kv_bytes=nbytes)
            # The reference gathers K and V (2 copies), SDPA's mask path may copy again.
            if nbytes * 3.5 < free_bytes():
                want = reference.paged_decode_attention(q, k, v, tables, lens, scale)
                row["max_abs_err"] = (out.float() - want.float()).abs().max().item()
                del want
                row["reference_us"] = timer(reference.paged_decode_attention, q, k, v, tables, lens, scale)
            if nbytes * 1.2 < free_bytes():
                # Contiguous [B, kvh, L, d] K/V; the query group becomes SDPA's query length,
                # so K/V are read once (no mask: every request has the full context).
                kc = k.view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
                vc = v.view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
                # The tables are a permutation, so the view above is not the requests' own
                # data; irrelevant for timing.
                qg = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                t = timer(sdpa, qg, kc, vc, scale=scale)
                row.update(sdpa_us=t, sdpa_gbps=nbytes / t / 1e3, sdpa_pct_peak=100 * nbytes / t / 1e3 / peak)
                del kc, vc
            print(f"{batch:>6} {ctx:>6} {fmt(t_tri)} {row['triton_gbps']:7.0f} "
                  f"{row['triton_pct_peak']:5.1f}% {fmt(row.get('reference_us'))} "
                  f"{fmt(row.get('sdpa_us'))} "
                  f"{row.get('sdpa_pct_peak', float('nan')):7.1f}% "
                  f"{row.get('max_abs_err', float('nan')):8.1e}")
            results["decode"].append(row)
            del k, v, tables, lens, q, out


def bench_int8(timer: Timer, peak: float, quick: bool, gen: torch.Generator, results: dict):
    from rein.kernels import triton_ops

    combos = [(8, 32768), (64, 4096), (256, 1024)] if not quick else [(64, 4096)]
    scale = HEAD_DIM ** -0.5
    print(f"\n== decode: int8 cache vs {DTYPE_NAME} cache (triton)")
    print(f"{'batch':>6} {'ctx':>6} {DTYPE_NAME:>11} {'int8':>11} {'speedup':>8} {'int8 GB/s':>10} {'%peak':>6}")
    for batch, ctx in combos:
        row = {"batch": batch, "context": ctx}
        if timer.expired():
            row["skipped"] = "time budget"
            results["int8_vs_bf16"].append(row)
            continue
        if (kv_bytes(batch, ctx, DTYPE) + kv_bytes(batch, ctx, torch.int8)) * 1.1 > free_bytes():
            row["skipped"] = "cache exceeds free memory"
            results["int8_vs_bf16"].append(row)
            continue
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        for name, dtype in (("bf16", DTYPE), ("int8", torch.int8)):
            k, v, ks, vs, tables, lens = make_paged(batch, ctx, dtype, gen)
            t = timer(triton_ops.paged_decode_attention, q, k, v, tables, lens, scale, ks, vs)
            nbytes = kv_bytes(batch, ctx, dtype)
            row[f"{name}_us"] = t
            row[f"{name}_gbps"] = nbytes / t / 1e3
            row[f"{name}_pct_peak"] = 100 * nbytes / t / 1e3 / peak
            del k, v, ks, vs
        row["int8_speedup"] = row["bf16_us"] / row["int8_us"]
        print(f"{batch:>6} {ctx:>6} {fmt(row['bf16_us'])} {fmt(row['int8_us'])} "
              f"{row['int8_speedup']:7.2f}x {row['int8_gbps']:10.0f} {row['int8_pct_peak']:5.1f}%")
        results["int8_vs_bf16"].append(row)


def bench_prefill(timer: Timer, quick: bool, gen: torch.Generator, results: dict):
    from rein.kernels import reference, triton_ops

    # (requests, chunk length, prefix length)
    cases = [(1, 512, 0), (1, 2048, 0), (1, 8192, 0), (4, 2048, 0), (1, 2048, 6144)]
    if quick:
        cases = [(1, 2048, 0), (1, 2048, 6144)]
    scale = HEAD_DIM ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"\n== prefill: causal, {DTYPE_NAME}, GQA {NUM_HEADS // NUM_KV_HEADS}, d={HEAD_DIM} "
          "(TFLOP/s counts only unmasked pairs)")
    print(f"{'reqs':>5} {'chunk':>6} {'prefix':>6} {'triton':>11} {'TFLOP/s':>8} {'sdpa':>11} "
          f"{'TFLOP/s':>8} {'reference':>11} {'max err':>8}")
    for reqs, chunk, prefix in cases:
        row = {"requests": reqs, "chunk": chunk, "prefix": prefix}
        if timer.expired():
            row["skipped"] = "time budget"
            results["prefill"].append(row)
            continue
        ctx = prefix + chunk
        k, v, _, _, tables, lens = make_paged(reqs, ctx, DTYPE, gen)
        q = torch.randn(reqs * chunk, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        cu = torch.arange(0, reqs + 1, dtype=torch.int32, device="cuda") * chunk
        pairs = reqs * (chunk * (chunk + 1) // 2 + chunk * prefix)
        flops = 4 * NUM_HEADS * HEAD_DIM * pairs
        out = triton_ops.paged_prefill_attention(q, k, v, tables, cu, lens, scale)
        t_tri = timer(triton_ops.paged_prefill_attention, q, k, v, tables, cu, lens, scale)
        row.update(triton_us=t_tri, triton_tflops=flops / t_tri / 1e6)
        if ctx <= 8192:
            want = reference.paged_prefill_attention(q, k, v, tables, cu, lens, scale)
            row["max_abs_err"] = (out.float() - want.float()).abs().max().item()
            del want
            row["reference_us"] = timer(reference.paged_prefill_attention, q, k, v, tables, cu, lens, scale)
        if prefix == 0:
            qs = q.view(reqs, chunk, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
            kc = torch.randn(reqs, NUM_KV_HEADS, chunk, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
            vc = torch.randn_like(kc)
            t = timer(sdpa, qs, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
            row.update(sdpa_us=t, sdpa_tflops=flops / t / 1e6)
            del qs, kc, vc
        print(f"{reqs:>5} {chunk:>6} {prefix:>6} {fmt(t_tri)} {row['triton_tflops']:8.1f} "
              f"{fmt(row.get('sdpa_us'))} {row.get('sdpa_tflops', float('nan')):8.1f} "
              f"{fmt(row.get('reference_us'))} {row.get('max_abs_err', float('nan')):8.1e}")
        results["prefill"].append(row)
        del k, v, q, out


def bench_store(timer: Timer, gen: torch.Generator, results: dict):
    from rein.kernels import triton_ops

    tokens = 8192
    print(f"\n== store_kv: {tokens} tokens, {NUM_KV_HEADS} kv heads, d={HEAD_DIM}")
    for name, dtype in (("bf16", DTYPE), ("int8", torch.int8)):
        if timer.expired():
            results["store"].append({"cache": name, "skipped": "time budget"})
            continue
        k, v, ks, vs, _, _ = make_paged(1, 2 * tokens, dtype, gen)
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        val = torch.randn_like(key)
        slots = torch.randperm(2 * tokens, device="cuda", generator=gen)[:tokens]
        t = timer(triton_ops.store_kv, key, val, k, v, slots, ks, vs)
        moved = 2 * key.numel() * key.element_size() + kv_bytes(tokens, 1, dtype)
        print(f"  {name}: {fmt(t)}  {moved / t / 1e3:7.0f} GB/s (read + written)")
        results["store"].append({"cache": name, "tokens": tokens, "us": t, "gbps": moved / t / 1e3})
        del k, v, ks, vs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth in GB/s (default: from the device name)")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per figure (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 between launches")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/kernels.py: no CUDA device; these are GPU kernel benchmarks, nothing to measure.")
        print(json.dumps({"cuda": False, "skipped": "no CUDA device"}))
        return 0
    try:
        import triton
    except ImportError:
        print("bench/kernels.py: triton is not installed; nothing to measure.")
        print(json.dumps({"cuda": True, "triton": False, "skipped": "triton not installed"}))
        return 0

    start = time.perf_counter()
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps_for(name)
    peak_source = "--peak-gbps" if args.peak_gbps else "table"
    if peak is None:
        peak, peak_source = 2000.0, "unknown device, assumed"
    props = torch.cuda.get_device_properties(0)
    print(f"device: {name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB; peak {peak:.0f} GB/s ({peak_source}); "
          f"torch {torch.__version__}, triton {triton.__version__}")
    results: dict = {"device": name, "sms": props.multi_processor_count, "peak_gbps": peak,
                     "peak_source": peak_source, "torch": torch.__version__,
                     "triton": triton.__version__, "l2_flush": not args.no_flush,
                     "decode": [], "int8_vs_bf16": [], "prefill": [], "store": []}
    timer = Timer(args.iters, args.warmup, not args.no_flush, start + DEADLINE_S)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        bench_decode(timer, peak, args.quick, gen, results)
        bench_int8(timer, peak, args.quick, gen, results)
        bench_prefill(timer, args.quick, gen, results)
        bench_store(timer, gen, results)
    results["engine"] = engine_figures()
    results["wall_s"] = time.perf_counter() - start
    print(f"\ntotal {results['wall_s']:.0f}s")
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
