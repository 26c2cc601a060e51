"""Models: rein's native code against its Transformers backend and Hugging Face static batching.

    python bench/models.py [--quick] [--models smollm2,gemma3] [--cache-dir ~/.cache/rein/bench]

For SmolLM2-135M-Instruct (Llama) and Gemma 3 270M (both from their packages on the index,
turned once into float32 safetensors folders under --cache-dir, as bench/peers.py does), one
seeded workload (random prompt ids and output lengths, both mixed; greedy, EOS ignored)
runs three ways in one process, one after another on the same threads:

* rein native: `LLMEngine(model_impl="rein")`;
* rein Transformers backend: `LLMEngine(model_impl="transformers")`, the model's own
  transformers modeling code with rein's paged attention (rein.model.architectures.transformers_backend);
* HF static: `generate()` on batches of --hf-batch-size in arrival order (bench/throughput.py).

It prints output tokens/s and the ratios the issue sets targets for (Transformers backend over
native >= 0.9 on SmolLM2, over HF static >= 2; Gemma 3 native over HF static >= 2), whether
the two rein paths gave the same tokens, and for Gemma 3 (windowed) the KV bytes a request of
8k tokens holds in its windowed layers at its peak, against a full-attention cache and the
windows' own share.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import ensure_f32_model  # noqa: E402  (bench helpers)
from throughput import (  # noqa: E402
    SEED,
    Workload,
    allowed_token_ids,
    greedy,
    load_hf,
    rein_generate,
    run_hf_static,
)

from rein.engine.config import EngineConfig  # noqa: E402
from rein.engine.engine import LLMEngine  # noqa: E402
from rein.model.spec import ModelSpec  # noqa: E402

MODELS = {"smollm2": None, "gemma3": "gemma3-270m"}   # bench name -> packaged model (None: SmolLM2)
KV_AT = 8192


def make_workload(allowed: list[int], quick: bool) -> Workload:
    rng = random.Random(f"{SEED}-models")
    # Mixed prompt and output lengths, as batch files have: static batching pays for each
    # batch's longest output (bench/throughput.py's "mixed" workload is shaped the same way).
    n, (plo, phi), (olo, ohi), batch = (8, (16, 96), (8, 32), 8) if quick else (32, (32, 480), (16, 128), 16)
    prompts = [[rng.choice(allowed) for _ in range(rng.randint(plo, phi))] for _ in range(n)]
    return Workload("mixed", prompts, [rng.randint(olo, ohi) for _ in range(n)], batch)


def run_engine(folder: Path, impl: str, wl: Workload) -> dict:
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", model_impl=impl,
                                    max_model_len=2048, kv_cache_memory="512MiB", max_num_seqs=64, seed=SEED))
    load_s = time.perf_counter() - started
    rein_generate(engine, [p[:8] for p in wl.prompts[:3]], [4, 4, 4])   # warm-up
    with torch.inference_mode():
        t0 = time.perf_counter()
        tokens = rein_generate(engine, wl.prompts, wl.output_lens)
        wall = time.perf_counter() - t0
    outs = [tokens[f"r{i}"] for i in range(wl.num_requests)]
    produced = sum(map(len, outs))
    return {"tps": produced / wall, "wall_s": wall, "load_s": load_s, "output_tokens": produced,
            "_tokens": outs, "_engine": engine}


def windowed_kv(folder: Path, allowed: list[int]) -> dict | None:
    """One request of KV_AT prompt tokens on a windowed model (4 sequences: the windowed layers get
    storage of their own, rein.engine.window_blocks): the windowed blocks it holds at its peak
    (a prefill chunk's blocks included) against a full-attention cache for those layers and against the
    windows' own share (KV_AT positions vs `window` positions per windowed layer)."""
    if not ModelSpec.from_dir(folder).windowed_layers:
        return None
    engine = LLMEngine(EngineConfig(model=str(folder), device="cpu", dtype="float32", max_model_len=KV_AT + 16,
                                    kv_cache_memory="1GiB", max_num_seqs=4, seed=SEED))
    spec = engine.spec
    if engine.windows is None:
        return {"windowed_storage": False, "why": engine.runner.capacity.describe()}
    rng = random.Random(f"{SEED}-kv")
    engine.add_request("long", [rng.choice(allowed) for _ in range(KV_AT)], greedy(1))
    while engine.has_unfinished():
        engine.step()
    peak = engine.windows.peak_held   # inside steps too: a prefill chunk's blocks join the window's
    block = engine.config.block_size
    per_layer_token = engine.runner.capacity.windowed_bytes_per_block // block // spec.windowed_layers
    window = spec.sliding_window
    held = peak * block * spec.windowed_layers * per_layer_token
    full = KV_AT * spec.windowed_layers * per_layer_token
    share = window * spec.windowed_layers * per_layer_token
    return {"windowed_storage": True, "context": KV_AT, "window": window, "peak_windowed_blocks": peak,
            "windowed_layers_held_bytes": held, "windowed_layers_full_attention_bytes": full,
            "windowed_layers_window_share_bytes": share, "held_over_window_share": held / share,
            "held_over_full": held / full}


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small workload (a smoke run)")
    ap.add_argument("--models", default="smollm2,gemma3", help="comma-separated: smollm2, gemma3")
    ap.add_argument("--no-kv", dest="kv", action="store_false",
                    help="skip the windowed model's 8k-token KV measurement (a long prefill)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--cache-dir", type=Path, default=Path("~/.cache/rein/bench").expanduser())
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"threads": torch.get_num_threads(), "quick": args.quick, "models": {}}
    for name in args.models.split(","):
        folder = ensure_f32_model(args.cache_dir, MODELS[name])
        hf_model, tokenizer = load_hf(folder)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token_id = tokenizer.eos_token_id
        allowed = allowed_token_ids(tokenizer, hf_model.config.get_text_config().vocab_size)
        wl = make_workload(allowed, args.quick)
        print(f"# {name}: {wl.num_requests} requests, prompts {min(map(len, wl.prompts))}-"
              f"{max(map(len, wl.prompts))} tokens, {min(wl.output_lens)}-{max(wl.output_lens)} output tokens",
              flush=True)
        native = run_engine(folder, "rein", wl)
        native.pop("_engine")
        backend = run_engine(folder, "transformers", wl)
        backend.pop("_engine")
        hf = run_hf_static(hf_model, tokenizer, wl)
        del hf_model
        kv = windowed_kv(folder, allowed) if args.kv else None
        same = native["_tokens"] == backend["_tokens"]
        row = {
            "native_tps": native["tps"], "transformers_tps": backend["tps"], "hf_static_tps": hf["tps"],
            "transformers_over_native": ratio(backend["tps"], native["tps"]),
            "transformers_over_hf_static": ratio(backend["tps"], hf["tps"]),
            "native_over_hf_static": ratio(native["tps"], hf["tps"]),
            "native_and_transformers_tokens_equal": same,
            "load_s": {"native": native["load_s"], "transformers": backend["load_s"]},
            "windowed_kv": kv,
        }
        report["models"][name] = row
        print(f"{name:8s} native {native['tps']:7.1f} tok/s | transformers {backend['tps']:7.1f} tok/s | "
              f"HF static (batch {wl.hf_batch_size}) {hf['tps']:7.1f} tok/s", flush=True)
        print(f"{'':8s} transformers/native {row['transformers_over_native']:.2f} (target >= 0.9) | "
              f"transformers/HF {row['transformers_over_hf_static']:.2f} (>= 2) | "
              f"native/HF {row['native_over_hf_static']:.2f} (>= 2) | same tokens: {same}", flush=True)
        if kv and kv["windowed_storage"]:
            print(f"{'':8s} KV of one {KV_AT}-token request, windowed layers: {kv['windowed_layers_held_bytes']:,} "
                  f"bytes at the peak ({kv['peak_windowed_blocks']} blocks) vs {kv['windowed_layers_full_attention_bytes']:,} "
                  f"with full attention ({kv['held_over_full']:.3f}x) and {kv['windowed_layers_window_share_bytes']:,} for "
                  f"the window itself ({kv['held_over_window_share']:.2f}x)", flush=True)
        elif kv:
            print(f"{'':8s} windowed layers keep every position here: {kv['why']}", flush=True)
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
