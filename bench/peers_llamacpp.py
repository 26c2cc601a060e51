"""llama.cpp as a benchmark peer: the same GGUF file and the same token-id requests as rein, run
by llama.cpp's own continuous batching, for bench/quantized.py.

Two halves in one file, like bench/peers.py + bench/peers_vllm.py do for vLLM:

* the parent side, imported by a bench (stdlib only at module level, so rein's venv imports it):
  `ensure_llamacpp()` makes, once, a virtual environment `llamacpp-venv/` under the cache folder
  (default ~/.cache/rein/bench, outside the checkout) with llama-cpp-python built from source
  from the package index for this CPU (CMAKE_ARGS="-DGGML_NATIVE=ON": AVX2 / AVX-512 as the
  machine has them; a few minutes on 2 cores), and `run_llamacpp()` runs one job in it;
* the child side, `<llamacpp venv>/bin/python bench/peers_llamacpp.py`, which reads one JSON job
  on stdin and writes one JSON result line on stdout. It imports only the stdlib, numpy and
  llama_cpp (never rein, never torch): llama-cpp-python is never a dependency of rein.

The job:

    {"model": "/path/file.gguf", "prompts": [[token ids], ...], "max_tokens": [int per prompt],
     "parallel": P, "threads": T, "n_ctx": N}

    optional: "n_batch" (2048), "n_ubatch" (512), "kv_unified" (false), "keep_tokens" (8),
              "flash_attn" ("auto": llama.cpp's default, on for the CPU; "on"; "off")

"n_ctx" is the context of ONE sequence: at least the longest prompt + its max_tokens (default
exactly that). The context holds P of them (llama.cpp's n_ctx = N * P; without kv_unified it
splits n_ctx evenly into P streams and rounds each up to a multiple of 256). Keep it tight: the
KV cache is zeroed at start-up, so every cell counts in the peak RSS.

The child loads the model, warms it up, then runs every prompt through the low-level API the way
llama.cpp's server slots do: up to P sequences (seq ids 0..P-1) share each `llama_decode` batch,
one token each for those decoding, then chunks of waiting prompts up to n_batch tokens; a
finished sequence's cache is dropped (`llama_memory_seq_rm`) and the next prompt takes its seq id
at the next step. Greedy (argmax of each sequence's logits, numpy), EOS ignored, exactly
max_tokens output tokens per request. Prompts are used as given: no tokenization, no BOS added.

The result line:

    {"output_tokens", "prompt_tokens", "seconds" (the generation loop only), "output_tps",
     "peak_rss_bytes" (VmHWM at the end: this process's own peak; ru_maxrss would count the
     parent's resident pages at the fork too), "load_seconds" (load + warm-up), "version",
     "tokens" (the first keep_tokens output ids of each request), "n_ctx", "n_ctx_seq", ...}

or {"error": "..."}. Check that it works:

    python bench/peers_llamacpp.py --selftest MODEL.gguf [--python PATH] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMACPP_VERSION = "0.3.36"
LLAMACPP_REQUIREMENT = f"llama-cpp-python=={LLAMACPP_VERSION}"
# GGML_NATIVE: build for this CPU (-march=native). LLAVA_BUILD off: the multimodal library is
# not needed for text and only lengthens the build.
CMAKE_ARGS = "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
VENV_NAME = "llamacpp-venv"
READY_MARKER = "peers-ready"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "rein" / "bench"

# llama.cpp's own defaults (and rein's max_num_batched_tokens): tokens per llama_decode call,
# and per physical micro-batch.
N_BATCH, N_UBATCH = 2048, 512
KEEP_TOKENS = 8
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}   # llama_flash_attn_type
# llama.cpp's own default, "auto", which turns flash attention on for the CPU: about 7% faster
# prefill and 14% faster decode steps at parallel 8 and 32 on SmolLM2 (2 threads; the same at
# parallel 1). Its CPU kernel sums softmax(QK)V in f16, though, and its rounding depends on what
# else is in the batch: prompt logits moved by up to 0.76 (std 2.2) with other prompts beside
# them, enough to flip near-tied greedy tokens (parallel 1 and 8 differed on 11 of 32
# random-token requests). With "off" (and kv_unified false) the logits are bit-identical
# whatever the batch, and all 32 agree over 64 tokens: use it to compare tokens across runs.
FLASH_ATTN_DEFAULT = "auto"


# --------------------------------------------------------------------------- parent side


def pip_install_llamacpp(venv: Path, log_path: Path) -> str | None:
    """Create `venv` and build llama-cpp-python into it; None when it worked, else why not."""
    print(f"# building {LLAMACPP_REQUIREMENT} from source into {venv} (once; minutes) ...", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    python = str(venv / "bin" / "python")
    # -I (isolated) here and for every child: neither the working folder nor a script's folder
    # goes on sys.path, where a stray file (a /tmp/types.py once broke pip) shadows the stdlib.
    # --no-binary: the index's wheels (if any) are generic builds; --no-cache-dir: pip's wheel
    # cache is keyed by the sdist, not by CMAKE_ARGS, so it could hand back a build made with
    # other flags.
    steps = [
        [base, "-I", "-m", "venv", str(venv)],
        [python, "-I", "-m", "pip", "install", "--upgrade", "pip"],
        [python, "-I", "-m", "pip", "install", "--no-cache-dir", "--no-binary", "llama-cpp-python", "-v",
         LLAMACPP_REQUIREMENT, "numpy"],
    ]
    env = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    with open(log_path, "w") as out:
        for cmd in steps:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
            if rc != 0:
                return f"`{' '.join(cmd[3:])}` failed (rc {rc}); see {log_path}"
    return None


def probe_llamacpp(python: str) -> str | None:
    """None when llama_cpp and numpy import with `python`, else why not."""
    try:
        probe = subprocess.run([python, "-I", "-c", "import numpy, llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import llama_cpp` fails with {python}: {last}"
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident bytes since its exec (VmHWM). Not ru_maxrss: Linux carries a
    forked child's starting RSS -- its parent's, a benchmark driver holding a tokenizer and torch
    -- into the child's ru_maxrss across exec, which put a floor under every child's figure."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def ensure_llamacpp(python: str | None, cache_dir: Path = DEFAULT_CACHE_DIR) -> tuple[str | None, str | None]:
    """(the python of a venv where llama_cpp imports, None) or (None, why not).

    With `python` given, only checks it. Otherwise builds cache_dir/llamacpp-venv once and
    reuses it while its marker names the pinned version and `import llama_cpp` works."""
    if python is not None:
        why = probe_llamacpp(python)
        return (None, why) if why else (python, None)
    cache_dir = Path(cache_dir).expanduser()
    venv = cache_dir / VENV_NAME
    python = str(venv / "bin" / "python")
    marker = venv / READY_MARKER
    wanted = f"{LLAMACPP_REQUIREMENT} CMAKE_ARGS={CMAKE_ARGS}\n"
    if marker.is_file() and marker.read_text() == wanted and probe_llamacpp(python) is None:
        return python, None
    if venv.exists():
        shutil.rmtree(venv)   # half-made (interrupted build), another version, or broken
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = cache_dir / "llamacpp-install.log"
    t = time.perf_counter()
    why = pip_install_llamacpp(venv, log_path)
    if why:
        return None, why
    why = probe_llamacpp(python)
    if why:
        return None, f"{why}; build log: {log_path}"
    marker.write_text(wanted)
    print(f"#   built in {time.perf_counter() - t:.0f}s (log: {log_path})", flush=True)
    return python, None


def run_llamacpp(python: str, job: dict, timeout: float) -> dict:
    """Run one job (see the module docstring) in a child process with `python`; its result, or
    {"error": "..."} with the end of the child's stderr."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)   # rein's paths mean nothing to the llama.cpp venv
    env.pop("VIRTUAL_ENV", None)
    try:
        proc = subprocess.run([python, "-I", str(Path(__file__).resolve())], input=json.dumps(job),
                              capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir(),
                              env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"llama.cpp did not finish in {timeout:.0f}s"}
    except OSError as exc:
        return {"error": f"cannot start {python}: {exc}"}
    result = None
    lines = proc.stdout.strip().splitlines()
    if lines:
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            pass
    tail = " | ".join(proc.stderr.strip().splitlines()[-5:])
    if not isinstance(result, dict):
        return {"error": f"llama.cpp child failed (rc {proc.returncode}) with no result: {tail}"}
    if proc.returncode != 0 and "error" not in result:
        result = {"error": f"llama.cpp child exited with rc {proc.returncode}: {tail}"}
    if "error" in result and tail:
        result["stderr_tail"] = tail
    return result


# --------------------------------------------------------------------------- child side


class JobError(Exception):
    """A job the child cannot run as given; the message says what to change."""


def check_job(job: dict) -> dict:
    """The job with its defaults filled in, or JobError."""
    prompts, max_tokens = job.get("prompts"), job.get("max_tokens")
    if not isinstance(prompts, list) or not isinstance(max_tokens, list) or len(prompts) != len(max_tokens):
        raise JobError("`prompts` and `max_tokens` must be lists of the same length")
    if any(not p for p in prompts):
        raise JobError("every prompt needs at least one token")
    if any(m < 0 for m in max_tokens):
        raise JobError("max_tokens must be >= 0")
    parallel = int(job.get("parallel", 1))
    if parallel < 1:
        raise JobError(f"parallel must be >= 1, not {parallel}")
    longest = max((len(p) + m for p, m in zip(prompts, max_tokens, strict=True)), default=1)
    n_ctx = int(job.get("n_ctx") or longest)
    if n_ctx < longest:
        raise JobError(f"n_ctx {n_ctx} (the context of one sequence) is less than the longest request, "
                       f"{longest} tokens (prompt + max_tokens): raise n_ctx to at least {longest}")
    n_batch = int(job.get("n_batch", N_BATCH))
    n_ubatch = int(job.get("n_ubatch", min(N_UBATCH, n_batch)))
    if n_batch < parallel:
        raise JobError(f"n_batch {n_batch} must hold one token of each of the {parallel} sequences")
    flash_attn = job.get("flash_attn", FLASH_ATTN_DEFAULT)
    if flash_attn not in FLASH_ATTN:
        raise JobError(f"flash_attn must be one of {', '.join(FLASH_ATTN)}, not {flash_attn!r}")
    return dict(job, parallel=parallel, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                threads=int(job.get("threads", os.cpu_count() or 1)), kv_unified=bool(job.get("kv_unified")),
                keep_tokens=int(job.get("keep_tokens", KEEP_TOKENS)), flash_attn=flash_attn)


class Sequence:
    """One request while it holds a seq id: its prompt still to feed, its KV length, its output."""

    def __init__(self, index: int, seq_id: int, prompt: list[int], max_tokens: int) -> None:
        self.index, self.seq_id, self.max_tokens = index, seq_id, max_tokens
        self.pending = list(prompt)   # tokens not yet in the cache; after the prompt, the last output
        self.pos = 0                  # tokens in the cache
        self.output: list[int] = []

    @property
    def prefilling(self) -> bool:
        return not self.output


class Llama:
    """The model, its context and one batch, over llama_cpp's low-level (C) API."""

    def __init__(self, job: dict) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        model_params = lc.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = lc.llama_model_load_from_file(job["model"].encode(), model_params)
        if not self.model:
            raise JobError(f"llama.cpp cannot load {job['model']}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        params = lc.llama_context_default_params()
        params.n_seq_max = job["parallel"]
        params.n_ctx = job["n_ctx"] * job["parallel"]
        params.n_batch, params.n_ubatch = job["n_batch"], job["n_ubatch"]
        params.n_threads = params.n_threads_batch = job["threads"]
        params.kv_unified = job["kv_unified"]
        # See FLASH_ATTN_DEFAULT: "auto" is the faster, "off" the batch-invariant.
        params.flash_attn_type = FLASH_ATTN[job["flash_attn"]]
        # As llama-server does: sliding-window layers (Gemma 3) keep only their window, not n_ctx.
        params.swa_full = False
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise JobError("llama.cpp cannot make the context (n_ctx * parallel too large?)")
        self.memory = lc.llama_get_memory(self.ctx)
        self.n_batch = job["n_batch"]
        self.batch = lc.llama_batch_init(self.n_batch, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(self.n_batch,))
        self.positions = np.ctypeslib.as_array(self.batch.pos, shape=(self.n_batch,))
        self.n_seq_ids = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.n_batch,))
        self.wants_logits = np.ctypeslib.as_array(self.batch.logits, shape=(self.n_batch,))
        self.n_seq_ids[:] = 1

    def decode(self, parts: list[tuple[int, int, list[int], bool]]) -> list[int]:
        """One llama_decode of (seq id, first position, tokens, logits for the last?) parts; the
        argmax token of each part that asked for logits, in order."""
        n, outputs = 0, []
        for seq_id, pos, tokens, logits in parts:
            k = len(tokens)
            self.tokens[n:n + k] = tokens
            self.positions[n:n + k] = range(pos, pos + k)
            self.wants_logits[n:n + k] = 0
            for i in range(n, n + k):
                self.batch.seq_id[i][0] = seq_id
            n += k
            if logits:
                self.wants_logits[n - 1] = 1
                outputs.append(n - 1)
        self.batch.n_tokens = n
        rc = self.lc.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise JobError(f"llama_decode returned {rc} on a batch of {n} tokens "
                           "(1: no room in the KV cache: raise n_ctx)")
        np = self.np
        return [int(np.ctypeslib.as_array(self.lc.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())
                for i in outputs]

    def forget(self, seq_id: int) -> None:
        """Drop a sequence's whole cache, so its seq id can start a new prompt at position 0."""
        self.lc.llama_memory_seq_rm(self.memory, seq_id, -1, -1)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def schedule(running: list[Sequence], n_batch: int) -> list[tuple[Sequence, int]]:
    """What the next llama_decode carries, as (sequence, tokens of its pending list): one token
    of every decoding sequence first, then prompt chunks in arrival order while n_batch allows
    (llama-server's order, so decoding never waits behind a long prompt)."""
    plan = [(s, 1) for s in running if not s.prefilling]
    budget = n_batch - len(plan)
    for s in running:
        if s.prefilling and budget > 0:
            take = min(len(s.pending), budget)
            plan.append((s, take))
            budget -= take
    return plan


def generate(llama: Llama, prompts: list[list[int]], max_tokens: list[int], parallel: int) -> list[list[int]]:
    """Every request's greedy output, up to `parallel` of them decoding together."""
    outputs: list[list[int]] = [[] for _ in prompts]
    queue = [i for i in range(len(prompts)) if max_tokens[i] > 0]
    queue.reverse()   # pop() from the end takes them in arrival order
    free_ids = list(range(parallel - 1, -1, -1))
    running: list[Sequence] = []
    while queue or running:
        while queue and free_ids:
            i = queue.pop()
            running.append(Sequence(i, free_ids.pop(), prompts[i], max_tokens[i]))
        plan = schedule(running, llama.n_batch)
        parts = [(s, take, take == len(s.pending)) for s, take in plan]
        tokens = llama.decode([(s.seq_id, s.pos, s.pending[:take], last) for s, take, last in parts])
        for s, take, _ in parts:
            s.pos += take
            del s.pending[:take]
        for s, token in zip((s for s, _, last in parts if last), tokens, strict=True):
            s.output.append(token)
            s.pending = [token]
        for s in [s for s in running if len(s.output) == s.max_tokens]:
            outputs[s.index] = s.output
            llama.forget(s.seq_id)
            free_ids.append(s.seq_id)
            running.remove(s)
    return outputs


def run_job(job: dict) -> dict:
    """Load, warm up, generate; the result dict (see the module docstring)."""
    import llama_cpp

    job = check_job(job)
    t0 = time.perf_counter()
    llama = Llama(job)
    try:
        bad = [t for p in job["prompts"] for t in p if not 0 <= t < llama.n_vocab]
        if bad:
            raise JobError(f"token id {bad[0]} is outside the model's vocabulary of {llama.n_vocab}")
        # One short request first, so one-off costs (first graph, buffers) stay out of the clock.
        generate(llama, [job["prompts"][0][:8]], [2], 1)
        llama.lc.llama_memory_clear(llama.memory, True)
        load_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        outputs = generate(llama, job["prompts"], job["max_tokens"], job["parallel"])
        seconds = time.perf_counter() - t1
        n_ctx, n_ctx_seq = llama.lc.llama_n_ctx(llama.ctx), llama.lc.llama_n_ctx_seq(llama.ctx)
    finally:
        llama.close()
    output_tokens = sum(len(o) for o in outputs)
    return {
        "output_tokens": output_tokens,
        "prompt_tokens": sum(len(p) for p in job["prompts"]),
        "seconds": seconds,
        "output_tps": output_tokens / seconds if seconds > 0 else None,
        "peak_rss_bytes": peak_rss_bytes(),
        "load_seconds": load_seconds,
        "version": llama_cpp.__version__,
        "tokens": [o[:job["keep_tokens"]] for o in outputs],
        "requests": len(job["prompts"]), "parallel": job["parallel"], "threads": job["threads"],
        "n_ctx": n_ctx, "n_ctx_seq": n_ctx_seq, "n_batch": job["n_batch"], "n_ubatch": job["n_ubatch"],
        "kv_unified": job["kv_unified"], "flash_attn": job["flash_attn"],
    }


def child_main() -> int:
    """Read one job on stdin, write one JSON line on stdout."""
    # Started as `python bench/peers_llamacpp.py`, bench/ heads sys.path, and its scripts'
    # names (batch, load, models, ...) could shadow modules numpy or llama_cpp import.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    # llama.cpp's C code may print on fd 1; keep fd 1 for the result line alone.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        result = run_job(json.loads(sys.stdin.read()))
        rc = 0
    except JobError as exc:
        result, rc = {"error": str(exc)}, 1
    except Exception as exc:   # report it as a result: the parent shows it in its table
        result, rc = {"error": f"{type(exc).__name__}: {exc}"}, 1
    sys.stdout.flush()
    with os.fdopen(result_fd, "w") as out:
        out.write(json.dumps(result, separators=(",", ":")) + "\n")
    return rc


# --------------------------------------------------------------------------- self-test


def selftest(argv: list[str]) -> int:
    """Build (or reuse) the venv and run a tiny job through run_llamacpp."""
    ap = argparse.ArgumentParser(description="run a tiny llama.cpp job on MODEL.gguf and print the result")
    ap.add_argument("--selftest", required=True, metavar="MODEL.gguf")
    ap.add_argument("--python", default=None, help="python of an existing venv with llama-cpp-python")
    ap.add_argument("--cache-dir", default=str(DEFAULT_CACHE_DIR), help="where the venv is made once")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    python, why = ensure_llamacpp(args.python, Path(args.cache_dir))
    if why:
        print(f"llama.cpp unavailable: {why}")
        return 1
    job = {"model": str(Path(args.selftest).resolve()), "prompts": [[100, 200, 300, 400], [7, 8, 9], [1000, 42]],
           "max_tokens": [8, 8, 8], "parallel": 2, "threads": args.threads, "n_ctx": 64}
    result = run_llamacpp(python, job, timeout=600)
    for key, value in result.items():
        print(f"{key}: {json.dumps(value)}")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    if "--selftest" in sys.argv:
        sys.exit(selftest(sys.argv[1:]))
    sys.exit(child_main())
