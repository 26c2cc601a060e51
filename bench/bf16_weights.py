"""bfloat16 projections on the CPU: oneDNN with the weights prepacked against the ways rein ran
bfloat16 before (oneDNN on the dense weight from 4 rows, F.linear below) and against float32
prepacked (rein's default CPU dtype), on SmolLM2-135M's shapes of one layer and its head.

    python bench/bf16_weights.py [--rows 1,8,32,2048] [--threads 1] [--calls 20]

Systems, for each row count, called in turn (interleaved: call i of every system before call
i + 1 of any, so a load change on a shared machine hits all of them alike):
* fp32 packed: float32 weights prepacked (`rein.model.architectures.linear.pack_weights`);
* bf16 packed: bfloat16 weights prepacked the same way (what this change adds where the CPU
  has AVX-512-BF16 or AMX: `rein.kernels.cpu_paths` probes it);
* bf16 dense: `rein.model.architectures.linear.linear` on a dense bfloat16 weight (oneDNN
  from 4 rows, F.linear below: bfloat16 before this change);
* bf16 F.linear: torch's own bfloat16 path.
Figures: per-call minimum of process time (CPU seconds of this process: less sensitive to
other jobs than wall time) over --calls calls, ms for the whole layer's projections (q/k/v,
o, gate/up, down) and separately for the logits (49152 x 576). The last line of stdout is
one JSON object with every figure. Prints why not and exits 0 where bfloat16 has no oneDNN
primitive on this CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rein.kernels import cpu_paths
from rein.model.architectures.linear import PACK_ROWS_HINT, linear

# SmolLM2-135M: hidden 576, 9 heads and 3 KV heads of 64, MLP 1536, vocabulary 49152.
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
HEAD = {"logits": (49152, 576)}
SYSTEMS = ("fp32 packed", "bf16 packed", "bf16 dense", "bf16 F.linear")


def weights(shapes: dict, system: str) -> dict:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for name, (rows, cols) in shapes.items():
        w = torch.randn(rows, cols, generator=generator) * cols ** -0.5
        if system.startswith("bf16"):
            w = w.to(torch.bfloat16)
        if system.endswith("packed"):
            w = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        out[name] = w
    return out


def run_once(system: str, ws: dict, inputs: dict) -> float:
    started = time.process_time()
    for name, w in ws.items():
        x = inputs[name][torch.float32 if system.startswith("fp32") else torch.bfloat16]
        if system == "bf16 F.linear":
            torch.nn.functional.linear(x, w)
        else:
            linear(x, w)
    return time.process_time() - started


def measure(shapes: dict, rows: int, calls: int) -> dict:
    generator = torch.Generator().manual_seed(1)
    inputs = {}
    for name, (_, cols) in shapes.items():
        x = torch.randn(rows, cols, generator=generator)
        inputs[name] = {torch.float32: x, torch.bfloat16: x.to(torch.bfloat16)}
    ws = {system: weights(shapes, system) for system in SYSTEMS}
    best = dict.fromkeys(SYSTEMS, float("inf"))
    with torch.inference_mode():
        for system in SYSTEMS:   # warm-up: oneDNN builds its primitives on the first call
            run_once(system, ws[system], inputs)
        for _ in range(calls):
            for system in SYSTEMS:
                best[system] = min(best[system], run_once(system, ws[system], inputs))
    return {system: seconds * 1e3 for system, seconds in best.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,2048")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    why = cpu_paths.probe_onednn(torch.bfloat16)
    print(cpu_paths.describe(torch.bfloat16))
    if why is not None:
        print(f"bfloat16 has no oneDNN path here ({why}): nothing to compare")
        return 0
    results = {}
    for part, shapes in (("layer", LAYER), ("logits", HEAD)):
        for rows in (int(r) for r in args.rows.split(",")):
            calls = max(3, args.calls // 8) if rows >= 512 else args.calls
            ms = measure(shapes, rows, calls)
            results[f"{part}@{rows}"] = ms
            cells = "  ".join(f"{system} {value:8.3f}" for system, value in ms.items())
            print(f"{part:6s} rows {rows:5d}: {cells}  | bf16 packed / fp32 packed "
                  f"{ms['bf16 packed'] / ms['fp32 packed']:.2f}, / bf16 dense {ms['bf16 packed'] / ms['bf16 dense']:.2f}",
                  flush=True)
    print(json.dumps({"threads": args.threads, "ms_min_process_time": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
