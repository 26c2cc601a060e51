"""The GPU check: correctness and speed of rein's CUDA path in one run (not a test).

    python bench/gpu_check.py [--device auto|cuda|cpu] [--parts a,b,...] [--budget SECONDS]
                              [--hbm-tbps T] [--bf16-tflops F] [--json PATH] [--models-dir DIR]

`bench/gpu_check.sh` sets up the Python environment of a fresh GPU machine and runs this.
Each part runs in a subprocess of its own with a timeout, prints PASS, FAIL or SKIP with a
reason, and the run goes on after a failure. Parts, in the order they run:

* cuda_tests: the CUDA tests of the suite, in the background while the check parts run
  (they only check, never time; with pytest-xdist, XDIST_WORKERS at once): every test of a
  tests/ file that calls `torch.cuda.is_available()` (the suite's marker of CUDA-only code:
  tests/kernels run their Triton kernels on CUDA, or under TRITON_INTERPRET without one) that
  lives in tests/kernels or carries a skipif whose reason names a GPU (tests/unit: CUDA-graph
  replay, n > 1 forks under graphs, windowed storage under graphs). Selected by this module's
  `pytest_collection_modifyitems` (loaded with `-p gpu_check`). Its result gives each CUDA
  path of PATH_TESTS (sliding-window kernels, fused MoE, quantized matmul incl. the packed
  Q5/Q6 kernel and AWQ/GPTQ, grouped quantized MoE, LoRA, windowed CUDA-graph buffers, ...)
  its own outcome counts; a path whose test file is not selected is a FAIL.
* bitmask: the structured-output token-bitmask Triton kernel against the torch
  implementation (vocabularies of SmolLM2, Qwen2, Gemma 3), its time per call, and a
  `choice`-constrained request through the engine beside unconstrained ones.
* cuda_paths: end to end, the CUDA engine's greedy tokens against a reference engine's for
  tiny GGUF models (Q5_K, Q6_K, Q4_K; a MoE with Q4_0 experts: against the file dequantized),
  a windowed Gemma 3, the Gemma 3 vision model with images (also in bf16), a LoRA adapter on
  the tiny Llama and the tiny Llama in int4 at load (against the CPU engine): bench/gpu_paths.py.
* n_choices_graphs: n > 1 requests (seeded sampling and greedy), with prompt logprobs,
  beside a plain one: the engine replaying CUDA graphs gives the tokens of an
  enforce_eager engine, decode steps did replay, each n > 1 prompt was prefilled once,
  greedy choices agree, no leak. (CPU: the same static padded buffers, run eagerly.)
* greedy_tiny: per architecture of rein.fixtures.tiny_model (dense and MoE: the fused MoE
  kernel), the engine's greedy tokens in fp32 (Triton path on CUDA) equal Hugging Face
  generate(), also with a 16-token step budget (chunked prefill) and for prompts sharing their
  first blocks (prefix caching, with hits); bf16 and the int8 KV cache run end to end (their
  token agreement with fp32 HF is reported); no KV block leaks. Architectures that would not
  fit in its time are listed as not run.
* tensor_parallel: two ranks over NCCL == one rank, and a killed rank fails the step naming
  it; SKIP (with the reason) on a machine with one CUDA device (bench/gpu_paths.py).
* real_models: SmolLM2-135M-Instruct and Gemma 3 270M (GGUF, `rein fetch-model [gemma3-270m]`)
  when their files are in the cache: engine greedy (fp32, GGUF blocks kept quantized) ==
  HF generate() (fp32, from the same GGUF) on a few prompts; a difference where HF's own
  top-2 margin is under --near-tie counts as a near-tie, not a failure. Never fetches. (CPU
  mode: the first model found, two prompts.)

Then the timed parts (TIMED_PARTS), alone on the device; each keeps TIMED_RESERVE seconds
free for itself while the parts before it run:

* targets: issue 47's targets beside their bounds on an 8B Llama shape built in place on the
  device (bench/gpu_targets.py): batch-64 decode against the HBM bound (>= 75%), an 8,192-token
  prefill against the bf16 matmul peak (>= 60%), the GPU's idle share between decode steps
  (<= 5%). A missed target is a FAIL.
* decode: engine tokens/s on a Qwen2-0.5B-shaped random model at decode batches 64 and 256
  against the HBM bound (bench/gpu_decode.py; target: batch 64 at >= 35%), and the GPU's idle
  share between its batch-64 decode steps beside it (as targets measures it; not judged).
* attention_kernels: `bench/attention_kernels.py --quick --no-engine` (paged decode /
  prefill / int8 / store kernel micro-benchmarks), its figures summarized.
* kernel_compare: each entry of KERNEL_COMPARISONS, a rein kernel against what it replaces in
  one process (now: the fused element-wise kernels against torch ops in the 0.5B decode
  step); runs only in the time left over. A new kernel's comparison is a function added there.

The HBM bandwidth and bf16 peak come from the device's name (gpu_targets.device_peaks), or
--hbm-tbps / --bf16-tflops.

CPU mode (`--device cpu` or REIN_GPU_CHECK_DEVICE=cpu, and what `auto` picks without CUDA):
the same code on tiny shapes, so the check is known to work before a GPU runs it:
cuda_tests collects the selection only, bitmask runs the Triton kernel under the
interpreter, cuda_paths runs its tiny cases with the CPU engine on both sides, targets,
decode and kernel_compare run tiny shapes (not judged); attention_kernels, tensor_parallel
and real models (when absent) skip.

The summary is printed last (one line per part, then one JSON object) and written to
--json, and to $OUT/gpu_check.json when $OUT is set. Exit status 1 when a part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PARTS = ("cuda_tests", "bitmask", "cuda_paths", "n_choices_graphs", "greedy_tiny", "tensor_parallel", "real_models",
         "targets", "decode", "attention_kernels", "kernel_compare")
BACKGROUND = "cuda_tests"
# The timed parts run last, alone on the device, in this order.
TIMED_PARTS = ("targets", "decode", "attention_kernels", "kernel_compare")
# Seconds each part may take on CUDA (its timeout); on CPU the tiny shapes need far less.
TIMEOUTS = {"cuda_tests": 300, "bitmask": 60, "cuda_paths": 130, "n_choices_graphs": 60, "greedy_tiny": 120,
            "tensor_parallel": 90, "real_models": 150, "targets": 170, "decode": 90, "attention_kernels": 90,
            "kernel_compare": 120}
CPU_TIMEOUTS = {"cuda_tests": 60, "bitmask": 60, "cuda_paths": 150, "n_choices_graphs": 60, "greedy_tiny": 120,
                "tensor_parallel": 30, "real_models": 120, "targets": 60, "decode": 60, "attention_kernels": 60,
                "kernel_compare": 60}
# Seconds kept for each timed part while the parts before it run: estimates for an H100 (the
# H200 ran decode and attention_kernels in 37 s together, 2026-12-04; targets loads an 8B
# shape, captures its graphs and compiles the 8k prefill). kernel_compare runs only in what is
# left over.
TIMED_RESERVE = {"targets": 130, "decode": 45, "attention_kernels": 40, "kernel_compare": 0}
CPU_TIMED_RESERVE = {"targets": 30, "decode": 20, "attention_kernels": 5, "kernel_compare": 20}
# The CUDA paths of issue 47 and the test files that run them on the device (cuda_tests
# reports each path's outcomes; a file missing from the selection is a FAIL).
PATH_TESTS = {
    "sliding-window attention kernels (Gemma 3 windows)": "tests/kernels/test_sliding_window.py",
    "fused MoE kernel": "tests/kernels/test_triton_moe.py",
    "quantized-weight matmul (GGUF, AWQ/GPTQ 4-bit, packed Q5/Q6)": "tests/kernels/test_triton_quantized.py",
    "grouped quantized MoE kernel": "tests/kernels/test_triton_quantized_moe.py",
    "LoRA kernels (and under CUDA graphs)": "tests/kernels/test_triton_lora.py",
    "paged attention / store / prefill kernels": "tests/kernels/test_triton_kernels.py",
    "fused element-wise kernels": "tests/kernels/test_triton_elementwise.py",
    "rotary fused with the K/V store": "tests/kernels/test_triton_rotary_store.py",
    "small-row split-K GEMM (and SiLU-and-mul folded into it)": "tests/kernels/test_triton_small_gemm.py",
    "windowed storage under CUDA graphs": "tests/unit/test_windowed_kv_engine.py",
    "CUDA graph replay": "tests/unit/test_cuda_graphs.py",
}
XDIST_WORKERS = 4   # cuda_tests on CUDA with pytest-xdist when installed: Triton compiles on many cores
MIN_PART_S = 15          # a part is not started with less time than this left
DEFAULT_BUDGET = 450     # under the 8-minute device call, after gpu_check.sh's setup
DEFAULT_HBM_TBPS = 4.8   # when the device's name is not in gpu_targets.device_peaks (an H200's)
DENSE_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
REAL_MODELS = ("smollm2-135m-instruct", "gemma3-270m")
REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "SELECT name, email FROM users WHERE",
    "Water boils at a temperature of",
]


# --------------------------------------------------------------------------- helpers


def cuda_mode(ctx: dict) -> bool:
    return ctx["device"] == "cuda"


def tiny_model(ctx: dict, arch: str) -> Path:
    """The tiny `arch` model, built once into the run's models dir (parts share it)."""
    from rein.fixtures.tiny_model import ensure_tiny_model

    return ensure_tiny_model(Path(ctx["models_dir"]) / arch, arch=arch)


def greedy_archs(cuda: bool) -> tuple[str, ...]:
    """The architectures greedy_tiny checks; REIN_GPU_CHECK_ARCHS (comma-separated) narrows
    them, e.g. to rerun the MoE ones alone."""
    archs = DENSE_ARCHS + MOE_ARCHS if cuda else ("llama",)
    chosen = os.environ.get("REIN_GPU_CHECK_ARCHS")
    return tuple(a for a in archs if a in chosen.split(",")) if chosen else archs


def prepare_models(ctx: dict) -> None:
    """Build the tiny models the parts use, in one process: the tokenizer they share is
    trained once (a part building its own would train it again, ~6 s)."""
    started = time.perf_counter()
    try:
        from rein.fixtures.tiny_model import ensure_tiny_model

        for arch in dict.fromkeys(greedy_archs(cuda_mode(ctx)) + ("llama", "qwen2")):
            ensure_tiny_model(Path(ctx["models_dir"]) / arch, arch=arch)
    except Exception as exc:   # the parts build what they need themselves (and fail there if they must)
        print(f"gpu_check: building the tiny models failed ({type(exc).__name__}: {exc}); the parts will try", flush=True)
        return
    print(f"gpu_check: tiny models built in {time.perf_counter() - started:.1f} s", flush=True)


def drain(engine) -> dict:
    """Step until idle; per (request id, choice index): tokens, text, finish reason."""
    results: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault((out.request_id, out.index), {"tokens": [], "text": "", "finish": None})
            r["tokens"].extend(out.new_token_ids)
            r["text"] += out.text_delta
            if out.finish_reason is not None:
                r["finish"] = out.finish_reason
    return results


def result(status: str, reason: str, **details) -> dict:
    return {"status": status, "reason": reason, **details}


def save_partial(ctx: dict, data: dict) -> None:
    """What a part has found so far: the driver reports it if the part runs out of time."""
    if ctx.get("partial"):
        Path(ctx["partial"]).write_text(json.dumps(data, default=str))


def time_left(ctx: dict) -> float:
    return ctx["timeout"] - (time.perf_counter() - ctx["started"])


# --------------------------------------------------------------------------- parts


def part_cuda_tests(ctx: dict) -> dict:
    """The suite's CUDA tests (see the module docstring); CPU mode only collects them."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return result("SKIP", "pytest is not installed in this Python")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if not p.name.startswith("test_gpu_check_") and "cuda.is_available" in p.read_text(errors="replace"))
    if not files:
        return result("FAIL", "no test file under tests/ calls torch.cuda.is_available(): the selection is stale")
    missing = [f"{path} ({label})" for label, path in PATH_TESTS.items() if path not in files]
    if missing:
        return result("FAIL", f"the CUDA paths' test files are not in the selection: {', '.join(missing)}", files=files)
    work = Path(tempfile.mkdtemp(prefix="rein-gpu-check-pytest-"))
    selected, junit = work / "selected.txt", work / "junit.xml"
    env = dict(os.environ, REIN_GPU_CHECK_SELECT=str(selected),
               PYTHONPATH=os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    command = [sys.executable, "-m", "pytest", "-v", "-p", "gpu_check", "-p", "no:cacheprovider",
               "-rfEs", "--durations=8", f"--junitxml={junit}", *files]
    if not cuda_mode(ctx):
        command[command.index("-v")] = "-q"   # node ids, not the verbose tree
        command.append("--collect-only")
    elif importlib.util.find_spec("xdist") is not None:
        command[3:3] = ["-n", str(XDIST_WORKERS)]   # right after "-m pytest"
    print("cuda_tests: " + " ".join(command[1:]), flush=True)
    started = time.perf_counter()
    limit = max(10, ctx["timeout"] - 15)
    outcomes: dict[str, int] = {}
    by_file: dict[str, dict[str, int]] = {}
    failed: list[str] = []
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:   # echo, and count the -v outcome lines (what is known if pytest must be stopped)
        for line in proc.stdout:
            print(line, end="", flush=True)
            node, outcome = outcome_of(line)
            if node:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
                counts = by_file.setdefault(node.split("::")[0], {})
                counts[outcome] = counts.get(outcome, 0) + 1
                if outcome in ("FAILED", "ERROR"):
                    failed.append(node)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(timeout=5)
        done = ", ".join(f"{n} {k.lower()}" for k, n in sorted(outcomes.items())) or "no test finished"
        return result("FAIL", f"pytest ran past {limit:.0f} s and was stopped ({done} by then"
                      + (f"; failed: {', '.join(failed[:5])}" if failed else "") + ")", outcomes=outcomes, failed=failed,
                      paths=path_outcomes(by_file))
    reader.join(timeout=5)
    seconds = time.perf_counter() - started
    ids = selected.read_text().split("\n") if selected.is_file() and selected.read_text() else []
    details = {"files": files, "selected": len(ids), "pytest_rc": proc.returncode, "seconds": round(seconds, 1)}
    if not cuda_mode(ctx):   # what the device would run, per path
        by_file = {}
        for node in ids:
            counts = by_file.setdefault(node.split("::")[0], {})
            counts["SELECTED"] = counts.get("SELECTED", 0) + 1
    details["paths"] = path_outcomes(by_file)
    unselected = [label for label, row in details["paths"].items() if not row]
    if unselected and not cuda_mode(ctx):
        return result("FAIL", f"no test of {', '.join(unselected)} was selected", **details)
    if not ids:
        return result("FAIL", f"no CUDA test was selected from {len(files)} files (pytest rc {proc.returncode})", **details)
    if not cuda_mode(ctx):
        if proc.returncode != 0:
            return result("FAIL", f"collecting the {len(ids)} CUDA tests failed (pytest rc {proc.returncode})", **details)
        return result("PASS", f"collected {len(ids)} CUDA tests from {len(files)} files (CPU mode: collect only; "
                      "on CPU the suite runs the kernel tests under the Triton interpreter)", **details)
    counts = junit_counts(junit)
    details.update(counts)
    summary = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('errors', 0)} errors, "
               f"{counts.get('skipped', 0)} skipped of {len(ids)} selected in {seconds:.0f} s")
    details["failed_tests"] = failed
    if failed:
        summary += f"; failed: {', '.join(failed[:5])}" + (f" and {len(failed) - 5} more" if len(failed) > 5 else "")
    bad = [label for label, row in details["paths"].items() if row.get("FAILED") or row.get("ERROR")]
    unpassed = [label for label, row in details["paths"].items() if not row.get("PASSED")]   # all skipped
    summary += (f"; paths failing: {', '.join(bad)}" if bad else
                f"; paths with no test passed: {', '.join(unpassed)}" if unpassed else
                f"; all {len(details['paths'])} named CUDA paths passed")
    ok = (proc.returncode == 0 and counts.get("failed", 0) == 0 and counts.get("errors", 0) == 0
          and counts.get("passed", 0) > 0 and not unpassed)
    return result("PASS" if ok else "FAIL", summary + ("" if ok else f" (pytest rc {proc.returncode})"), **details)


def outcome_of(line: str) -> tuple[str | None, str | None]:
    """(node id, outcome) of a pytest -v line, plain ("node PASSED") or from an xdist worker
    ("[gw0] [ 12%] PASSED node"); (None, None) for any other line."""
    match = re.match(r"(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b", line)
    if match:
        return match.group(1), match.group(2)
    match = re.match(r"\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+::\S+)", line)
    if match:
        return match.group(2), match.group(1)
    return None, None


def path_outcomes(by_file: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """PATH_TESTS' labels -> their test file's outcome counts (empty: none seen)."""
    return {label: by_file.get(path, {}) for label, path in PATH_TESTS.items()}


def junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) for s in suites)
    errors = sum(int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {"tests": tests, "failed": failed, "errors": errors, "skipped": skipped,
            "passed": tests - failed - errors - skipped}


def part_bitmask(ctx: dict) -> dict:
    """The Triton bitmask kernel against the torch implementation, its time, and the engine."""
    import torch

    from rein.engine.structured import kernels
    from rein.engine.structured.kernels import apply_token_bitmask, apply_token_bitmask_torch

    cuda = cuda_mode(ctx)
    if cuda and not kernels._triton_available():
        return result("FAIL", "triton is not importable: the CUDA bitmask path would fall back to torch")
    try:
        from rein.engine.structured.triton_bitmask import apply_token_bitmask_triton
    except ImportError as exc:
        return result("SKIP", f"triton is not importable ({exc})")

    device = "cuda" if cuda else "cpu"
    # (batch, vocab, constrained rows, words, dtype): words * 32 may fall short of the vocab.
    cases = [(3, 70, 2, 3, torch.float32), (2, 1500, 2, 47, torch.float32), (4, 100, 3, 3, torch.float16)]
    if cuda:
        cases += [(64, 49152, 48, 1536, torch.bfloat16),       # SmolLM2's vocabulary
                  (256, 151936, 256, 4748, torch.float32),     # Qwen2's, every row
                  (32, 262144, 7, 8192, torch.bfloat16),       # Gemma 3's
                  (8, 151936, 5, 4700, torch.float32)]         # the mask short of the vocabulary
    mismatches, checked = [], []
    for batch, vocab, rows_n, words, dtype in cases:
        g = torch.Generator().manual_seed(batch * vocab)
        logits = torch.randn(batch, vocab, generator=g).to(dtype)
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows_n, words), dtype=torch.int32, generator=g)
        rows = sorted(torch.randperm(batch, generator=g)[:rows_n].tolist())
        expected = logits.clone()
        apply_token_bitmask_torch(expected, bitmask, rows)
        got = logits.to(device)
        if cuda:
            apply_token_bitmask(got, bitmask.to(device), rows)   # the dispatch: Triton on CUDA
        else:
            apply_token_bitmask_triton(got, bitmask, rows)        # the kernel, interpreted
        ok = torch.equal(got.cpu(), expected)
        checked.append(f"{batch}x{vocab} {str(dtype).removeprefix('torch.')}")
        if not ok:
            mismatches.append(checked[-1])
    details: dict = {"cases": checked}
    if cuda:
        logits = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16)
        bitmask = torch.randint(-2**31, 2**31 - 1, (64, 4748), dtype=torch.int32, device="cuda")
        rows = list(range(64))
        for _ in range(3):
            apply_token_bitmask(logits, bitmask, rows)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
        for start, end in pairs:
            start.record()
            apply_token_bitmask(logits, bitmask, rows)
            end.record()
        torch.cuda.synchronize()
        details["us_64x151936_bf16"] = sorted(s.elapsed_time(e) for s, e in pairs)[len(pairs) // 2] * 1e3
    # Through the engine: a choice-constrained greedy request beside unconstrained ones.
    engine_note = ""
    try:
        import llguidance  # noqa: F401
    except ImportError as exc:
        engine_note = f"; engine request skipped: llguidance not installed ({exc})"
    else:
        from rein.engine import EngineConfig, LLMEngine, SamplingParams

        engine = LLMEngine(EngineConfig(model=str(tiny_model(ctx, "llama")), device=device, dtype="float32",
                                        kv_cache_memory="32MiB", max_model_len=256, max_num_seqs=8))
        choices = ["alpha", "beta gamma", "delta"]
        engine.add_request("free-0", [11, 12, 13], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        engine.add_request("choice", "Pick one:", SamplingParams(
            max_tokens=16, temperature=0, structured={"type": "choice", "choices": choices}))
        engine.add_request("free-1", [21, 22], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        out = drain(engine)
        got_text, finish = out[("choice", 0)]["text"], out[("choice", 0)]["finish"]
        details.update(engine_choice_text=got_text, engine_choice_finish=finish)
        if got_text not in choices or finish != "stop" or engine.pool.num_used:
            mismatches.append(f"engine choice request gave {got_text!r} (finish {finish}, "
                              f"{engine.pool.num_used} blocks left)")
        engine_note = f"; engine choice request -> {got_text!r}"
    where = "Triton on CUDA" if cuda else "Triton interpreter on CPU"
    timing = f", {details['us_64x151936_bf16']:.1f} us for 64x151936 bf16" if "us_64x151936_bf16" in details else ""
    if mismatches:
        return result("FAIL", f"{where}: wrong on {'; '.join(mismatches)}", **details)
    return result("PASS", f"{where} == torch on {len(cases)} cases{timing}{engine_note}", **details)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def run_engine(model_dir: Path, prompts: list[list[int]], device: str, max_tokens: int, **config):
    """Greedy tokens of `prompts`, added a few at a time (later ones meet earlier ones' blocks)."""
    from rein.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), device=device, kv_cache_memory="64MiB",
                                    max_model_len=512, max_num_seqs=16, **config))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        if i % 3 == 2:
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))], engine


def agreement(got: list[list[int]], expected: list[list[int]]) -> float:
    pairs = [(x, y) for a, b in zip(got, expected, strict=True) for x, y in zip(a, b, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def part_greedy_tiny(ctx: dict) -> dict:
    cuda = cuda_mode(ctx)
    device = ctx["device"]
    archs = greedy_archs(cuda)
    max_tokens = 12 if cuda else 6
    lengths = (1, 5, 17, 33, 64, 100, 130, 9) if cuda else (1, 17, 45, 9)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in lengths]
    donor = next(p for p in prompts if len(p) >= 40)
    shared = [donor[:40] + p for p in prompts]   # two full blocks in common
    rows: dict = {}
    failures: list[str] = []
    not_run: list[str] = []
    per_arch = 0.0
    for arch in archs:
        if rows and time_left(ctx) < 1.5 * per_arch + 10:   # would not finish: say so instead of timing out
            not_run.append(arch)
            continue
        started = time.perf_counter()
        model_dir = tiny_model(ctx, arch)
        expected = hf_greedy(model_dir, prompts, max_tokens)
        row: dict = {}
        got, engine = run_engine(model_dir, prompts, device, max_tokens, dtype="float32")
        row["fp32_identical"] = sum(a == b for a, b in zip(got, expected, strict=True))
        row["fp32_leaked_blocks"] = engine.pool.num_used
        chunked, _ = run_engine(model_dir, prompts, device, max_tokens, dtype="float32", max_num_batched_tokens=16)
        row["chunked_identical"] = sum(a == b for a, b in zip(chunked, expected, strict=True))
        if arch in DENSE_ARCHS and (cuda or arch == "llama"):
            bf16, _ = run_engine(model_dir, prompts, device, max_tokens, dtype="bfloat16")
            row["bf16_agreement"] = round(agreement(bf16, expected), 3)
            int8, engine = run_engine(model_dir, prompts, device, max_tokens, dtype="float32", kv_cache_dtype="int8")
            row["int8_agreement"] = round(agreement(int8, expected), 3)
            row["int8_leaked_blocks"] = engine.pool.num_used
        shared_expected = hf_greedy(model_dir, shared, max_tokens)
        got, engine = run_engine(model_dir, shared, device, max_tokens, dtype="float32")
        row["prefix_identical"] = sum(a == b for a, b in zip(got, shared_expected, strict=True))
        row["prefix_cache_hit_tokens"] = engine.stats.prefix_cache_hits
        row["prefix_leaked_blocks"] = engine.pool.num_used
        row["seconds"] = round(time.perf_counter() - started, 1)
        n = len(prompts)
        bad = [k for k, want in (("fp32_identical", n), ("chunked_identical", n), ("prefix_identical", n))
               if row[k] != want]
        bad += [k for k in ("fp32_leaked_blocks", "int8_leaked_blocks", "prefix_leaked_blocks") if row.get(k)]
        if row["prefix_cache_hit_tokens"] <= 0:
            bad.append("prefix_cache_hit_tokens")
        if bad:
            failures.append(f"{arch}: {', '.join(f'{k}={row[k]}' for k in bad)}")
        rows[arch] = row
        # The last architecture's time, not the longest: the first one compiles the Triton
        # kernels (on the H200: 35 s, then 7-22 s each; the MoE ones, run alone, 31 s then 1-7 s).
        per_arch = row["seconds"]
        save_partial(ctx, {"archs": rows, "failures": failures})
        print(f"greedy_tiny: {arch:10s} {row}", flush=True)
    path = "the Triton path on CUDA" if cuda else "the CPU reference path"
    note = f"; not run for lack of time: {', '.join(not_run)}" if not_run else ""
    if failures:
        return result("FAIL", f"{path}: {'; '.join(failures)} (of {len(prompts)} prompts){note}",
                      archs=rows, not_run=not_run)
    low = [f"{a} bf16 {r['bf16_agreement']:.2f}" for a, r in rows.items() if r.get("bf16_agreement", 1) < 0.75]
    return result("PASS", f"{path}: fp32 greedy == HF for {len(prompts)} prompts x {len(rows)} archs "
                  f"({', '.join(rows)}), chunked and prefix-cached too; no leaks"
                  + (f"; low bf16 agreement: {', '.join(low)}" if low else "") + note, archs=rows, not_run=not_run)


def choices_workload(engine) -> tuple[dict, int]:
    """n > 1 (sampled, greedy, with prompt logprobs) beside a plain request; (results, prompt tokens)."""
    from rein.engine import SamplingParams

    rng = random.Random(5)
    prompts = {name: [rng.randrange(10, 2000) for _ in range(n)]
               for name, n in (("lead", 6), ("s4", 21), ("g3", 32), ("s2", 40))}
    engine.add_request("lead", prompts["lead"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    engine.add_request("s4", prompts["s4"], SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=8,
                                                           ignore_eos=True, prompt_logprobs=2))
    engine.add_request("g3", prompts["g3"], SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))
    engine.add_request("s2", prompts["s2"], SamplingParams(n=2, max_tokens=20, temperature=0.8, top_p=0.9,
                                                           seed=3, ignore_eos=True, logprobs=2))
    return drain(engine), sum(map(len, prompts.values()))


def n_choices_for_arch(ctx: dict, arch: str) -> dict:
    """One arch of part_n_choices_graphs: its figures and the problems found."""
    from rein.engine import EngineConfig, LLMEngine
    from rein.engine.cuda_graphs import DecodeGraphs

    cuda = cuda_mode(ctx)
    model_dir = tiny_model(ctx, arch)

    def make(**extra):
        return LLMEngine(EngineConfig(model=str(model_dir), device=ctx["device"], dtype="float32",
                                      kv_cache_memory="16MiB", max_model_len=256, max_num_seqs=16, **extra))

    expected, _ = choices_workload(make(enforce_eager=True))
    engine = make()
    runner = engine.runner
    graphs = runner.decode_graphs
    if cuda:
        if graphs is None or not graphs.captured:
            return {"problems": ["the CUDA engine captured no decode graphs"]}
    else:   # CPU: the same static padded buffers, run eagerly (what the graphs replay)
        graphs = runner.decode_graphs = DecodeGraphs(
            runner.model, runner.caches, max_num_seqs=16,
            max_blocks_per_seq=-(-runner.max_model_len // runner.block_size), device=runner.device, capture=False)
    calls: list[int] = []
    plain_run = graphs.run
    graphs.run = lambda input_ids, *args: (calls.append(len(input_ids)), plain_run(input_ids, *args))[1]
    got, prompt_tokens = choices_workload(engine)
    problems = []
    if got != expected:
        differ = sorted(f"{k[0]}#{k[1]}" for k in set(got) | set(expected) if got.get(k) != expected.get(k))
        problems.append(f"tokens differ from the eager engine's for {', '.join(differ)}")
    if not calls:
        problems.append("no decode step went through the graphs")
    if engine.stats.prompt_tokens != prompt_tokens:
        problems.append(f"{engine.stats.prompt_tokens} prompt tokens computed, not {prompt_tokens} (one prefill each)")
    if len({tuple(got.get(("g3", i), {}).get("tokens", ())) for i in range(3)}) != 1:
        problems.append("the greedy n=3 choices differ")
    if len({tuple(got.get(("s4", i), {}).get("tokens", ())) for i in range(4)}) != 4:
        problems.append("the seeded n=4 choices are not all different")
    if len(got) != 1 + 4 + 3 + 2:
        problems.append(f"{len(got)} choices came back, not 10")
    if engine.pool.num_used:
        problems.append(f"{engine.pool.num_used} KV blocks leaked")
    return {"replayed_steps": len(calls), "batch_sizes": sorted(set(calls)),
            "graph_sizes": sorted(graphs.graphs) if cuda else [], "problems": problems}


def part_n_choices_graphs(ctx: dict) -> dict:
    cuda = cuda_mode(ctx)
    details = {arch: n_choices_for_arch(ctx, arch) for arch in (("llama", "qwen2") if cuda else ("llama",))}
    failures = [f"{arch}: {'; '.join(d['problems'])}" for arch, d in details.items() if d["problems"]]
    if failures:
        return result("FAIL", "; ".join(failures), archs=details)
    how = "CUDA graph replays" if cuda else "the static padded decode path (CPU: no graphs, run eagerly)"
    steps = ", ".join(f"{a}: {d['replayed_steps']} steps" for a, d in details.items())
    return result("PASS", f"n=4/3/2 choices + a plain request through {how} ({steps}) == enforce_eager; "
                  "one prefill per request, no leaks", archs=details)


def cached_model_path(name: str) -> tuple[Path | None, list[str]]:
    """Where `rein fetch-model NAME` put the file, without fetching; (path or None, places looked)."""
    from rein.fixtures.packaged_models import default_models_dir, installed_path, packaged_model

    model = packaged_model(name)
    found = installed_path(model)
    if found is not None:
        return found, [str(found)]
    path = default_models_dir() / f"{model.package}-{model.version}" / model.path_in_package
    return (path if path.is_file() else None), [f"the {model.package} package", str(path)]


def part_real_models(ctx: dict) -> dict:
    found = {name: cached_model_path(name) for name in REAL_MODELS}
    present = {name: path for name, (path, _) in found.items() if path is not None}
    absent = "; ".join(f"{name} not found ({' or '.join(where)})" for name, (path, where) in found.items() if path is None)
    if not present:
        return result("SKIP", f"{absent}: run `rein fetch-model` / `rein fetch-model gemma3-270m` where the package "
                      "index is reachable (or set REIN_CACHE_DIR to a cache that holds them)")
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        return result("SKIP", f"the gguf package is not installed, so HF cannot read the GGUF files ({exc})")
    rows, failures = {}, []
    if not cuda_mode(ctx):   # the dry run: the first model on two prompts shows the code works
        present = dict(list(present.items())[:1])
    for name, path in present.items():
        rows[name] = row = real_model_check(ctx, path, max_tokens=24 if cuda_mode(ctx) else 8)
        print(f"real_models: {name}: {row}", flush=True)
        if row["diverged"]:
            failures.append(f"{name}: {row['diverged']} of {row['prompts']} prompts diverge from HF above a "
                            f"{ctx['near_tie']:g} margin")
    summary = "; ".join(f"{n}: {r['identical']}/{r['prompts']} identical, {r['near_ties']} near-ties" for n, r in rows.items())
    if absent:
        summary += f" ({absent})"
    return result("FAIL" if failures else "PASS", ("; ".join(failures) + " — " if failures else "") + summary, models=rows)


def real_model_check(ctx: dict, gguf_path: Path, max_tokens: int) -> dict:
    import functools

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from rein.engine import EngineConfig, LLMEngine, SamplingParams

    device = ctx["device"]
    started = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(gguf_path), device=device, dtype="float32", max_model_len=1024,
                                    kv_cache_memory="256MiB", max_num_seqs=16))
    tokenizer = engine.tokenizer
    prompts = [tokenizer(text).input_ids for text in (REAL_PROMPTS if cuda_mode(ctx) else REAL_PROMPTS[:2])]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    got = drain(engine)
    mine = [got[(f"p{i}", 0)]["tokens"] for i in range(len(prompts))]
    engine_s = time.perf_counter() - started
    del engine
    # transformers asks gguf for the same tensor-name map once per module; memoized for the load.
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32).to(device).eval()
    finally:
        gguf.get_tensor_name_map = original
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    pad = model.generation_config.pad_token_id
    pad = min(eos) if pad is None else pad
    identical = near_ties = diverged = 0
    margins = []
    with torch.no_grad():
        for prompt, tokens in zip(prompts, mine, strict=True):
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, num_beams=1, pad_token_id=pad)[0, len(prompt):].tolist()
            ref = out[:next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]
            if ref == tokens:
                identical += 1
                continue
            k = next((i for i, (a, b) in enumerate(zip(ref, tokens, strict=False)) if a != b), min(len(ref), len(tokens)))
            if k >= len(ref):   # rein went on past HF's end (or the reverse): no token to compare
                diverged += 1
                margins.append(None)
                continue
            logits = model(torch.tensor([prompt + ref[:k + 1]], device=device)).logits[0, len(prompt) - 1 + k].float()
            top2 = torch.topk(logits, 2).values
            margin = float(top2[0] - top2[1])
            margins.append(round(margin, 6))
            if margin < ctx["near_tie"]:
                near_ties += 1
            else:
                diverged += 1
    return {"prompts": len(prompts), "identical": identical, "near_ties": near_ties, "diverged": diverged,
            "divergence_margins": margins, "engine_s": round(engine_s, 1),
            "seconds": round(time.perf_counter() - started, 1)}


def part_decode(ctx: dict) -> dict:
    sys.path.insert(0, str(BENCH))
    from gpu_decode import decode_check

    return decode_check(ctx["device"], ctx["hbm_tbps"], Path(ctx["models_dir"]),
                        tokenizer_dir=tiny_model(ctx, "qwen2"), on_batch=lambda done: save_partial(ctx, done),
                        idle_steps=16 if cuda_mode(ctx) else 3)


def part_cuda_paths(ctx: dict) -> dict:
    sys.path.insert(0, str(BENCH))
    from gpu_paths import paths_check

    return paths_check(ctx["device"], Path(ctx["models_dir"]), ctx["near_tie"], lambda: time_left(ctx),
                       on_case=lambda done: save_partial(ctx, done))


def part_tensor_parallel(ctx: dict) -> dict:
    sys.path.insert(0, str(BENCH))
    from gpu_paths import tensor_parallel_check

    return tensor_parallel_check(ctx["device"], tiny_model(ctx, "llama"))


def part_targets(ctx: dict) -> dict:
    sys.path.insert(0, str(BENCH))
    from gpu_targets import targets_check

    return targets_check(ctx["device"], Path(ctx["models_dir"]), tokenizer_dir=tiny_model(ctx, "llama"),
                         hbm_tbps=ctx["hbm_tbps"], bf16_tflops=ctx.get("bf16_tflops"),
                         budget_s=time_left(ctx) - 10, on_partial=lambda done: save_partial(ctx, done))


def part_kernel_compare(ctx: dict) -> dict:
    """Each of KERNEL_COMPARISONS: the same measurement with rein's kernel and with what it
    replaces, side by side in this one process; figures, not judged (a crash FAILs)."""
    rows, failures, not_run = {}, [], []
    for name, compare in KERNEL_COMPARISONS.items():
        if time_left(ctx) < 20:
            not_run.append(name)
            continue
        try:
            rows[name] = compare(ctx)
        except Exception as exc:   # noqa: BLE001 - one comparison's crash is its failure
            import traceback

            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
        save_partial(ctx, {"comparisons": rows, "failures": failures})
    note = f"; not run for lack of time: {', '.join(not_run)}" if not_run else ""
    summary = "; ".join(f"{name}: {row['summary']}" for name, row in rows.items())
    if failures:
        return result("FAIL", "; ".join(failures) + (f" ({summary})" if summary else "") + note, comparisons=rows)
    return result("PASS" if rows else "SKIP", (summary or "nothing compared") + note, comparisons=rows)


def decode_step_ms(ctx: dict, variants: dict) -> tuple[int, dict[str, float]]:
    """(batch, the 0.5B shape's median decode step in ms under each variant): bench/gpu_decode.py
    at one batch, a fresh engine (its own CUDA graphs) inside each variant's context manager
    (`variants`: label -> a function returning one)."""
    sys.path.insert(0, str(BENCH))
    from gpu_decode import decode_check

    batch = 64 if cuda_mode(ctx) else 4
    steps = {}
    for label, variant in variants.items():
        with variant():
            out = decode_check(ctx["device"], ctx["hbm_tbps"], Path(ctx["models_dir"]), batches=[batch],
                               tokenizer_dir=tiny_model(ctx, "qwen2"))
        steps[label] = out["batches"][str(batch)]["step_ms"]
    return batch, steps


@contextlib.contextmanager
def torch_elementwise():
    """A layer's element-wise work as torch ops instead of rein's Triton kernels (as
    bench/attention_kernels.py --unfused-elementwise)."""
    from rein.kernels import elementwise

    saved = {op: getattr(elementwise, op) for op in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_")}
    for op in ("rms_norm", "add_rms_norm", "silu_and_mul"):
        setattr(elementwise, op, lambda *a: None)
    elementwise.rotary_ = lambda *a: False
    try:
        yield
    finally:
        for op, fn in saved.items():
            setattr(elementwise, op, fn)


def compare_elementwise(ctx: dict) -> dict:
    """The decode step with rein's fused element-wise kernels (norms, rotary, SiLU-and-mul)
    and with them as torch ops."""
    batch, steps = decode_step_ms(ctx, {"fused": contextlib.nullcontext, "torch ops": torch_elementwise})
    ratio = steps["torch ops"] / steps["fused"]
    return {"step_ms": steps, "batch": batch, "speedup": ratio,
            "summary": f"decode step at batch {batch}: {steps['fused']:.2f} ms fused, {steps['torch ops']:.2f} ms "
                       f"as torch ops ({ratio:.2f}x)"}


# Kernel comparisons for part kernel_compare: name -> function(ctx) returning a dict with a
# one-line "summary" (and its figures). Add a new kernel's comparison here; one that switches
# a kernel on and off in the decode step is `decode_step_ms(ctx, {"on": ..., "off": ...})`
# with a context manager for each, as compare_elementwise.
def compare_fused_kernels(ctx: dict) -> dict:
    """bench/fused_kernels.py --quick: the small-row GEMM against cuBLAS, SiLU-and-mul folded
    into the down projection, rotary fused with the K/V store, the folded decode split merge
    against its reduce kernel, flash prefill against rein's Triton kernel (its JSON line)."""
    if ctx["device"] != "cuda":
        return {"summary": "no CUDA device: bench/fused_kernels.py measures nothing here"}
    command = [sys.executable, str(BENCH / "fused_kernels.py"), "--quick"]
    timeout = max(10, min(150, time_left(ctx) - 10))
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/fused_kernels.py exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    return {**figures, "summary": f"bench/fused_kernels.py: {len(figures.get('rows', []))} rows (see the log)"}


KERNEL_COMPARISONS = {"elementwise_fused_vs_torch": compare_elementwise, "fused_kernels": compare_fused_kernels}


def part_attention_kernels(ctx: dict) -> dict:
    command = [sys.executable, str(BENCH / "attention_kernels.py"), "--quick", "--no-engine",
               "--peak-gbps", f"{ctx['hbm_tbps'] * 1000:g}"]
    print("attention_kernels: " + " ".join(command[1:]), flush=True)
    lines: list[str] = []
    try:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=lambda: [(lines.append(line), print(line, end="", flush=True))
                                                  for line in proc.stdout], daemon=True)
        reader.start()
        proc.wait(timeout=max(10, ctx["timeout"] - 10))
        reader.join(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        return result("FAIL", f"bench/attention_kernels.py ran past {ctx['timeout'] - 10} s (figures printed so far are above)")
    if proc.returncode != 0:
        return result("FAIL", f"bench/attention_kernels.py exited {proc.returncode}: {''.join(lines[-3:]).strip()[:300]}")
    try:
        figures = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return result("FAIL", "bench/attention_kernels.py printed no JSON summary last")
    if figures.get("skipped"):
        return result("SKIP", f"bench/attention_kernels.py: {figures['skipped']}")
    decode = [r for r in figures.get("decode", []) if "triton_us" in r]
    if not decode:
        return result("FAIL", "bench/attention_kernels.py measured no decode figure", figures=figures)
    errors = [r["max_abs_err"] for r in decode if "max_abs_err" in r]
    worst = max(errors) if errors else None
    summary = ", ".join(f"b{r['batch']}/ctx{r['context']}: {r['triton_us']:.0f} us {r['triton_pct_peak']:.0f}%"
                        for r in decode)
    ok = worst is None or worst < 0.1
    return result("PASS" if ok else "FAIL",
                  f"paged decode vs the {ctx['hbm_tbps']:g} TB/s peak: {summary}; max |err| vs reference "
                  f"{'-' if worst is None else f'{worst:.1e}'}" + ("" if ok else " (too large)"),
                  decode=decode, prefill=figures.get("prefill"), int8_vs_bf16=figures.get("int8_vs_bf16"),
                  store=figures.get("store"), device=figures.get("device"))


PART_FUNCTIONS = {"cuda_tests": part_cuda_tests, "bitmask": part_bitmask, "greedy_tiny": part_greedy_tiny,
                  "n_choices_graphs": part_n_choices_graphs, "cuda_paths": part_cuda_paths,
                  "tensor_parallel": part_tensor_parallel, "real_models": part_real_models,
                  "targets": part_targets, "decode": part_decode, "attention_kernels": part_attention_kernels,
                  "kernel_compare": part_kernel_compare}


# --------------------------------------------------------------------------- pytest selection


def pytest_collection_modifyitems(session, config, items) -> None:
    """`pytest -p gpu_check` with REIN_GPU_CHECK_SELECT=FILE: keep the CUDA tests only (the
    module docstring says which) and write their node ids to FILE."""
    target = os.environ.get("REIN_GPU_CHECK_SELECT")
    if not target:
        return
    keep, drop = [], []
    for item in items:
        path = Path(str(item.path))
        gpu_skip = any(re.search(r"\bGPU\b", str(mark.kwargs.get("reason", "")))
                       for mark in item.iter_markers("skipif"))
        (keep if path.parent.name == "kernels" or gpu_skip else drop).append(item)
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)
    Path(target).write_text("\n".join(item.nodeid for item in keep))


# --------------------------------------------------------------------------- driver


def run_part_here(name: str, ctx: dict, result_path: Path | None) -> int:
    """Run one part in this process; its result as JSON to `result_path` (or stdout)."""
    started = time.perf_counter()
    if name == "bitmask" and ctx["device"] != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton.jit defines the kernel
    try:
        out = PART_FUNCTIONS[name](ctx)
    except Exception as exc:   # a part's crash is its FAIL, with the traceback on stderr
        import traceback

        traceback.print_exc()
        out = result("FAIL", f"{type(exc).__name__}: {str(exc)[:400]}")
    out["seconds"] = round(time.perf_counter() - started, 1)
    text = json.dumps(out, default=str)
    if result_path is not None:
        result_path.write_text(text)
    else:
        print(text)
    return 0


class PartProcess:
    """One part in a subprocess (its own process group, killed whole on timeout); output
    echoed (foreground) or written to a log file (background), the last lines kept."""

    def __init__(self, name: str, ctx: dict, timeout: float, work: Path, log: Path | None) -> None:
        self.name, self.timeout, self.log = name, timeout, log
        self.result_path = work / f"{name}.json"
        self.tail: deque[str] = deque(maxlen=25)
        args = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--result", str(self.result_path),
                "--device", ctx["device"], "--hbm-tbps", str(ctx["hbm_tbps"]), "--models-dir", ctx["models_dir"],
                "--near-tie", str(ctx["near_tie"]), "--part-timeout", str(int(timeout))]
        if ctx.get("bf16_tflops"):
            args += ["--bf16-tflops", str(ctx["bf16_tflops"])]
        env = dict(os.environ)
        if ctx["device"] != "cuda" and name == "bitmask":
            env["TRITON_INTERPRET"] = "1"   # before triton.jit defines the kernel, so in the child
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        sink = self.log.open("w") if self.log else None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            if sink:
                sink.write(line)
                sink.flush()
            else:
                print(line, end="", flush=True)
        if sink:
            sink.close()

    def wait(self) -> dict:
        remaining = self.timeout - (time.perf_counter() - self.started)
        try:
            self.proc.wait(timeout=max(0.1, remaining))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.reader.join(timeout=5)
            partial = self.result_path.with_suffix(".partial.json")
            found = json.loads(partial.read_text()) if partial.is_file() else None
            return result("FAIL", f"timed out after {self.timeout:.0f} s"
                          + (f" (partial results kept: {', '.join(found)})" if found else "")
                          + f"; last output: {' | '.join(list(self.tail)[-3:])[:300]}",
                          seconds=round(time.perf_counter() - self.started, 1), partial=found)
        self.reader.join(timeout=5)
        if self.result_path.is_file():
            return json.loads(self.result_path.read_text())
        return result("FAIL", f"the part exited {self.proc.returncode} without a result; last output: "
                      f"{' | '.join(list(self.tail)[-3:])[:300]}", seconds=round(time.perf_counter() - self.started, 1))


def choose_device(requested: str) -> tuple[str, str | None]:
    """(device, note): cuda or cpu; a note says why CPU mode was taken or CUDA refused."""
    import torch

    has_cuda = torch.cuda.is_available()
    if requested == "cpu":
        return "cpu", None
    if requested == "cuda" and not has_cuda:
        return "none", f"--device cuda, but torch {torch.__version__} sees no CUDA device"
    if requested == "auto" and not has_cuda:
        return "cpu", f"no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda}): CPU mode, tiny shapes"
    return "cuda", None


def summary_line(name: str, r: dict) -> str:
    return f"{r['status']:<4}  {name:<18} {r.get('seconds', 0):6.1f} s  {r['reason']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=os.environ.get("REIN_GPU_CHECK_DEVICE", "auto"),
                        choices=("auto", "cuda", "cpu"), help="auto: cuda when torch sees one, else the CPU mode")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("REIN_GPU_CHECK_BUDGET", DEFAULT_BUDGET)),
                        help="seconds for the whole run; parts that would start too late are skipped")
    parser.add_argument("--hbm-tbps", type=float, default=None,
                        help=f"HBM bandwidth in TB/s for the decode bounds (default: from the device's name, "
                             f"else {DEFAULT_HBM_TBPS:g})")
    parser.add_argument("--bf16-tflops", type=float, default=None,
                        help="dense bf16 matmul TFLOP/s for the prefill target (default: from the device's name)")
    parser.add_argument("--near-tie", type=float, default=1e-3,
                        help="real models: a difference from HF where HF's top-2 margin is below this is a near-tie")
    parser.add_argument("--json", default=None, help="also write the summary here")
    parser.add_argument("--models-dir", default=None, help="where tiny/random models are built (default: a temp dir)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)          # internal: run one part here
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--part-timeout", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.part:
        ctx = {"device": args.device, "hbm_tbps": args.hbm_tbps or DEFAULT_HBM_TBPS, "near_tie": args.near_tie,
               "bf16_tflops": args.bf16_tflops,
               "models_dir": args.models_dir or tempfile.mkdtemp(prefix="rein-gpu-check-models-"),
               "timeout": args.part_timeout or TIMEOUTS[args.part], "started": time.perf_counter(),
               "partial": str(Path(args.result).with_suffix(".partial.json")) if args.result else None}
        return run_part_here(args.part, ctx, Path(args.result) if args.result else None)

    wanted = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    started = time.perf_counter()
    deadline = started + args.budget
    device, note = choose_device(args.device)
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    sys.path.insert(0, str(BENCH))
    from gpu_targets import device_peaks

    named_hbm, named_tflops = device_peaks(name)
    hbm_tbps = args.hbm_tbps or named_hbm or DEFAULT_HBM_TBPS
    bf16_tflops = args.bf16_tflops or named_tflops
    peaks_from = ("given" if args.hbm_tbps else "the device's name" if named_hbm
                  else f"assumed: {name} is not in gpu_targets.device_peaks")
    print(f"gpu_check: device {name} ({device} mode); torch {torch.__version__}; budget {args.budget:.0f} s; "
          f"HBM {hbm_tbps:g} TB/s, bf16 {bf16_tflops or '?'} TFLOP/s ({peaks_from}); parts {', '.join(wanted)}",
          flush=True)
    if note:
        print(f"gpu_check: {note}", flush=True)
    summary: dict = {"device": name, "mode": device, "torch": torch.__version__, "hbm_tbps": hbm_tbps,
                     "bf16_tflops": bf16_tflops, "peaks_from": peaks_from, "budget_s": args.budget, "parts": {}}
    if os.environ.get("REIN_GPU_CHECK_SETUP"):
        try:
            summary["setup"] = json.loads(os.environ["REIN_GPU_CHECK_SETUP"])
        except json.JSONDecodeError:
            summary["setup"] = os.environ["REIN_GPU_CHECK_SETUP"]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rein-gpu-check-") as tmp:
        work = Path(tmp)
        models_dir = args.models_dir or str(work / "models")
        ctx = {"device": device, "hbm_tbps": hbm_tbps, "bf16_tflops": bf16_tflops, "models_dir": models_dir,
               "near_tie": args.near_tie}
        timeouts = TIMEOUTS if device == "cuda" else CPU_TIMEOUTS
        timed_parts = [p for p in TIMED_PARTS if p in wanted]
        reserves = TIMED_RESERVE if device == "cuda" else CPU_TIMED_RESERVE
        reserve = sum(reserves[p] for p in timed_parts)

        def allowed(part: str, keep: float) -> float:
            return min(timeouts[part], deadline - time.perf_counter() - keep)

        def finish(part: str, r: dict) -> None:
            results[part] = r
            print(f"gpu_check: {summary_line(part, r)}", flush=True)

        background = None
        if device == "none":
            for part in wanted:
                finish(part, result("SKIP", note or "no CUDA device"))
            wanted = []
        if BACKGROUND in wanted:
            seconds = allowed(BACKGROUND, reserve)
            log = (out_dir or work) / "gpu_check_cuda_tests.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            if seconds < MIN_PART_S:
                finish(BACKGROUND, result("SKIP", "time budget"))
            else:
                print(f"gpu_check: cuda_tests runs in the background (up to {seconds:.0f} s), log {log}", flush=True)
                background = PartProcess(BACKGROUND, ctx, seconds, work, log)
        if any(p in wanted for p in ("bitmask", "greedy_tiny", "n_choices_graphs", "cuda_paths", "tensor_parallel",
                                     "targets", "decode", "kernel_compare")):
            prepare_models(ctx)
        for part in wanted:
            if part == BACKGROUND:
                continue
            if part in timed_parts and background is not None:
                # The timed parts run alone on the device.
                finish(BACKGROUND, background.wait())
                print("gpu_check: cuda_tests output (last lines):\n  " + "\n  ".join(background.tail), flush=True)
                background = None
            # What the timed parts after this one keep (all of them, for a part before them).
            later = timed_parts[timed_parts.index(part) + 1:] if part in timed_parts else timed_parts
            seconds = allowed(part, sum(reserves[p] for p in later))
            if seconds < MIN_PART_S:
                finish(part, result("SKIP", f"time budget ({max(0, deadline - time.perf_counter()):.0f} s left of {args.budget:.0f})"))
                continue
            print(f"\n== gpu_check: {part} (up to {seconds:.0f} s)", flush=True)
            finish(part, PartProcess(part, ctx, seconds, work, None).wait())
        if background is not None:
            finish(BACKGROUND, background.wait())
            print("gpu_check: cuda_tests output (last lines):\n  " + "\n  ".join(background.tail), flush=True)
    summary["parts"] = {p: results[p] for p in PARTS if p in results}
    summary["wall_s"] = round(time.perf_counter() - started, 1)
    counts = {s: sum(r["status"] == s for r in results.values()) for s in ("PASS", "FAIL", "SKIP")}
    summary["ok"] = counts["FAIL"] == 0
    summary["counts"] = counts
    print(f"\n== gpu_check summary ({name}, {device} mode, {summary['wall_s']:.0f} s): "
          f"{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP")
    for part in PARTS:
        if part in results:
            print(summary_line(part, results[part]))
    text = json.dumps(summary, default=str)
    for path in ([Path(args.json)] if args.json else []) + ([out_dir / "gpu_check.json"] if out_dir else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"gpu_check: summary written to {path}")
    print(text, flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
