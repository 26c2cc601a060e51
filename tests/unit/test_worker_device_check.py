"""rein.worker.device_check: a worker told to use CUDA that it cannot use is refused at start-up
with the fix named, not left to fail inside the engine's load (and loop under a restart policy)."""

from __future__ import annotations

import argparse

import pytest
import torch

from rein.worker.device_check import CUDA_TORCH_INDEX, CudaFacts, cuda_facts, device_problem

CPU_TORCH = CudaFacts(torch_version="2.13.0+cpu", cuda_version=None, device_count=0, visible_devices=None)
NO_GPU = CudaFacts(torch_version="2.13.0+cu128", cuda_version="12.8", device_count=0, visible_devices="")
TWO_GPUS = CudaFacts(torch_version="2.13.0+cu128", cuda_version="12.8", device_count=2, visible_devices=None)


@pytest.mark.parametrize("device", ["cpu", "auto", "CPU"])
def test_devices_other_than_cuda_are_not_checked(device):
    assert device_problem(device, CPU_TORCH) is None


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "CUDA:1"])
def test_cpu_torch_names_the_cuda_wheel_and_the_gpu_override(device):
    problem = device_problem(device, CPU_TORCH)
    assert problem is not None
    assert "built without CUDA" in problem and "2.13.0+cpu" in problem
    assert CUDA_TORCH_INDEX in problem and "compose.gpu.yaml" in problem
    assert "REIN_DEVICE=cpu" in problem


def test_cuda_torch_without_a_visible_gpu_names_the_driver_and_the_toolkit():
    problem = device_problem("cuda", NO_GPU)
    assert problem is not None
    assert "sees no GPU" in problem and "CUDA_VISIBLE_DEVICES=''" in problem
    assert "nvidia-smi" in problem and "NVIDIA Container Toolkit" in problem and "compose.gpu.yaml" in problem


def test_gpu_index_must_be_visible():
    assert device_problem("cuda", TWO_GPUS) is None
    assert device_problem("cuda:1", TWO_GPUS) is None
    problem = device_problem("cuda:2", TWO_GPUS)
    assert problem is not None and "only 2 GPU(s)" in problem and "cuda:0 to cuda:1" in problem
    assert "expected cuda or cuda:N" in (device_problem("cuda:x", TWO_GPUS) or "")


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_this_torch_is_read_as_it_is():
    facts = cuda_facts()
    assert facts.cuda_version is None and facts.device_count == 0
    assert facts.torch_version == torch.__version__
    assert "built without CUDA" in (device_problem("cuda") or "")


def run_worker(monkeypatch, *argv: str) -> int:
    """`rein worker ARGV`'s exit status, for a model that does not exist and a database URL that
    points nowhere: a refusal must come before either is touched."""
    from rein.cli import worker
    from rein.core.settings import get_settings

    monkeypatch.setenv("REIN_MODELS", "m=/nonexistent/model")
    monkeypatch.setenv("REIN_DATABASE_URL", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    get_settings.cache_clear()
    try:
        parser = argparse.ArgumentParser()
        worker.register(parser.add_subparsers())
        args = parser.parse_args(["worker", *argv])
        return args.func(args)
    finally:
        get_settings.cache_clear()


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_worker_command_exits_at_once_naming_the_fix(monkeypatch, capsys):
    """`rein worker` on a CPU torch with REIN_DEVICE=cuda returns 2 before it touches the
    database (the URL here points nowhere) or the model (which does not exist)."""
    monkeypatch.setenv("REIN_DEVICE", "cuda")
    assert run_worker(monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device cuda: this torch") and "compose.gpu.yaml" in err


def test_every_rank_of_a_tensor_parallel_worker_is_checked(monkeypatch, capsys):
    """With --tensor-parallel-size 2 on cuda:1, rank 1 would run on cuda:2: a host with two GPUs
    cannot run it, and the worker says so naming that device."""
    from rein.worker import device_check

    facts = device_check.CudaFacts(torch_version="2.x", cuda_version="12.8", device_count=2, visible_devices=None)
    monkeypatch.setattr(device_check, "cuda_facts", lambda: facts)
    assert run_worker(monkeypatch, "--device", "cuda:1", "--tensor-parallel-size", "2") == 2
    assert "device cuda:2: only 2 GPU(s) are visible" in capsys.readouterr().err

