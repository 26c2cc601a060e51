"""GGUF's 5- and 6-bit types in rein's CPU quantized matmul: held packed (a nibble plane and 1-bit
planes, float16 x int8 scales; rein.kernels.packed_bits) against the 8-bit layout they were held
in before (an int8 per weight, float32 scales per group), side by side in one run.

    python bench/packed_matmul.py [--types Q5_K,Q6_K] [--shapes 4096x4096,11008x4096] [--batches 1,8]
                                  [--threads N] [--repeats 30]

Each weight is random valid GGUF blocks of the type, repacked by rein.model.quant.gguf_blocks;
the 8-bit form is the same weight widened (rein.kernels.quantized.widened), so both compute the
same product. Both run the C kernel through its CpuPanels (made once, outside the timing). Time
is the fastest and the median of --repeats calls, the two layouts interleaved call by call so
that a shared machine's noise falls on both alike (on a busy machine the fastest call is the
steadier figure). Decode (batch 1) reads every weight once per call: its time
follows the bytes held. The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0):
    """Valid GGUF blocks of a type for a [rows, cols] matrix of weights about N(0, 0.05)."""
    import numpy as np

    from rein.fixtures.tiny_gguf import quantize

    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return quantize(w, type_name)


def time_calls(calls: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """(fastest, median) seconds of each call, interleaved."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():   # warm-up (and the library's build)
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q5_K,Q6_K")
    parser.add_argument("--shapes", default="4096x4096,11008x4096")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)

    import torch

    from rein.kernels import cpu_native
    from rein.kernels.quantized import CpuPanels, widened
    from rein.model.quant.gguf_blocks import repack

    torch.set_num_threads(args.threads)
    if cpu_native.library() is None:
        raise SystemExit(f"the C kernels are not available: {cpu_native.why_unavailable()}")
    print(f"C kernels: {cpu_native.instruction_set()}, {args.threads} threads, {args.repeats} calls each: "
          f"fastest (median) ms")
    print(f"{'type':>5} {'shape':>12} {'batch':>5} {'packed ms':>15} {'8-bit ms':>15} {'packed/8-bit':>12} "
          f"{'packed B/w':>10} {'8-bit B/w':>9}")
    results = []
    for type_name in args.types.split(","):
        for shape in args.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            weight = repack(random_blocks(type_name, rows, cols), type_name, rows, cols)
            packed = CpuPanels.from_weight(weight)
            old = CpuPanels.from_weight(widened(weight, weight.group))
            for batch in (int(b) for b in args.batches.split(",")):
                x = torch.randn(batch, cols)
                got, want = cpu_native.quantized_matmul(x, packed), cpu_native.quantized_matmul(x, old)
                if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
                    raise SystemExit(f"{type_name} {shape}: the packed and 8-bit products differ")
                med = time_calls({"packed": lambda x=x, w=packed: cpu_native.quantized_matmul(x, w),
                                  "8bit": lambda x=x, w=old: cpu_native.quantized_matmul(x, w)}, args.repeats)
                row = {"type": type_name, "rows": rows, "cols": cols, "batch": batch,
                       "packed_ms": med["packed"][0] * 1e3, "8bit_ms": med["8bit"][0] * 1e3,
                       "packed_median_ms": med["packed"][1] * 1e3, "8bit_median_ms": med["8bit"][1] * 1e3,
                       "packed_bytes_per_weight": packed.nbytes() / (rows * cols),
                       "8bit_bytes_per_weight": old.nbytes() / (rows * cols)}
                results.append(row)
                cells = [f"{row[k + '_ms']:.2f} ({row[k + '_median_ms']:.2f})" for k in ("packed", "8bit")]
                print(f"{type_name:>5} {shape:>12} {batch:>5} {cells[0]:>15} {cells[1]:>15} "
                      f"{row['packed_ms'] / row['8bit_ms']:>11.2f}x {row['packed_bytes_per_weight']:>10.3f} "
                      f"{row['8bit_bytes_per_weight']:>9.3f}", flush=True)
    print(json.dumps({"threads": args.threads, "instruction_set": cpu_native.instruction_set(), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
