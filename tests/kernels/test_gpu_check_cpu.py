"""bench/gpu_check.py in its CPU mode (REIN_GPU_CHECK_DEVICE=cpu): the same Python checks the GPU
run makes, on tiny shapes, so the check is known to work before a GPU machine runs it.

The parts that can run without CUDA must PASS: the CUDA tests' selection collects (every
CUDA path's test file in it), the bitmask kernel (under the Triton interpreter) equals torch,
the end-to-end path cases run, greedy == HF, n > 1 through the static decode buffers equals the
eager engine, the targets', decode-speed and kernel-comparison code runs; tensor_parallel
SKIPs with its reason. The summary reaches $OUT. (attention_kernels only skips on CPU, and
real_models needs real model files: both left out.) Then the pieces of the targets'
arithmetic and parsing, on known inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_PARTS = ("cuda_tests", "bitmask", "cuda_paths", "n_choices_graphs", "greedy_tiny", "targets", "decode",
             "kernel_compare")
SKIPPED = ("tensor_parallel",)


@pytest.mark.slow
def test_cpu_mode_passes_every_part_that_runs_without_cuda(tmp_path, tiny_models):
    # The session's tiny models, reused (the check builds only what is missing from its models dir).
    models = tmp_path / "models"
    models.mkdir()
    for arch in ("llama", "qwen2"):
        (models / arch).symlink_to(tiny_models(arch), target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_GPU_CHECK")}
    env.update(REIN_GPU_CHECK_DEVICE="cpu", OUT=str(tmp_path / "out"), TQDM_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--parts", ",".join(CPU_PARTS + SKIPPED),
         "--models-dir", str(models), "--budget", "480"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    written = tmp_path / "out" / "gpu_check.json"
    assert written.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(written.read_text())
    assert summary["mode"] == "cpu"
    statuses = {name: part["status"] for name, part in summary["parts"].items()}
    reasons = {name: part["reason"] for name, part in summary["parts"].items()}
    assert statuses == {**dict.fromkeys(CPU_PARTS, "PASS"), **dict.fromkeys(SKIPPED, "SKIP")}, reasons
    assert "needs two" in reasons["tensor_parallel"]
    assert proc.returncode == 0 and summary["ok"]
    # The last stdout line is the summary too; the CUDA tests' log sits beside it.
    assert json.loads(proc.stdout.strip().splitlines()[-1])["counts"] == {
        "PASS": len(CPU_PARTS), "FAIL": 0, "SKIP": len(SKIPPED)}
    assert (tmp_path / "out" / "gpu_check_cuda_tests.log").is_file()
    parts = summary["parts"]
    assert parts["cuda_tests"]["selected"] > 100   # tests/kernels' Triton tests and the CUDA-graph ones
    assert any("test_cuda_graphs.py" in f for f in parts["cuda_tests"]["files"])
    assert parts["greedy_tiny"]["archs"]["llama"]["prefix_cache_hit_tokens"] > 0
    assert parts["n_choices_graphs"]["archs"]["llama"]["replayed_steps"] > 0
    assert set(parts["decode"]["batches"]) == {"4", "8"}
    assert all(row["step_ms"] > 0 and row["bound_ms"] > 0 for row in parts["decode"]["batches"].values())
    assert parts["decode"]["idle"]["steps"] == 3 and parts["decode"]["idle"]["events"] > 0
    # Every named CUDA path has tests selected; each end-to-end case agreed with its reference.
    assert all(row.get("SELECTED", 0) > 0 for row in parts["cuda_tests"]["paths"].values()), parts["cuda_tests"]["paths"]
    cases = parts["cuda_paths"]["cases"]
    assert set(cases) == {"gguf_moe_q4_0", "gemma3_windowed", "gemma3_vision", "lora"}
    assert all(case["identical"] == case["requests"] for case in cases.values())
    assert cases["lora"]["adapted_requests_changed"] > 0
    targets = parts["targets"]
    assert targets["decode"]["step_ms"] > 0 and targets["prefill"]["tflops"] > 0
    assert targets["idle"]["steps"] == 3 and 0 <= targets["idle"]["idle_pct"] <= 100
    assert parts["kernel_compare"]["comparisons"]["elementwise_fused_vs_torch"]["speedup"] > 0


def test_idle_shares_split_gaps_between_and_within_steps(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_targets import idle_shares

    # Two steps on the host; GPU work launched in each (correlation ids 1-4), the second
    # step's first kernel 10 us after the first step's last ended, 5 us idle inside step 2.
    steps = [(0.0, 50.0), (50.0, 100.0)]
    launches = {1: 1.0, 2: 2.0, 3: 55.0, 4: 56.0}
    activity = [(10.0, 40.0, 1), (40.0, 60.0, 2), (70.0, 80.0, 3), (85.0, 110.0, 4)]
    shares = idle_shares(steps, launches, activity)
    assert shares["span_us"] == 100.0 and shares["busy_us"] == 85.0
    assert shares["between_steps_pct"] == pytest.approx(10.0) and shares["idle_pct"] == pytest.approx(15.0)
    # Without launch times a kernel goes to the step its start falls in.
    assert idle_shares(steps, {}, [(10.0, 20.0, None), (60.0, 70.0, None)])["between_steps_pct"] == pytest.approx(66.7, abs=0.1)
    assert idle_shares(steps, {}, [(10.0, 20.0, None)]) == {"steps_with_gpu_work": 1}


def test_peaks_and_prefill_flops_of_the_8b_shape(tmp_path, tiny_models, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_targets import LLAMA_8B_SHAPE, device_peaks, prefill_flops, write_config_dir

    from rein.model.spec import ModelSpec

    assert device_peaks("NVIDIA H100 80GB HBM3") == (3.35, 989.0)
    assert device_peaks("NVIDIA H200") == (4.8, 989.0)
    assert device_peaks("NVIDIA H100 PCIe") == (2.0, 756.0)
    assert device_peaks("cpu") == (None, None)
    spec = ModelSpec.from_dir(write_config_dir(tmp_path / "8b", LLAMA_8B_SHAPE, tiny_models("llama"), 8448))
    assert spec.num_parameters() == 8_030_261_248          # Llama 3.1 8B
    # 2 x 6.98e9 body parameters x 8192 tokens, the head once, and causal attention.
    body = 8_030_261_248 - 2 * 128256 * 4096
    attention = 32 * 2 * 2 * 32 * 128 * 8192 * 8193 / 2
    assert prefill_flops(spec, 8192) == 2.0 * body * 8192 + 2.0 * 128256 * 4096 + attention


def test_pytest_outcome_lines_plain_and_from_xdist_workers(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from gpu_check import outcome_of

    assert outcome_of("tests/kernels/test_x.py::test_a[1-2] PASSED                 [ 10%]") == (
        "tests/kernels/test_x.py::test_a[1-2]", "PASSED")
    assert outcome_of("[gw3] [ 12%] FAILED tests/kernels/test_x.py::test_b ") == ("tests/kernels/test_x.py::test_b", "FAILED")
    assert outcome_of("collected 12 items") == (None, None)


def test_decode_profile_runs_on_cpu(tmp_path, tiny_models, capsys, monkeypatch):
    """bench/gpu_decode.py --profile (what found where an H200's decode step goes) runs its
    timed parts and the profiler tables on CPU too."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_decode
    trace = tmp_path / "trace.json"
    result = gpu_decode.decode_check("cpu", 4.8, tmp_path / "models", batches=[4], tokenizer_dir=tiny_models("qwen2"),
                                     profile_steps=3, trace=trace)
    out = capsys.readouterr().out
    assert result["status"] == "PASS" and set(result["batches"]) == {"4"}
    assert "profile:   engine step" in out and "profile:   plan (python)" in out
    assert "Self CPU time total" in out          # torch.profiler's table
    assert trace.is_file() and json.loads(trace.read_text())["traceEvents"]
