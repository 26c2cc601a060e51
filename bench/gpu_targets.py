"""Issue 47's targets measured beside their bounds on one GPU (part of gpu_check: `targets`).

    python bench/gpu_targets.py [--device cuda|cpu] [--hbm-tbps T] [--bf16-tflops F] [--budget S]

An 8B Llama-shaped model (Llama 3.1 8B's shape: hidden 4096, 32 layers, 32 heads, 8 KV heads,
head_dim 128, intermediate 14336, vocab 128256, untied embeddings: 8.03B parameters), all 32
layers, with random bf16 weights made on the device in place: the model directory holds only
config.json and the tiny model's tokenizer, and `random_weights_in_place` stands in for
rein.model.loader.load_model (the native model built on the meta device, given storage on the
device and filled there with N(0, 0.02), norms at 1): no 16 GB file is written or read. One
engine (bf16 weights and KV cache, CUDA graphs, 64 sequences, an 8,192-token step budget) then
measures, each beside its bound:

1. decode at batch 64: the median engine step against the HBM bound, (weight bytes + K/V
   bytes read) / HBM bandwidth, as bench/gpu_decode.py's run_batch (target: >= 75%);
2. prefill of one 8,192-token prompt: the runner's `execute` of that step (synchronized before
   and after; the first run a warm-up that compiles, then the fastest of the rest) against
   the card's dense bf16 matmul peak. FLOPs counted: 2 x the parameters every token meets
   (all but the embedding; the LM head for the last token only) x 8,192, plus causal
   attention's 2 x 2 x heads x head_dim x n(n+1)/2 per layer (QK^T and PV)
   (target: >= 60% of the peak);
3. the GPU's idle share over 16 consecutive batch-64 decode steps (target: <= 5%, see
   `idle_shares`): torch.profiler's CUDA timeline (kernels, copies, sets; CUDA graph replays
   show their kernels), each kernel assigned to the step whose host call launched it.
   * between_steps: the sum over step boundaries of the gap from one step's last GPU
     activity ending to the next step's first starting, over the span from the first step's
     first GPU activity to the last step's last; this is the target's figure.
   * idle: all the time in that span the GPU runs nothing (between and within steps).

The 0.5B shape's decode (target >= 35%) is bench/gpu_decode.py, the `decode` part. Peaks come
from the device's name (`device_peaks`; --hbm-tbps / --bf16-tflops override it). Every
measurement checks the time left first and is skipped with the reason when it would not fit.
With --device cpu (gpu_check's dry run) the same code runs on a tiny Llama shape: figures are
printed, no target is judged, and the idle share is taken from the CPU ops (no GPU timeline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# meta-llama/Llama-3.1-8B's config.json shape.
LLAMA_8B_SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}
CPU_SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 4096}
TARGETS = {"decode_8b_b64_pct_of_hbm_bound": 75.0, "prefill_8k_pct_of_bf16_peak": 60.0,
           "gpu_idle_between_steps_pct": 5.0}
MEASURED_BY = {"decode_8b_b64_pct_of_hbm_bound": "decode", "prefill_8k_pct_of_bf16_peak": "prefill",
               "gpu_idle_between_steps_pct": "idle"}
DECODE_BATCH = 64
PROMPT_LEN = 128
PROFILED_STEPS = 16
# Estimated seconds each measurement needs on an H100 after the engine is up (the prefill's
# first run compiles the prefill kernels); one that would not fit in what is left is skipped.
NEEDS_S = {"decode": 25, "idle": 15, "prefill": 30}


def device_peaks(name: str) -> tuple[float | None, float | None]:
    """(HBM TB/s, dense bf16 matmul TFLOP/s without sparsity) of a card by its name, from
    NVIDIA's data sheets; (None, None) for one not listed."""
    n = name.lower()
    if "h200" in n:
        return 4.8, 989.0
    if "h100" in n and "pcie" in n:
        return 2.0, 756.0
    if "h100" in n and "nvl" in n:
        return 3.9, 835.0
    if "h100" in n:                      # SXM (HBM3)
        return 3.35, 989.0
    if "a100" in n:
        return (2.0 if "80gb" in n else 1.555), 312.0
    return None, None


def sizes(device: str) -> dict:
    if device == "cuda":
        return {"shape": dict(LLAMA_8B_SHAPE), "name": "llama-8b-shape", "dtype": "bfloat16",
                "batch": DECODE_BATCH, "prompt_len": PROMPT_LEN, "warmup_steps": 8, "timed_steps": 30,
                "prefill_tokens": 8192, "prefill_runs": 3, "profiled_steps": PROFILED_STEPS}
    return {"shape": dict(CPU_SHAPE), "name": "llama-tiny-shape", "dtype": "float32",
            "batch": 4, "prompt_len": 16, "warmup_steps": 2, "timed_steps": 4,
            "prefill_tokens": 128, "prefill_runs": 2, "profiled_steps": 3}


def write_config_dir(path: Path, shape: dict, tokenizer_dir: Path, max_positions: int) -> Path:
    """A model directory with no weights: a Llama config.json of `shape` and the tokenizer of
    `tokenizer_dir` (token ids past its vocabulary decode to nothing)."""
    import shutil

    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    config = transformers.LlamaConfig(**{
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "bos_token_id": tiny["bos_token_id"], "eos_token_id": tiny["eos_token_id"],
        "pad_token_id": tiny.get("pad_token_id"), **shape})
    config.architectures = ["LlamaForCausalLM"]
    config.to_json_file(str(path / "config.json"))
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, path / name)
    return path


@contextlib.contextmanager
def random_weights_in_place(seed: int = 0):
    """While open, engines build their model with random weights made on their device instead
    of reading a checkpoint (rein.engine.model_runner's `load_model` replaced)."""
    import rein.engine.model_runner as model_runner
    from rein.model.architectures import native_model_class
    from rein.model.architectures.rope import RotaryEmbedding
    from rein.model.loader import materialize

    def load(files, spec, max_positions, dtype, device, trust_remote_code=False, group=None, quantization="auto"):
        from rein.model.parallel.group import SINGLE_RANK

        with torch.device("meta"):
            model = native_model_class(spec)(spec, max_positions, group or SINGLE_RANK)
        materialize(model, device, dtype)
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.build_table()
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, 0.02, generator=generator)
        model.eval()
        if device.type == "cpu":
            model.pack_cpu_weights()
        return model

    original = model_runner.load_model
    model_runner.load_model = load
    try:
        yield
    finally:
        model_runner.load_model = original


def prefill_flops(spec, tokens: int) -> float:
    """FLOPs of one causal prefill of `tokens` (see the module docstring)."""
    embedding = spec.vocab_size * spec.hidden_size
    body = spec.num_parameters() - embedding * (1 if spec.tie_word_embeddings else 2)
    linear = 2.0 * body * tokens + 2.0 * embedding          # the LM head for the last token only
    attention = 2.0 * 2.0 * spec.num_heads * spec.head_dim * tokens * (tokens + 1) / 2
    return linear + attention * spec.num_layers


def time_prefill(engine, tokens: int, runs: int, seed: int) -> list[float]:
    """Seconds of the runner's execute for each run's prefill step of one `tokens`-long prompt
    (new random tokens each run: no prefix-cache hit)."""
    from rein.engine import SamplingParams

    runner = engine.runner
    execute = runner.execute
    seconds: list[float] = []
    cuda = runner.device.type == "cuda"

    def timed(scheduled):
        if cuda:
            torch.cuda.synchronize(runner.device)
        start = time.perf_counter()
        out = execute(scheduled)
        if cuda:
            torch.cuda.synchronize(runner.device)
        if sum(s.num_new_tokens for s in scheduled) == tokens:
            seconds.append(time.perf_counter() - start)
        return out

    rng = random.Random(seed)
    runner.execute = timed             # an instance attribute shadowing the method; removed below
    try:
        for run in range(runs):
            engine.add_request(f"prefill-{run}", [rng.randrange(10, 2000) for _ in range(tokens)],
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
    finally:
        del runner.execute
    return seconds


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def idle_shares(steps: list[tuple[float, float]], launches: dict, activity: list[tuple[float, float, object]]) -> dict:
    """The GPU's idle shares over consecutive steps (see the module docstring).

    `steps`: each step's host (start, end); `activity`: GPU (start, end, correlation id);
    `launches`: correlation id -> the host time of its launch call. A GPU interval belongs to
    the step whose host range holds its launch (or, with no launch known, its start)."""
    per_step: list[list[tuple[float, float]]] = [[] for _ in steps]
    for start, end, correlation in activity:
        when = launches.get(correlation, start)
        for i, (a, b) in enumerate(steps):
            if a <= when <= b:
                per_step[i].append((start, end))
                break
    busy_steps = [s for s in per_step if s]
    if len(busy_steps) < 2:
        return {"steps_with_gpu_work": len(busy_steps)}
    first = min(a for a, _ in busy_steps[0])
    last = max(b for _, b in busy_steps[-1])
    span = last - first
    busy = sum(b - a for a, b in merged([iv for s in busy_steps for iv in s]))
    gaps = [max(0.0, min(a for a, _ in nxt) - max(b for _, b in cur)) for cur, nxt in zip(busy_steps, busy_steps[1:], strict=False)]
    return {"steps_with_gpu_work": len(busy_steps), "span_us": span, "busy_us": busy,
            "between_steps_pct": 100.0 * sum(gaps) / span, "idle_pct": 100.0 * (1.0 - busy / span),
            "median_gap_us": statistics.median(gaps)}


def profile_idle(engine, batch: int, prompt_len: int, warmup_steps: int, steps: int, seed: int) -> dict:
    """`steps` decode steps of `batch` rows under torch.profiler; their idle shares."""
    from gpu_decode import StepTimer
    from torch.profiler import ProfilerActivity, profile, record_function

    from rein.engine import SamplingParams

    cuda = engine.runner.device.type == "cuda"
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=warmup_steps + steps + 4 + -(-batch * prompt_len // 2048),
                            temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"idle-{i}", [rng.randrange(10, 2000) for _ in range(prompt_len)], params)
    decoded = 0
    with StepTimer(engine) as timer:          # past the prefill: every row decoding
        while decoded < warmup_steps:
            record = timer.step()
            decoded += record is not None and record[0] == batch
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=activities) as prof:
            for _ in range(steps):
                with record_function("gpu_targets.step"):
                    engine.step()
            if cuda:
                torch.cuda.synchronize()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    while engine.has_unfinished():
        engine.step()
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("name") == "gpu_targets.step" and e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation")
    if cuda:
        kinds = ("kernel", "gpu_memcpy", "gpu_memset")
        activity = [(e["ts"], e["ts"] + e["dur"], (e.get("args") or {}).get("correlation"))
                    for e in events if e.get("cat") in kinds and e.get("ph") == "X"]
        launches = {(e.get("args") or {}).get("correlation"): e["ts"] for e in events
                    # cudaLaunchKernel / cudaGraphLaunch, and the driver's cuLaunchKernel (Triton)
                    if e.get("cat") in ("cuda_runtime", "cuda_driver")
                    and (e.get("args") or {}).get("correlation") is not None}
        source = "CUDA kernels, copies and sets"
    else:   # no GPU timeline: the CPU ops below the step stand in, so the code path runs
        activity = [(e["ts"], e["ts"] + e["dur"], None) for e in events
                    if e.get("cat") == "cpu_op" and e.get("ph") == "X"]
        launches = {}
        source = "CPU ops (CPU mode: no GPU timeline; not a GPU figure)"
    shares = idle_shares(spans, launches, activity)
    shares.update(source=source, steps=len(spans), batch=batch, events=len(activity))
    return shares


def targets_check(device: str, models_dir: Path, tokenizer_dir: Path | None = None, hbm_tbps: float | None = None,
                  bf16_tflops: float | None = None, budget_s: float = 170.0, on_partial=None) -> dict:
    """Build the 8B shape in place, measure the three figures; a gpu_check part result."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_decode import run_batch

    from rein.engine import EngineConfig, LLMEngine
    from rein.fixtures.tiny_model import ensure_tiny_model
    from rein.model.spec import ModelSpec

    started = time.perf_counter()

    def left() -> float:
        return budget_s - (time.perf_counter() - started)

    plan = sizes(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    named_hbm, named_tflops = device_peaks(name)
    hbm_tbps = hbm_tbps or named_hbm
    bf16_tflops = bf16_tflops or named_tflops
    tokenizer_dir = tokenizer_dir or ensure_tiny_model(models_dir / "llama", arch="llama")
    prefill_tokens = plan["prefill_tokens"]
    max_model_len = prefill_tokens + 256
    model_dir = write_config_dir(models_dir / plan["name"], plan["shape"], tokenizer_dir, max_model_len)
    spec = ModelSpec.from_dir(model_dir)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[plan["dtype"]]
    kv_per_token = spec.kv_bytes_per_token(dtype)
    batch_tokens = plan["batch"] * (plan["prompt_len"] + 2 * (plan["warmup_steps"] + plan["timed_steps"]) + 64)
    kv_memory = int(1.25 * max(batch_tokens, max_model_len) * kv_per_token) + (1 << 20)
    result: dict = {"model": plan["name"], "parameters": spec.num_parameters(), "layers": spec.num_layers,
                    "dtype": plan["dtype"], "device": name, "hbm_tbps": hbm_tbps, "bf16_tflops": bf16_tflops,
                    "targets": dict(TARGETS), "measured": {}, "skipped": {}}
    if device == "cuda" and (hbm_tbps is None or bf16_tflops is None):
        result["peaks_note"] = f"{name} is not in device_peaks: pass --hbm-tbps / --bf16-tflops"
    load_started = time.perf_counter()
    with random_weights_in_place():
        engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, dtype=plan["dtype"],
                                        kv_cache_memory=kv_memory, max_model_len=max_model_len,
                                        max_num_seqs=plan["batch"], max_num_batched_tokens=prefill_tokens, seed=0))
    result["load_s"] = round(time.perf_counter() - load_started, 1)
    result["cuda_graphs"] = engine.runner.decode_graphs is not None
    print(f"targets: {plan['name']} ({spec.num_parameters() / 1e9:.2f}B parameters, {spec.num_layers} layers, "
          f"{plan['dtype']}, random weights made on {device}) engine up in {result['load_s']} s; "
          f"peaks: HBM {hbm_tbps} TB/s, bf16 {bf16_tflops} TFLOP/s ({name})", flush=True)
    elem = torch.empty((), dtype=engine.runner.dtype).element_size()
    weight_bytes = (spec.num_parameters() - (0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size)) * elem

    def decode(engine) -> None:
        row = run_batch(engine, plan["batch"], plan["prompt_len"], plan["warmup_steps"], plan["timed_steps"],
                        weight_bytes, kv_per_token, hbm_tbps or 1.0, seed=1)
        result["decode"] = row
        result["measured"]["decode_8b_b64_pct_of_hbm_bound"] = 100 * row["ratio"] if hbm_tbps else None
        print(f"targets: decode batch {plan['batch']}: step {row['step_ms']:.3f} ms (execute {row['execute_ms']:.3f}), "
              f"bound {row['bound_ms']:.3f} ms -> {100 * row['ratio']:.1f}% of the HBM bound "
              f"(target >= {TARGETS['decode_8b_b64_pct_of_hbm_bound']:.0f}%)", flush=True)

    def idle(engine) -> None:
        shares = profile_idle(engine, plan["batch"], plan["prompt_len"], plan["warmup_steps"],
                              plan["profiled_steps"], seed=2)
        result["idle"] = shares
        result["measured"]["gpu_idle_between_steps_pct"] = shares.get("between_steps_pct")
        print(f"targets: idle over {shares['steps']} decode steps of {plan['batch']} ({shares['source']}): "
              f"between steps {shares.get('between_steps_pct', float('nan')):.1f}%, all idle "
              f"{shares.get('idle_pct', float('nan')):.1f}% (target between steps <= "
              f"{TARGETS['gpu_idle_between_steps_pct']:.0f}%)", flush=True)

    def prefill(engine) -> None:
        seconds = time_prefill(engine, prefill_tokens, plan["prefill_runs"], seed=3)
        if len(seconds) < 2:
            raise RuntimeError(f"{len(seconds)} prefill steps of {prefill_tokens} tokens were timed, not "
                               f"{plan['prefill_runs']}: the prompt was split across steps")
        best = min(seconds[1:])                  # the first compiled the kernels
        flops = prefill_flops(spec, prefill_tokens)
        tflops = flops / best / 1e12
        result["prefill"] = {"tokens": prefill_tokens, "seconds": seconds, "best_ms": 1e3 * best,
                             "tflop": flops / 1e12, "tflops": tflops}
        result["measured"]["prefill_8k_pct_of_bf16_peak"] = 100 * tflops / bf16_tflops if bf16_tflops else None
        print(f"targets: prefill of {prefill_tokens} tokens: {1e3 * best:.1f} ms, {flops / 1e12:.1f} TFLOP -> "
              f"{tflops:.1f} TFLOP/s" + (f", {100 * tflops / bf16_tflops:.1f}% of {bf16_tflops:g}" if bf16_tflops else "")
              + f" (target >= {TARGETS['prefill_8k_pct_of_bf16_peak']:.0f}%)", flush=True)

    try:
        for what, measure in (("decode", decode), ("idle", idle), ("prefill", prefill)):
            if device == "cuda" and left() < NEEDS_S[what]:
                result["skipped"][what] = f"time budget: {left():.0f} s left, about {NEEDS_S[what]} s needed"
                print(f"targets: {what} skipped ({result['skipped'][what]})", flush=True)
                continue
            try:
                measure(engine)
            except Exception as exc:   # one measurement's error is reported; the others still run
                import traceback

                traceback.print_exc()
                result.setdefault("errors", {})[what] = f"{type(exc).__name__}: {str(exc)[:300]}"
                while engine.has_unfinished():   # what it left behind, finished
                    engine.step()
            if on_partial:
                on_partial(result)
    finally:
        if engine.pool.num_used:
            result["leaked_blocks"] = engine.pool.num_used
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()
    return judge(result, device)


def judge(result: dict, device: str) -> dict:
    """Status and reason: each figure beside its target. A missed target is a FAIL on CUDA
    (the check's figures are what the issue asks to reach); nothing is judged on CPU."""
    rows, missed = [], []
    for key, target in TARGETS.items():
        value = result["measured"].get(key)
        if value is None:
            what = MEASURED_BY[key]
            rows.append(f"{key} not measured" + (f" ({result['skipped'][what]})" if what in result["skipped"] else ""))
            continue
        ok = value <= target if key.startswith("gpu_idle") else value >= target
        rows.append(f"{key} {value:.1f} ({'<=' if key.startswith('gpu_idle') else '>='} {target:g}"
                    + ("" if ok else ", not met") + ")")
        if not ok:
            missed.append(key)
    if result.get("leaked_blocks"):
        rows.append(f"{result['leaked_blocks']} KV blocks leaked")
        missed.append("leaked_blocks")
    for what, error in result.get("errors", {}).items():
        rows.append(f"{what} failed: {error}")
        missed.append(what)
    if device != "cuda":
        broken = result.get("leaked_blocks") or result.get("errors")
        result.update(status="FAIL" if broken else "PASS",
                      reason="CPU mode, tiny Llama shape, targets not judged: " + "; ".join(rows))
    else:
        result.update(status="FAIL" if missed else "PASS", reason="; ".join(rows))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--hbm-tbps", type=float, default=None, help="HBM TB/s (default: from the device's name)")
    parser.add_argument("--bf16-tflops", type=float, default=None, help="dense bf16 TFLOP/s (default: from the name)")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds; measurements that would not fit skip")
    parser.add_argument("--models-dir", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rein-gpu-targets-") as tmp:
        result = targets_check(args.device, Path(args.models_dir or tmp), hbm_tbps=args.hbm_tbps,
                               bf16_tflops=args.bf16_tflops, budget_s=args.budget)
    print(f"{result['status']}: {result['reason']}")
    print(json.dumps(result, default=str))
    return 0 if result["status"] != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
