"""Which CPU fast paths this machine can run: probed once per process, named in the load log.

rein's CPU forward has three fast paths beside plain torch:
- oneDNN linears (rein.model.architectures.linear), with float32 weights prepacked at load, and
  bfloat16 ones where the CPU has AVX-512-BF16 or AMX (`packed_dtypes`). oneDNN
  has no low-precision inner product on every CPU: on an AVX2-only CPU (no AVX-512-BF16,
  AMX or AVX-NE-CONVERT) `mkldnn._linear_pointwise` raises "could not create a primitive
  descriptor" for bfloat16 and float16. So each dtype is tried once on a tiny input, checked
  against `F.linear`, and only a dtype that runs and agrees takes oneDNN.
- rein's C kernels (rein.kernels.cpu_native): built with -march=native for this CPU, with
  AVX2+FMA or AVX-512 code where the compiler targets them and plain loops otherwise, so they
  build and run on any x86-64 (or other) CPU with a C compiler; float32 only.
- glibc malloc thresholds (rein.model.cpu_allocator).

REIN_CPU_FAST_PATHS=0 turns all three off (torch alone), for a machine where one misbehaves
and for the tests, which run the fallback on every machine. REIN_CPU_KERNELS and
REIN_CPU_MALLOPT turn off one path each.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from rein.core.settings import setting_or_default

# Features the fast paths care about, as /proc/cpuinfo names them.
_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "avx_ne_convert")


def enabled() -> bool:
    """REIN_CPU_FAST_PATHS (rein.core.settings; default on): false runs torch's code alone."""
    return setting_or_default("cpu_fast_paths")


@functools.cache
def cpu_features() -> tuple[str, ...]:
    """The fast-path-relevant features this CPU reports (empty off Linux or x86)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags: set[str] = set()
    for line in info.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break
    return tuple(name for name in _FEATURES if name in flags)


@functools.cache
def probe_onednn(dtype: torch.dtype) -> str | None:
    """What this CPU can do, whatever the settings say: None when oneDNN's linear (plain and
    prepacked) runs in `dtype` and agrees with F.linear on a tiny input; else why not, briefly."""
    try:
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return "no oneDNN in this torch build"
    except (AttributeError, RuntimeError):
        return "no oneDNN in this torch build"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, generator=generator).to(dtype)
    w = torch.randn(16, 32, generator=generator).to(dtype)
    want = torch.nn.functional.linear(x.float(), w.float())
    try:
        with torch.inference_mode():
            plain = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            packed = torch.ops.mkldnn._linear_pointwise(
                x, torch.ops.mkldnn._reorder_linear_weight(w, 8), None, "none", [], "")
    except RuntimeError:
        return "no primitive on this CPU"
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    for got in (plain, packed):
        if got.dtype != dtype or not torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance):
            return "wrong results on this CPU"
    return None


# The dtypes rein sends to oneDNN when the probe passes; float16 stays on F.linear.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def onednn_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose linears run on oneDNN here: probed once, the switch read once
    (`reset()` forgets both). Called on every linear, so a set lookup after the first."""
    return frozenset(dtype for dtype in ONEDNN_DTYPES if _why_not_onednn(dtype) is None)


# CPU features with bfloat16 dot products in hardware (AVX-512-BF16's vdpbf16ps, AMX's tiles).
NATIVE_BF16_FEATURES = ("avx512_bf16", "amx_bf16")


@functools.cache
def packed_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose Linear weights are prepacked for oneDNN at load
    (rein.model.architectures.linear.pack_weights): float32 where it runs on oneDNN, bfloat16
    where it does and the CPU multiplies bfloat16 in hardware. bench/bf16_weights.py (Zen 4,
    AVX-512-BF16, 1 thread): SmolLM2's projections of a layer in bfloat16 took 0.51-0.57x
    float32 packed's time and 0.61-0.94x bfloat16's on the dense weight (1 to 2048 rows). A
    CPU that runs bfloat16 on oneDNN without such instructions converts to float32 inside it;
    unmeasured there, so its weights stay dense, as before. `reset()` forgets it."""
    onednn = onednn_dtypes()
    native_bf16 = any(feature in cpu_features() for feature in NATIVE_BF16_FEATURES)
    return frozenset(dtype for dtype in onednn if dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16))


def _why_not_onednn(dtype: torch.dtype) -> str | None:
    if not enabled():
        return "REIN_CPU_FAST_PATHS=0"
    if dtype not in ONEDNN_DTYPES:
        return "oneDNN is used for float32 and bfloat16 only"
    return probe_onednn(dtype)


def reset() -> None:
    """Forget the probes and the switch (for tests that change REIN_CPU_FAST_PATHS)."""
    probe_onednn.cache_clear()
    onednn_dtypes.cache_clear()
    packed_dtypes.cache_clear()


def describe(dtype: torch.dtype) -> str:
    """The paths a CPU model in `dtype` takes, for the load log, e.g.
    `linear: torch (bfloat16: no primitive on this CPU); attention, element-wise: torch
    (the C kernels take float32 only)`."""
    from rein.kernels import cpu_native

    name = str(dtype).removeprefix("torch.")
    why = _why_not_onednn(dtype)
    if why is None:
        linear = f"oneDNN packed ({name})" if dtype in packed_dtypes() else f"oneDNN ({name})"
    else:
        linear = f"torch ({name}: {why})"
    if dtype != torch.float32:
        kernels = "torch (the C kernels take float32 only)"
    else:
        isa = cpu_native.instruction_set()
        kernels = f"rein C kernels ({isa})" if isa else f"torch ({cpu_native.why_unavailable()})"
    features = ", ".join(cpu_features()) or "none of avx2/fma/avx512"
    return f"CPU fast paths [{features}]: linear: {linear}; attention, element-wise: {kernels}"
