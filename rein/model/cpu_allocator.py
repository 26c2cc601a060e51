"""Keep glibc's malloc from handing large tensors' memory back to the kernel after every use.

A CPU step allocates and frees the same large tensors over and over (a prefill chunk's MLP
activations are 2048 x 3072 floats, 24 MiB; a decode step's gathered K/V a few MiB per layer).
glibc serves blocks above its mmap threshold (dynamic, at most 32 MiB) with a fresh mmap and
unmaps them on free, so every such tensor is page-faulted in again, zeroed page by page by the
kernel: a 4 KiB fault per page, on the step's thread. vLLM's CPU build avoids this by preloading
tcmalloc. rein sets glibc's own knobs once, at engine start (`mallopt`): allocations are
served from the heap up to 1 GiB and freed memory is kept for reuse instead of trimmed.
Measured on the benchmark machine, gathering a 64-request decode batch's keys took 7.5 ms
before and 1.8 ms after (median, 1 thread).

The cost is memory held after a peak rather than returned to the system; the engine reaches
the same peak again on its next large step anyway.

Loading is the opposite: one-off buffers (a tokenizer.json's parse, a GGUF chunk's repacking,
the int8-activation panels' conversion) between weights that stay. glibc's default raises its
mmap threshold to the size of each large block freed (up to 32 MiB), so the next ones come
from the heap, and the holes they leave between the weights stay in the process: SmolLM2's
engine with int8 activations peaked at 849 MiB, 528 MiB with the thresholds fixed.
`return_freed_memory` fixes them at glibc's starting 128 KiB while a model loads (the loader
and the tokenizer set it), so every large buffer is a mapping of its own, unmapped when freed;
`keep_freed_memory` switches to the step's settings once the load is done.

Not glibc (musl, macOS) or disabled with REIN_CPU_MALLOPT=0 or REIN_CPU_FAST_PATHS=0: nothing
changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from rein.core.settings import setting_or_default

log = logging.getLogger(__name__)

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
HEAP_LIMIT = 1 << 30
LOAD_THRESHOLD = 128 << 10   # glibc's own starting mmap and trim thresholds

_mode = "default"   # "load" (return_freed_memory) or "steps" (keep_freed_memory) once set


def keep_freed_memory() -> bool:
    """Apply the step's settings (once per process, again after a load); True when glibc
    accepted them."""
    global _mode
    if _mode == "steps":
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # Some glibc builds refuse an mmap threshold above 32 MiB (their largest default).
    ok = bool(mallopt(M_MMAP_THRESHOLD, HEAP_LIMIT)) or bool(mallopt(M_MMAP_THRESHOLD, 32 << 20))
    ok = ok and bool(mallopt(M_TRIM_THRESHOLD, HEAP_LIMIT))
    if ok:
        _mode = "steps"
        log.debug("glibc malloc: mmap threshold and trim threshold set to %d bytes", HEAP_LIMIT)
    return ok


def return_freed_memory() -> bool:
    """The load's settings (see the module docstring): fixed mmap and trim thresholds of 128
    KiB, so large one-off buffers go back to the system when freed; True when glibc accepted
    them. Until `keep_freed_memory`."""
    global _mode
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, LOAD_THRESHOLD))
    if ok:
        _mode = "load"
    return ok


def _mallopt():
    """glibc's mallopt, where enabled; None elsewhere."""
    if not _enabled():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None   # not glibc
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def release_free_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): after a model load,
    whose one-off buffers (repacking quantized weights, reading a checkpoint) leave freed holes
    between the weights that glibc would otherwise keep, up to twice the weights' size. Not
    glibc: nothing."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _enabled() -> bool:
    """REIN_CPU_MALLOPT and REIN_CPU_FAST_PATHS (rein.core.settings; both default on)."""
    return setting_or_default("cpu_mallopt") and setting_or_default("cpu_fast_paths")
