"""Native CPU attention kernels: C compiled on this machine at first use, called through ctypes.

torch's CPU path for decode attention gathers every request's K and V into a padded copy and
runs SDPA over it (rein.kernels.reference): on SmolLM2 at batch 32 that was more than half of
a decode step. `csrc/paged_attention_cpu.c` reads K and V in place from the cache blocks
instead, one pass over each, vectorized for this CPU (-march=native) and split over
(request, kv head) pairs with OpenMP (the libgomp that torch has already loaded).

No library offers this for a current torch (vLLM keeps its CPU kernels inside vLLM; Intel's
extension pins older torch releases), so rein carries the ~100 lines of C. The shared object
is built with the system C compiler into `REIN_CACHE_DIR/kernels/` (a name hashed from the
source, the flags and the CPU), once per machine; processes that start together may each
build it, and the last atomic rename wins. Where there is no compiler, the build fails, the
tensors are not float32, or REIN_CPU_KERNELS=0, callers get None and use the torch reference.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if needed; None when disabled or unavailable (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _load() if _enabled() else None
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("native CPU attention kernels unavailable, using torch's (%s)", exc)
            _tried = True
    return _lib


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor | None:
    """Same contract as rein.kernels.reference.paged_decode_attention, float32 cache only;
    None when this kernel does not apply (the caller falls back to the reference)."""
    if (query.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32
            or not k_cache.is_contiguous() or not v_cache.is_contiguous()):
        return None
    lib = library()
    if lib is None:
        return None
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    max_len = int(lens.max())
    threads = torch.get_num_threads()
    out = torch.empty_like(query)
    scratch = torch.empty(threads * (num_heads // num_kv_heads) * max_len, dtype=torch.float32)
    rc = lib.paged_decode_attention_f32(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), out.data_ptr(), scratch.data_ptr(), max_len,
        batch, num_heads, num_kv_heads, head_dim, block_size, scale, threads,
    )
    return out if rc == 0 else None


def _enabled() -> bool:
    """REIN_CPU_KERNELS (rein.core.settings; default on)."""
    from rein.core.settings import Settings, SettingsError, get_settings

    try:
        return get_settings().cpu_kernels
    except SettingsError:  # settings the engine does not use are broken: their command says so
        return Settings.model_fields["cpu_kernels"].default


def _cache_dir() -> Path:
    from rein.core.settings import Settings, SettingsError, get_settings

    try:
        base = get_settings().cache_dir
    except SettingsError:
        base = Settings.model_fields["cache_dir"].default
    return Path(base).expanduser() / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _load() -> ctypes.CDLL:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_signature().encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention_cpu-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            proc = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise OSError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
            os.replace(built, target)
        log.info("built native CPU attention kernels: %s", target)
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return lib
