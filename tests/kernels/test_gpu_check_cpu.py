"""bench/gpu_check.py in its CPU mode (REIN_GPU_CHECK_DEVICE=cpu): the same Python checks the GPU
run makes, on tiny shapes, so the check is known to work before a GPU machine runs it.

The parts that can run without CUDA must PASS: the CUDA tests' selection collects, the bitmask
kernel (under the Triton interpreter) equals torch, greedy == HF, n > 1 through the static decode
buffers equals the eager engine, the decode-speed code runs. The summary reaches $OUT.
(attention_kernels only skips on CPU, and real_models needs real model files: both left out.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_PARTS = ("cuda_tests", "bitmask", "greedy_tiny", "n_choices_graphs", "decode")


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
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--parts", ",".join(CPU_PARTS),
         "--models-dir", str(models), "--budget", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    written = tmp_path / "out" / "gpu_check.json"
    assert written.is_file(), proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(written.read_text())
    assert summary["mode"] == "cpu"
    statuses = {name: part["status"] for name, part in summary["parts"].items()}
    reasons = {name: part["reason"] for name, part in summary["parts"].items()}
    assert statuses == dict.fromkeys(CPU_PARTS, "PASS"), reasons
    assert proc.returncode == 0 and summary["ok"]
    # The last stdout line is the summary too; the CUDA tests' log sits beside it.
    assert json.loads(proc.stdout.strip().splitlines()[-1])["counts"] == {"PASS": len(CPU_PARTS), "FAIL": 0, "SKIP": 0}
    assert (tmp_path / "out" / "gpu_check_cuda_tests.log").is_file()
    parts = summary["parts"]
    assert parts["cuda_tests"]["selected"] > 100   # tests/kernels' Triton tests and the CUDA-graph ones
    assert any("test_cuda_graphs.py" in f for f in parts["cuda_tests"]["files"])
    assert parts["greedy_tiny"]["archs"]["llama"]["prefix_cache_hit_tokens"] > 0
    assert parts["n_choices_graphs"]["archs"]["llama"]["replayed_steps"] > 0
    assert set(parts["decode"]["batches"]) == {"4", "8"}
    assert all(row["step_ms"] > 0 and row["bound_ms"] > 0 for row in parts["decode"]["batches"].values())


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
