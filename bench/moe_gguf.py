"""MoE GGUF files: the memory the experts hold kept quantized against dequantized, and the time
of one sparse layer's experts both ways, on the CPU.

    python bench/moe_gguf.py [--arch qwen2_moe] [--preset small] [--types Q8_0,Q4_0]
                             [--tokens 1,8,64] [--repeats 5] [--cache-dir ~/.cache/rein/bench]

The model is rein's random-weight tiny model (rein.fixtures.tiny_model; "small": hidden 512,
8 layers, 8 experts of 352 (Qwen2-MoE: plus a 1408-wide shared expert) -- Mixtral's experts are
its 1408-wide intermediate size), written as a GGUF file per type by rein.fixtures.tiny_gguf
(the stacked ffn_*_exps llama.cpp writes) and loaded as the engine does (rein.model.loader),
once with `--quantization auto` (experts kept in their blocks) and once with `none` (every
tensor float32).

Figures, per type:
* expert bytes: what the routed experts of all layers hold -- the C kernel's integer panels,
  scales and offsets (QuantizedExperts.nbytes) against float32 [E, 2I, H] + [E, H, I];
* weights: rein.model.quant.checkpoint.resident_bytes of the whole model, both ways;
* layer time: layer 0's SparseMoeBlock forward on T tokens (router, per-expert matmuls),
  best of --repeats, quantized (rein's C kernel per expert) and dequantized (oneDNN per expert).

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="qwen2_moe", choices=("qwen2_moe", "mixtral"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--types", default="Q8_0,Q4_0")
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rein" / "bench"))
    args = parser.parse_args()

    import torch

    from rein.fixtures.tiny_gguf import write_gguf
    from rein.fixtures.tiny_model import ensure_tiny_model
    from rein.model.architectures.moe import SparseMoeBlock
    from rein.model.files import resolve_model
    from rein.model.loader import load_model
    from rein.model.quant.checkpoint import resident_bytes

    cache = Path(args.cache_dir).expanduser()
    os.environ.setdefault("REIN_CACHE_DIR", str(cache / "rein-cache"))
    model_dir = ensure_tiny_model(cache / f"tiny-{args.arch}-{args.preset}", args.arch, preset=args.preset)
    token_counts = [int(t) for t in args.tokens.split(",")]
    results: dict = {"arch": args.arch, "preset": args.preset, "threads": torch.get_num_threads(), "types": {}}

    def block_time(block: SparseMoeBlock, tokens: int) -> float:
        x = torch.randn(tokens, block.gate.in_features, generator=torch.Generator().manual_seed(tokens))
        best = float("inf")
        with torch.no_grad():
            block(x)   # warm-up
            for _ in range(args.repeats):
                start = time.perf_counter()
                block(x)
                best = min(best, time.perf_counter() - start)
        return best * 1e3

    for qtype in args.types.split(","):
        path = cache / f"tiny-{args.arch}-{args.preset}-{qtype}.gguf"
        if not path.is_file():
            write_gguf(model_dir, path, qtype)
        files = resolve_model(str(path))
        row: dict = {}
        for quantization in ("auto", "none"):
            model = load_model(files, files.spec, 256, torch.float32, torch.device("cpu"), quantization=quantization)
            blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
            if quantization == "auto":
                experts = sum(b.quantized_gate_up.nbytes() + b.quantized_down.nbytes() for b in blocks)
            else:
                experts = sum(b.gate_up_proj.numel() * 4 + b.down_proj.numel() * 4 for b in blocks)
            kind = "quantized" if quantization == "auto" else "dequantized"
            row[kind] = {"expert_bytes": experts, "weight_bytes": resident_bytes(model),
                         "layer_ms": {t: round(block_time(blocks[0], t), 3) for t in token_counts}}
            del model, blocks
        row["expert_ratio"] = round(row["quantized"]["expert_bytes"] / row["dequantized"]["expert_bytes"], 4)
        results["types"][qtype] = row
        mib = 2**20
        print(f"{args.arch} ({args.preset}) {qtype}: experts {row['quantized']['expert_bytes'] / mib:.1f} MiB "
              f"quantized vs {row['dequantized']['expert_bytes'] / mib:.1f} MiB float32 "
              f"({row['expert_ratio']:.3f}); whole weights {row['quantized']['weight_bytes'] / mib:.1f} vs "
              f"{row['dequantized']['weight_bytes'] / mib:.1f} MiB")
        for t in token_counts:
            print(f"  layer 0 experts, {t} tokens: quantized {row['quantized']['layer_ms'][t]:.2f} ms, "
                  f"dequantized {row['dequantized']['layer_ms'][t]:.2f} ms")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
