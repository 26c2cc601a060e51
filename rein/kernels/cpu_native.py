"""Native CPU kernels: C compiled on this machine at first use, called through ctypes.

torch's CPU path for decode attention gathers every request's K and V into a padded copy and
runs SDPA over it (rein.kernels.reference): on SmolLM2 at batch 32 that was more than half of
a decode step. `csrc/paged_attention_cpu.c` reads K and V in place from the cache blocks
instead, one pass over each, vectorized for this CPU (-march=native) and split over
requests with OpenMP (the libgomp that torch has already loaded). `csrc/elementwise_cpu.c`
does a layer's element-wise work (RMSNorm with the residual add, SiLU-and-multiply, rotary in
place) in one pass each, where torch makes several (vLLM's CPU build has the same fused ops).
`csrc/prefill_attention_cpu.c` is flash attention for prefill chunks with its block products
in registers, where torch's CPU flash kernel goes through the BLAS sgemm (the engine takes it
on a CPU with AVX-512 only: `prefill_attention_pays`). `csrc/lora_cpu.c`
adds a step's LoRA adapter products to a projection's output in one call, each adapter's
weights read once for its tokens, where torch runs four small ops per adapter.

No library offers this for a current torch (vLLM keeps its CPU kernels inside vLLM; Intel's
extension pins older torch releases), so rein carries some 550 lines of C. The shared object
is built with the system C compiler into `REIN_CACHE_DIR/kernels/` (a name hashed from the
source, the flags and the CPU), once per machine; processes that start together may each
build it, and the last atomic rename wins. That folder is private to the user (0700; one that
another user owns or that group or others may write is refused, and torch's code used), and
the library's SHA-256, recorded beside it at build time, is checked before every load: a
library changed since it was built is built again rather than loaded. -march=native makes the build this CPU's: AVX-512
or AVX2+FMA code where it has them, plain loops (vectorized by the compiler as far as the CPU
allows) elsewhere, so every x86-64 CPU runs them. Where there is no compiler, the build fails,
the tensors are not float32 (the attention kernels also read a float16 or bfloat16 KV cache,
csrc/kv_types.h), or REIN_CPU_KERNELS=0 or REIN_CPU_FAST_PATHS=0, callers get None and use
torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from rein.core.settings import cache_root, setting_or_default

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention_cpu.c", CSRC / "prefill_attention_cpu.c", CSRC / "elementwise_cpu.c",
           CSRC / "quantized_matmul_cpu.c", CSRC / "lora_cpu.c", CSRC / "instruction_set.c",
           CSRC / "quantized_matmul_int8act.c", CSRC / "rotary_store_cpu.c", CSRC / "decode_layers_cpu.c")
HEADERS = (CSRC / "fast_exp.h", CSRC / "kv_types.h")
# The target CPU: this one. The sources pick AVX-512, AVX2+FMA or plain loops by what it has
# (instruction_set.c); the tests also build for the x86-64 baseline to run the plain loops.
MARCH = "native"
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it gcc 12
# keeps every fast_expf loop scalar (its input clamps stay branches): on an AVX2 machine a
# layer's element-wise work took 1.8x, and decode attention 1.25x, the time (docs/benchmarks.md).
FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared")
INSTRUCTION_SETS = {2: "avx512f+avx2+fma", 1: "avx2+fma", 0: "portable C"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if needed; None when disabled or unavailable (logged once)."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            _why_not = _disabled_by()
            try:
                _lib = None if _why_not else _load()
            except (OSError, subprocess.SubprocessError) as exc:
                _why_not = f"C kernels unavailable: {exc}"
                log.warning("native CPU kernels unavailable, using torch's (%s)", exc)
            _tried = True
    return _lib


def instruction_set() -> str | None:
    """The vector code the loaded kernels run (`avx2+fma`, ...); None when they are unavailable."""
    lib = library()
    return None if lib is None else INSTRUCTION_SETS.get(lib.rein_instruction_set(), "portable C")


def prefill_attention_pays() -> bool:
    """Whether the engine's prefill attention takes the C kernel (else torch's flash kernel, via
    rein.kernels.reference): only where the kernels are built for AVX-512. On a CPU with AVX2
    alone the kernel's 6 x 16 register tiles ran at 10-12 GFLOP/s and took 1.3-2.4x torch's time
    (bench/cpu_kernels.py --parts prefill, one thread, 2-core AMD EPYC with AVX2, 2026-12-06:
    8 prompts of 256 tokens 56.8 against 43.8 ms, one of 4096 1712 against 711 ms); on the
    AVX-512 machines it was tuned on it beat torch's."""
    return instruction_set() == INSTRUCTION_SETS[2]


def why_unavailable() -> str:
    """Why `library()` is None, in a few words ("" when it is loaded)."""
    library()
    return _why_not


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                           window: int | None = None, max_context: int | None = None) -> torch.Tensor | None:
    """Same contract as rein.kernels.reference.paged_decode_attention for a float32 query and a
    float32, float16 or bfloat16 cache (computed in float32); None when this kernel does not
    apply (the caller falls back to the reference). `max_context`: the longest of context_lens
    where the caller knows it (one step's layers share it), else read from the tensor."""
    lib = library() if _attention_applies(query, k_cache, v_cache) else None
    if lib is None:
        return None
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    # The engine's tables and lengths are int32 already: these are no-ops there.
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    max_len = int(lens.max()) if max_context is None else max_context
    threads = torch.get_num_threads()
    out = torch.empty_like(query)
    scratch = torch.empty(threads * num_heads * max_len, dtype=torch.float32)
    rc = lib.paged_decode_attention_f32(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype],
        tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), out.data_ptr(), scratch.data_ptr(), max_len,
        batch, num_heads, num_kv_heads, head_dim, block_size, scale, _c_window(window), threads,
    )
    return out if rc == 0 else None


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            scale, window: int | None = None) -> torch.Tensor | None:
    """Same contract as rein.kernels.reference.paged_prefill_attention for a float32 query and a
    float32, float16 or bfloat16 cache (computed in float32); None when this kernel does not
    apply (the caller falls back to the reference)."""
    lib = library() if _attention_applies(query, k_cache, v_cache) else None
    if lib is None:
        return None
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    starts = cu_seqlens_q.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    panel = lib.prefill_attention_f32_nr()
    max_context = int(lens.max())
    out = torch.empty_like(query)
    # one kv head's K panels and V rows, widened to float32
    packed = torch.empty(2 * ((max_context + panel - 1) // panel * panel) * head_dim, dtype=torch.float32)
    rc = lib.paged_prefill_attention_f32(
        query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype],
        tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), out.data_ptr(),
        packed.data_ptr(), max_context, lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, scale,
        _c_window(window), torch.get_num_threads(),
    )
    return out if rc == 0 else None


def _c_window(window: int | None) -> int:
    """The C kernels' window argument: 0 means none."""
    return 0 if window is None else window


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in tensors)


# The cache element types the attention kernels read, by their code in csrc/kv_types.h.
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _attention_applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The attention kernels' inputs: a float32 query, the caches contiguous and of one of
    KV_TYPES, all on the CPU."""
    return (query.dtype == torch.float32 and query.is_cpu and k_cache.dtype in KV_TYPES
            and v_cache.dtype == k_cache.dtype and k_cache.is_cpu and v_cache.is_cpu
            and k_cache.is_contiguous() and v_cache.is_contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [..., hidden] normalized and scaled; None when not applicable (use torch)."""
    if not (_f32_cpu(x, weight) and x.stride(-1) == 1 and weight.is_contiguous()):
        return None
    rows2d = x.reshape(-1, x.shape[-1]) if x.is_contiguous() else (x if x.dim() == 2 else None)
    lib = library()
    if lib is None or rows2d is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.rms_norm_f32(rows2d.data_ptr(), rows2d.stride(0), weight.data_ptr(), eps, out.data_ptr(),
                     rows2d.shape[0], rows2d.shape[1], torch.get_num_threads())
    return out


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """residual += x in place, then rms_norm(residual); None (nothing changed) when not applicable."""
    if not (_f32_cpu(residual, x, weight) and residual.is_contiguous() and x.is_contiguous()
            and weight.is_contiguous() and residual.shape == x.shape):
        return None
    lib = library()
    if lib is None:
        return None
    out = torch.empty_like(residual)
    cols = residual.shape[-1]
    lib.add_rms_norm_f32(residual.data_ptr(), x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
                         residual.numel() // cols, cols, torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gate_up [rows, 2 * inter] -> silu(gate) * up [rows, inter]; None when not applicable."""
    if not (_f32_cpu(gate_up) and gate_up.dim() == 2 and gate_up.stride(1) == 1):
        return None
    lib = library()
    if lib is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=torch.float32)
    lib.silu_and_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [tokens, heads, head_dim] in place (rotate-half layout) with cos, sin
    [tokens, 1 or absent, head_dim / 2]; False (x untouched) when not applicable."""
    if not (_f32_cpu(x, cos, sin) and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.is_contiguous() and sin.is_contiguous()):
        return False
    lib = library()
    if lib is None:
        return False
    tokens, heads, head_dim = x.shape
    lib.rotary_inplace_f32(x.data_ptr(), x.stride(0), tokens, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                           torch.get_num_threads())
    return True


def rotary_store_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """Rotate query [T, heads, d] and key [T, kv_heads, d] in place (rotate-half layout) with cos,
    sin [T, 1 or absent, d / 2], then write key and value [T, kv_heads, d] into the caches
    [blocks, block_size, kv_heads, d] (float32, float16 or bfloat16) at slot_mapping [T] (int64;
    negative: not stored), in one call (csrc/rotary_store_cpu.c). False, nothing touched, where it
    does not apply: the caller rotates and stores with the separate kernels."""
    # Called once per layer per step: torch's cheap accessors only (shape and stride tuples).
    f32 = torch.float32
    if not (query.dtype == f32 and key.dtype == f32 and value.dtype == f32 and cos.dtype == f32
            and sin.dtype == f32 and query.is_cpu and key.is_cpu and value.is_cpu and cos.is_cpu and sin.is_cpu
            and k_cache.is_cpu and v_cache.is_cpu and slot_mapping.is_cpu and slot_mapping.dtype == torch.int64
            and k_cache.dtype in KV_TYPES and v_cache.dtype == k_cache.dtype
            and len(query.shape) == 3 and len(key.shape) == 3 and len(k_cache.shape) == 4):
        return False
    tokens, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    kv_row = (kv_heads, head_dim)
    q_stride, k_stride, v_stride = query.stride(), key.stride(), value.stride()
    if not (tuple(key.shape) == (tokens, *kv_row) and tuple(value.shape) == (tokens, *kv_row)
            and tuple(k_cache.shape[2:]) == kv_row and k_cache.shape == v_cache.shape and head_dim % 2 == 0
            and q_stride[1:] == (head_dim, 1) and k_stride[1:] == (head_dim, 1) and v_stride[1:] == (head_dim, 1)
            and cos.numel() == tokens * head_dim // 2 and sin.numel() == cos.numel() and cos.is_contiguous()
            and sin.is_contiguous() and tuple(slot_mapping.shape) == (tokens,) and slot_mapping.is_contiguous()
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    lib = library()
    if lib is None:
        return False
    lib.rotary_store_kv_f32(query.data_ptr(), q_stride[0], heads, key.data_ptr(), k_stride[0], value.data_ptr(),
                            v_stride[0], kv_heads, head_dim, tokens, cos.data_ptr(), sin.data_ptr(),
                            k_cache.data_ptr(), v_cache.data_ptr(), KV_TYPES[k_cache.dtype], slot_mapping.data_ptr(),
                            torch.get_num_threads())
    return True


def quantized_matmul(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [rows, cols] float32 @ w.T (+ bias) for a `rein.kernels.quantized.CpuPanels` weight
    (csrc/quantized_matmul_cpu.c) or an `Int8Panels` one (csrc/quantized_matmul_int8act.c: x
    quantized to int8 per row and block of `weight.act_block` columns first); None where the
    kernel does not apply (the caller dequantizes instead): x not float32 rows [rows, cols] on the
    CPU with unit column stride, a bias not a contiguous float32 vector, or no kernels."""
    # Called once per projection per step: torch's cheap accessors only (shape and stride tuples).
    if not (x.dtype == torch.float32 and x.is_cpu and len(x.shape) == 2 and x.stride(1) == 1
            and x.shape[1] == weight.cols and (bias is None or (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()))):
        return None
    kernel = matmul_kernel(weight)
    return None if kernel is None else kernel(x, bias)


def matmul_kernel(weight):
    """`weight`'s kernel call, `run(x, bias) -> out or None`, with the weight's pointers and
    sizes bound once (cached on the weight, `weight.kernel`, for the loaded library); None
    without the kernels or for a weight not on the CPU. `x` and `bias` are not checked: see
    `quantized_matmul`. The weights' tensors are never reassigned (a changed weight is a new
    one: dataclasses.replace), so the bound pointers stay theirs."""
    lib = library()
    if lib is None or weight.q.device.type != "cpu":
        return None
    kernel = weight.kernel
    if kernel is None or kernel.lib is not lib:
        kernel = weight.kernel = _bind_matmul(lib, weight)
    return kernel


def _bind_matmul(lib: ctypes.CDLL, weight):
    """The kernel call for `weight` (see matmul_kernel): the C functions take (x, x stride,
    weight..., bias, out, out stride, rows, sizes..., threads)."""
    from rein.kernels.quantized import Int8Panels

    def ptr(t):
        return None if t is None else t.data_ptr()

    n = weight.rows
    if isinstance(weight, Int8Panels):
        fn = lib.quantized_matmul_int8act
        held = (ptr(weight.q), ptr(weight.scale), ptr(weight.offset))
        sizes = (n, weight.cols, weight.group, weight.act_block, weight.layout_bits)
    elif weight.packed:   # 5/6-bit planes, float16 x int8 scales
        fn = lib.quantized_matmul_packed_f32
        held = (ptr(weight.q), ptr(weight.scale), ptr(weight.scale_sub), ptr(weight.offset),
                ptr(weight.offset_sub), weight.zero)
        sizes = (n, weight.cols, weight.group, weight.block, weight.bits)
    else:
        fn = lib.quantized_matmul_f32
        held = (ptr(weight.q), ptr(weight.scale), ptr(weight.offset))
        sizes = (n, weight.cols, weight.group, weight.bits)
    tensors = weight.held()   # kept alive with the pointers

    def run(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
        rc = fn(x.data_ptr(), x.stride(0), *held, None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                x.shape[0], *sizes, torch.get_num_threads())
        return out if rc == 0 else None

    run.lib, run.tensors = lib, tensors
    return run


def _bind_int8act(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.quantized_matmul_int8act.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_int,
                                             ctypes.c_int]
    lib.quantized_matmul_int8act.restype = ctypes.c_int




def lora_apply(x: torch.Tensor, out: torch.Tensor, offset: int, lora_a: torch.Tensor, lora_b: torch.Tensor,
               order: torch.Tensor, chunks: torch.Tensor, live: torch.Tensor) -> bool:
    """out[t, offset:offset + N] += lora_b[s] @ (lora_a[s] @ x[t]) for every token t of a live
    slot s (csrc/lora_cpu.c): x [T, in], out [T, >= offset + N], lora_a [S, R, in] and lora_b
    [S, N, R] transposed views of contiguous [S, in, R] and [S, R, N] (the CPU layout of
    rein.model.lora.layers.LoRAPart); `order` (int64 [tokens]) the step's tokens sorted by slot,
    `chunks` (int64 [C, 3]) (slot, begin, end) runs of one slot in `order`, at most
    `lora_max_chunk()` long; `live`
    (uint8 [S]) the slots this projection holds an adapter in. False (out untouched) where the
    kernel does not apply: not float32 on the CPU, strides it does not take, a rank or chunk
    above its limits, a slot or token index out of range, or no kernels (the caller runs torch)."""
    # Called once per projection part per step (210 times a SmolLM2 step): the checks use torch's
    # cheap accessors (shape and stride tuples, is_cpu; a transposed view to test would cost 2 us
    # alone), and a call with nothing to compute takes about 8 us here, 13 with the plain checks.
    f32 = torch.float32
    if not (x.dtype == f32 and out.dtype == f32 and lora_a.dtype == f32 and lora_b.dtype == f32
            and x.is_cpu and out.is_cpu and lora_a.is_cpu and lora_b.is_cpu
            and len(x.shape) == 2 and len(out.shape) == 2 and len(lora_a.shape) == 3 and len(lora_b.shape) == 3):
        return False
    slots, rank, in_features = lora_a.shape
    tokens, cols = x.shape[0], lora_b.shape[1]
    x_stride, out_stride = x.stride(), out.stride()
    if not (x_stride[1] == 1 and out_stride[1] == 1 and x.shape[1] == in_features and out.shape[0] == tokens
            and offset + cols <= out.shape[1] and lora_b.shape[0] == slots and lora_b.shape[2] == rank
            and lora_a.stride() == (in_features * rank, 1, rank) and lora_b.stride() == (rank * cols, 1, cols)
            and order.dtype == torch.int64 and chunks.dtype == torch.int64 and live.dtype == torch.uint8
            and order.is_contiguous() and chunks.is_contiguous() and live.is_contiguous()
            and live.shape[0] == slots and len(chunks.shape) == 2 and chunks.shape[1] == 3):
        return False
    lib = library()
    if lib is None:
        return False
    rc = lib.lora_apply_f32(
        x.data_ptr(), x_stride[0], out.data_ptr(), out_stride[0], offset, lora_a.data_ptr(), lora_b.data_ptr(),
        rank, in_features, cols, tokens, slots, order.data_ptr(), order.shape[0], chunks.data_ptr(), chunks.shape[0],
        live.data_ptr(), torch.get_num_threads())
    return rc == 0


def lora_max_chunk() -> int:
    """The most tokens of one slot a `lora_apply` chunk may hold (0 without the kernels)."""
    lib = library()
    return 0 if lib is None else lib.lora_max_chunk()


def library_path() -> Path:
    """The built library, checked: in a private folder (`private_folder`), the SHA-256 recorded
    when it was built. Built first when it is missing or fails the check. OSError when no
    library can be had (no compiler, a folder rein may not use)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    flags = (*FLAGS, f"-march={MARCH}")
    digest = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    folder = private_folder(cache_root() / "kernels")
    target = folder / f"rein_cpu_kernels-{digest}.so"
    problem = _file_problem(target) if target.exists() else "not built yet"
    if problem is None:
        return target
    if problem != "not built yet":
        log.warning("native CPU kernels %s: %s; building them again", target, problem)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built = Path(tmp) / target.name
        _build(compiler, flags, built)
        checksum = Path(tmp) / (target.name + CHECKSUM_SUFFIX)
        checksum.write_text(_sha256(built) + "\n")
        # The library first, then its checksum: a process that reads them between the two
        # renames finds them not matching and builds its own.
        os.replace(built, target)
        os.replace(checksum, _checksum_path(target))
    log.info("built native CPU kernels: %s", target)
    problem = _file_problem(target)
    if problem is not None:
        raise OSError(f"{target}: {problem}")
    return target


CHECKSUM_SUFFIX = ".sha256"


def private_folder(path: Path) -> Path:
    """`path`, created 0700 if missing. Refused (OSError) when it is not a folder, when another
    user owns it, or when its group or others may write it (they could put a library there);
    one this user owns that others may only read is made 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a folder (a link or a file): rein loads native code only from a folder of "
                      f"its own; remove it")
    if info.st_uid != os.geteuid():
        raise OSError(f"{path} belongs to user id {info.st_uid}, not to this process's ({os.geteuid()}): rein "
                      f"loads native code only from a folder of its own user; remove it or set REIN_CACHE_DIR")
    if info.st_mode & 0o022:
        raise OSError(f"{path} may be written by its group or others (mode {stat.S_IMODE(info.st_mode):o}): rein "
                      f"loads native code only from a private folder; remove it (rein makes it again, 0700)")
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _build(compiler: str, flags: tuple[str, ...], out: Path) -> None:
    proc = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise OSError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")


def _checksum_path(library: Path) -> Path:
    return library.with_name(library.name + CHECKSUM_SUFFIX)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_problem(library: Path) -> str | None:
    """Why `library` may not be loaded, or None: it must be a file of this user that only this
    user may write, whose SHA-256 is the one recorded beside it when it was built."""
    info = os.lstat(library)
    if not stat.S_ISREG(info.st_mode):
        return "not a plain file"
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return "owned by another user or writable by others"
    try:
        recorded = _checksum_path(library).read_text().strip()
    except OSError:
        return "no checksum recorded at build time"
    if _sha256(library) != recorded:
        return "its SHA-256 is not the one recorded at build time (changed since)"
    return None


def _disabled_by() -> str:
    """The setting that turns the kernels off, or "": REIN_CPU_KERNELS, REIN_CPU_FAST_PATHS
    (rein.core.settings; both default on)."""
    for name in ("cpu_fast_paths", "cpu_kernels"):
        if not setting_or_default(name):
            return f"REIN_{name.upper()}=0"
    return ""


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _load() -> ctypes.CDLL:
    target = library_path()
    lib = ctypes.CDLL(str(target))
    fn = lib.paged_decode_attention_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, ctypes.c_int, p, i64, p, p, p, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                   ctypes.c_int]
    fn.restype = ctypes.c_int
    lib.paged_prefill_attention_f32.argtypes = [p, p, p, ctypes.c_int, p, i64, p, p, p, p, i64, i64, i64, i64,
                                                i64, i64, ctypes.c_float, i64, ctypes.c_int]
    lib.paged_prefill_attention_f32.restype = ctypes.c_int
    lib.prefill_attention_f32_nr.restype = ctypes.c_int
    f32 = ctypes.c_float
    lib.rms_norm_f32.argtypes = [p, i64, p, f32, p, i64, i64, ctypes.c_int]
    lib.add_rms_norm_f32.argtypes = [p, p, p, f32, p, i64, i64, ctypes.c_int]
    lib.silu_and_mul_f32.argtypes = [p, i64, p, i64, i64, ctypes.c_int]
    lib.rotary_inplace_f32.argtypes = [p, i64, i64, i64, i64, p, p, ctypes.c_int]
    lib.quantized_matmul_f32.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int]
    lib.quantized_matmul_f32.restype = ctypes.c_int
    lib.quantized_matmul_packed_f32.argtypes = [p, i64, p, p, p, p, p, ctypes.c_int, p, p, i64, i64, i64, i64, i64,
                                                i64, ctypes.c_int, ctypes.c_int]
    lib.quantized_matmul_packed_f32.restype = ctypes.c_int
    lib.quantized_panels_mp.restype = ctypes.c_int
    lib.lora_apply_f32.argtypes = [p, i64, p, i64, i64, p, p, i64, i64, i64, i64, i64, p, i64, p, i64, p,
                                   ctypes.c_int]
    lib.lora_apply_f32.restype = ctypes.c_int
    lib.lora_max_chunk.restype = ctypes.c_int
    lib.rotary_store_kv_f32.argtypes = [p, i64, i64, p, i64, p, i64, i64, i64, i64, p, p, p, p, ctypes.c_int, p,
                                        ctypes.c_int]
    for name in ("rms_norm_f32", "add_rms_norm_f32", "silu_and_mul_f32", "rotary_inplace_f32", "rotary_store_kv_f32"):
        getattr(lib, name).restype = None
    lib.rein_instruction_set.restype = ctypes.c_int
    _bind_int8act(lib)
    log.info("native CPU kernels: %s (%s)", target.name, INSTRUCTION_SETS.get(lib.rein_instruction_set()))
    return lib
