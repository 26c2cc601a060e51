"""Refuse, at start-up, a worker told to run on a GPU it cannot use.

Without this check, `REIN_DEVICE=cuda` on a torch built without CUDA (the CPU wheel) or on a
machine where no GPU is visible fails deep in the engine's first load, as torch's bare
"Torch not compiled with CUDA enabled" inside Celery's start-up; under a container restart
policy it then starts, fails and starts again with nothing naming the cause. `rein worker`
calls `device_problem` before it connects to anything and exits with the message, which
names the fix.

Only the device the worker was told to use is checked: `auto` already falls back to the CPU
when no GPU is usable (rein.engine.config), and `cpu` needs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from rein.core.settings import cuda_visible_devices

# Where a CUDA build of torch comes from; the image's TORCH_INDEX_URL build argument (compose.gpu.yaml).
CUDA_TORCH_INDEX = "https://download.pytorch.org/whl/cu128"


@dataclass(frozen=True)
class CudaFacts:
    """What this process's torch says about CUDA (read by `cuda_facts`, built by hand in tests)."""

    torch_version: str
    cuda_version: str | None       # torch.version.cuda: None on a CPU build
    device_count: int              # GPUs this process sees
    visible_devices: str | None    # CUDA_VISIBLE_DEVICES, when set


def cuda_facts() -> CudaFacts:
    """This process's facts. device_count() asks NVML first, so no CUDA context is created here
    (the engine may run in a spawned child that creates its own)."""
    import torch

    cuda = torch.version.cuda
    return CudaFacts(torch_version=torch.__version__, cuda_version=cuda,
                     device_count=torch.cuda.device_count() if cuda else 0,
                     visible_devices=cuda_visible_devices())


def device_problem(device: str, facts: CudaFacts | None = None) -> str | None:
    """Why `device` cannot be used here, naming the fix; None when it can (or is not CUDA)."""
    name = device.strip().lower()
    if name != "cuda" and not name.startswith("cuda:"):
        return None
    facts = facts or cuda_facts()
    on_cpu = "or run on the CPU: REIN_DEVICE=cpu (--device cpu)"
    if facts.cuda_version is None:
        return (f"device {device}: this torch ({facts.torch_version}) is built without CUDA. Install a "
                f"CUDA build (pip install torch --index-url {CUDA_TORCH_INDEX}); with docker compose, "
                f"build and run the GPU image: docker compose -f compose.yaml -f compose.gpu.yaml up "
                f"--build (its build sets TORCH_INDEX_URL={CUDA_TORCH_INDEX}); {on_cpu}")
    if facts.device_count == 0:
        visible = f"CUDA_VISIBLE_DEVICES={facts.visible_devices!r}, " if facts.visible_devices is not None else ""
        return (f"device {device}: torch {facts.torch_version} (CUDA {facts.cuda_version}) sees no GPU "
                f"({visible}torch.cuda.device_count() is 0). Check the NVIDIA driver (nvidia-smi); in a "
                f"container, the host needs the NVIDIA Container Toolkit and the container a GPU "
                f"(compose.gpu.yaml gives the worker every GPU, docker run needs --gpus); {on_cpu}")
    index = name.partition(":")[2]
    if index:
        if not index.isdigit():
            return f"device {device}: expected cuda or cuda:N with N a GPU index, e.g. cuda:0"
        if int(index) >= facts.device_count:
            return (f"device {device}: only {facts.device_count} GPU(s) are visible to this process "
                    f"(cuda:0 to cuda:{facts.device_count - 1}); a container given some GPUs (device_ids) "
                    f"sees them from cuda:0 on, so number them from 0 there")
    return None
