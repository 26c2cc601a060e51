"""Micro-benchmarks of rein's Triton paged-attention kernels on one CUDA GPU.

    python bench/attention_kernels.py [--peak-gbps GBPS] [--iters N] [--quick] [--no-flush]
                            [--no-engine] [--models-dir DIR] [--unfused-elementwise]

Measured (each figure printed as it is taken; the last line of stdout is one JSON object
holding all of them):

* decode: `triton_ops.paged_decode_attention` against the torch reference
  (`reference.paged_decode_attention`, gather + SDPA) and against
  `scaled_dot_product_attention` on K/V already contiguous ([B, kv_heads, L, d], the GQA
  group folded into the query length, the best case for SDPA), over batch {1, 8, 64, 256}
  x context {128, 1k, 4k, 32k}; 32 query heads, 8 KV heads (GQA 4), head_dim 128, bf16,
  block size 16, each request's blocks scattered over the cache. Achieved bandwidth = K/V
  bytes read / kernel time, also as a share of the device's peak HBM bandwidth. Combos
  whose tensors do not fit in free memory are skipped (per implementation).
* prefill: `paged_prefill_attention` vs causal SDPA (contiguous, enable_gqa) for a few
  prompt lengths, plus a chunk-after-prefix case SDPA cannot express with is_causal.
* int8 vs bf16 cache for decode (same shapes), and store_kv for both cache dtypes.
* engine (unless --no-engine): end-to-end LLMEngine output tokens/s, bf16 weights, bf16 and
  int8 KV cache, 256 requests of 128 random prompt tokens and 128 output tokens each
  (greedy, ignore_eos; 64 requests with --quick), all added at once, max_num_seqs 256, the
  default 2048-token step budget, the same kv_cache_memory for both caches (the bf16
  cache's need for the whole workload + 10%). Two random-weight models, built once into
  --models-dir: the tiny llama of `rein.fixtures.tiny_model` (2 layers, hidden 64) and a model of
  Qwen2.5-0.5B's shapes (Qwen2ForCausalLM: hidden 896, 24 layers, 14 heads, 2 KV heads,
  head_dim 64, intermediate 4864, tied embeddings, q/k/v bias) but the tiny 2048-token
  vocabulary and tokenizer instead of 151936, so its embedding is 1.8M parameters, not
  136M (360M parameters in all instead of 494M; the transformer layers are the same).
  tokens/s = output tokens / wall time from adding the requests to the last token, after
  a warm-up run (which also compiles the kernels): mixed prompt lengths, then the timed
  prompts with 8 output tokens. For the steps that only decode, the
  achieved memory bandwidth is approximated as (weight bytes + K/V bytes read) / step time:
  weight bytes = every parameter once in bf16 (an untied input embedding is left out:
  only its looked-up rows are read); K/V bytes = the context length of every request in
  the step x bytes per token of the cache (K and V, all layers, int8 scales included);
  activations, logits and the new token's K/V write are ignored. Two step times: the
  runner's whole `execute` (host-side input building + forward + logits; synchronized
  before and after, which adds a sync the sampler would do anyway) and the model forward
  alone (CUDA events around it; includes the GPU idle gaps while Python launches kernels;
  only in eager runs, since a replayed graph calls no forward). Each model and cache runs
  twice: with the decode CUDA graphs (the default) and with enforce_eager, printed as
  the ratio of their tokens/s.

Timing: CUDA events around each launch, after warm-up (which also compiles the kernels),
median of --iters; the L2 cache is flushed before every timed launch (--no-flush to keep
it) because in a model each layer's K/V is cold. Everything finishes in < 5 minutes on an
H100/H200; a deadline skips what is left if a slow machine runs over (the kernel sections
stop ENGINE_RESERVE_S early to leave the engine figures their time).

Without CUDA (or without triton) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
DTYPE_NAME = str(DTYPE).removeprefix("torch.")
DEADLINE_S = 270.0  # leave head-room under the 5-minute budget
ENGINE_RESERVE_S = 150.0  # of DEADLINE_S, kept for the engine figures (each model and cache with and without CUDA graphs)

# Peak HBM bandwidth in GB/s by device-name substring; first match wins, so more specific
# names come first ("GH200" contains "H200", "H100 PCIe" contains "H100").
PEAK_GBPS = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB", 1935.0),  # PCIe
    ("A100", 1555.0),  # 40GB
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
]


def peak_gbps_for(name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key.lower() in name.lower():
            return gbps
    return None


class Timer:
    """Median kernel time with CUDA events; optional L2 flush before each timed launch."""

    def __init__(self, iters: int, warmup: int, flush: bool, deadline: float):
        self.iters, self.warmup, self.deadline = iters, warmup, deadline
        # 256 MiB > any current L2 (H100 50 MB, H200 60 MB, B200 126 MB).
        self.flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda") if flush else None

    def __call__(self, fn, *args, **kwargs) -> float:
        """Microseconds per call of fn(*args, **kwargs) (median)."""
        if args or kwargs:
            fn = functools.partial(fn, *args, **kwargs)
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        # Fewer iterations for slow calls so the whole script stays within budget.
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one = time.perf_counter() - t0
        iters = max(3, min(self.iters, int(0.5 / max(one, 1e-6))))
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(iters)]
        for start, end in pairs:
            if self.flush_buf is not None:
                self.flush_buf.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e3

    def expired(self) -> bool:
        return time.perf_counter() > self.deadline


def free_bytes() -> int:
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def make_paged(batch: int, ctx: int, cache_dtype: torch.dtype, gen: torch.Generator):
    """K/V cache holding `batch` requests of `ctx` tokens in shuffled blocks, + block tables."""
    blocks_per_req = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    if cache_dtype == torch.int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
        v = torch.randint(-127, 128, shape, dtype=torch.int8, device="cuda", generator=gen)
        ks = torch.rand(shape[:3], device="cuda", generator=gen) / 64
        vs = torch.rand(shape[:3], device="cuda", generator=gen) / 64
    else:
        k = torch.empty(shape, dtype=cache_dtype, device="cuda").normal_(generator=gen)
        v = torch.empty(shape, dtype=cache_dtype, device="cuda").normal_(generator=gen)
        ks = vs = None
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(batch, blocks_per_req)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return k, v, ks, vs, tables, lens


def kv_bytes(batch: int, ctx: int, cache_dtype: torch.dtype) -> int:
    per_token = 2 * NUM_KV_HEADS * HEAD_DIM * torch.empty((), dtype=cache_dtype).element_size()
    if cache_dtype == torch.int8:
        per_token += 2 * NUM_KV_HEADS * 4  # scales
    return batch * ctx * per_token


def fmt(us: float | None) -> str:
    return f"{us:9.1f}us" if us is not None else "      -    "


def bench_decode(timer: Timer, peak: float, quick: bool, gen: torch.Generator, results: dict):
    from rein.kernels import reference, triton_ops

    batches = [1, 8, 64, 256]
    contexts = [128, 1024, 4096, 32768]
    if quick:
        batches, contexts = [1, 64], [1024, 32768]
    scale = HEAD_DIM ** -0.5
    print(f"\n== decode: {NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, d={HEAD_DIM}, {DTYPE_NAME}, "
          f"block {BLOCK_SIZE}; peak {peak:.0f} GB/s")
    print(f"{'batch':>6} {'ctx':>6} {'triton':>11} {'GB/s':>7} {'%peak':>6} {'reference':>11} "
          f"{'sdpa':>11} {'sdpa %pk':>8} {'max err':>8}")
    for batch in batches:
        for ctx in contexts:
            row = {"batch": batch, "context": ctx}
            nbytes = kv_bytes(batch, ctx, DTYPE)
            if timer.expired():
                row["skipped"] = "time budget"
                results["decode"].append(row)
                continue
            if nbytes * 1.1 > free_bytes():
                row["skipped"] = "cache exceeds free memory"
                print(f"{batch:>6} {ctx:>6} skipped: {nbytes / 1e9:.1f} GB cache exceeds free memory")
                results["decode"].append(row)
                continue
            k, v, _, _, tables, lens = make_paged(batch, ctx, DTYPE, gen)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
            out = triton_ops.paged_decode_attention(q, k, v, tables, lens, scale)
            t_tri = timer(triton_ops.paged_decode_attention, q, k, v, tables, lens, scale)
            row.update(triton_us=t_tri, triton_gbps=nbytes / t_tri / 1e3,
                       triton_pct_peak=100 * nbytes / t_tri / 1e3 / peak, kv_bytes=nbytes)
            # The reference gathers K and V (2 copies), SDPA's mask path may copy again.
            if nbytes * 3.5 < free_bytes():
                want = reference.paged_decode_attention(q, k, v, tables, lens, scale)
                row["max_abs_err"] = (out.float() - want.float()).abs().max().item()
                del want
                row["reference_us"] = timer(reference.paged_decode_attention, q, k, v, tables, lens, scale)
            if nbytes * 1.2 < free_bytes():
                # Contiguous [B, kvh, L, d] K/V; the query group becomes SDPA's query length,
                # so K/V are read once (no mask: every request has the full context).
                kc = k.view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
                vc = v.view(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :ctx].transpose(1, 2).contiguous()
                # The tables are a permutation, so the view above is not the requests' own
                # data; irrelevant for timing.
                qg = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)
                sdpa = torch.nn.functional.scaled_dot_product_attention
                t = timer(sdpa, qg, kc, vc, scale=scale)
                row.update(sdpa_us=t, sdpa_gbps=nbytes / t / 1e3, sdpa_pct_peak=100 * nbytes / t / 1e3 / peak)
                del kc, vc
            print(f"{batch:>6} {ctx:>6} {fmt(t_tri)} {row['triton_gbps']:7.0f} "
                  f"{row['triton_pct_peak']:5.1f}% {fmt(row.get('reference_us'))} "
                  f"{fmt(row.get('sdpa_us'))} "
                  f"{row.get('sdpa_pct_peak', float('nan')):7.1f}% "
                  f"{row.get('max_abs_err', float('nan')):8.1e}")
            results["decode"].append(row)
            del k, v, tables, lens, q, out


def bench_int8(timer: Timer, peak: float, quick: bool, gen: torch.Generator, results: dict):
    from rein.kernels import triton_ops

    combos = [(8, 32768), (64, 4096), (256, 1024)] if not quick else [(64, 4096)]
    scale = HEAD_DIM ** -0.5
    print(f"\n== decode: int8 cache vs {DTYPE_NAME} cache (triton)")
    print(f"{'batch':>6} {'ctx':>6} {DTYPE_NAME:>11} {'int8':>11} {'speedup':>8} {'int8 GB/s':>10} {'%peak':>6}")
    for batch, ctx in combos:
        row = {"batch": batch, "context": ctx}
        if timer.expired():
            row["skipped"] = "time budget"
            results["int8_vs_bf16"].append(row)
            continue
        if (kv_bytes(batch, ctx, DTYPE) + kv_bytes(batch, ctx, torch.int8)) * 1.1 > free_bytes():
            row["skipped"] = "cache exceeds free memory"
            results["int8_vs_bf16"].append(row)
            continue
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        for name, dtype in (("bf16", DTYPE), ("int8", torch.int8)):
            k, v, ks, vs, tables, lens = make_paged(batch, ctx, dtype, gen)
            t = timer(triton_ops.paged_decode_attention, q, k, v, tables, lens, scale, ks, vs)
            nbytes = kv_bytes(batch, ctx, dtype)
            row[f"{name}_us"] = t
            row[f"{name}_gbps"] = nbytes / t / 1e3
            row[f"{name}_pct_peak"] = 100 * nbytes / t / 1e3 / peak
            del k, v, ks, vs
        row["int8_speedup"] = row["bf16_us"] / row["int8_us"]
        print(f"{batch:>6} {ctx:>6} {fmt(row['bf16_us'])} {fmt(row['int8_us'])} "
              f"{row['int8_speedup']:7.2f}x {row['int8_gbps']:10.0f} {row['int8_pct_peak']:5.1f}%")
        results["int8_vs_bf16"].append(row)


def bench_prefill(timer: Timer, quick: bool, gen: torch.Generator, results: dict):
    from rein.kernels import reference, triton_ops

    # (requests, chunk length, prefix length)
    cases = [(1, 512, 0), (1, 2048, 0), (1, 8192, 0), (4, 2048, 0), (1, 2048, 6144)]
    if quick:
        cases = [(1, 2048, 0), (1, 2048, 6144)]
    scale = HEAD_DIM ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print(f"\n== prefill: causal, {DTYPE_NAME}, GQA {NUM_HEADS // NUM_KV_HEADS}, d={HEAD_DIM} "
          "(TFLOP/s counts only unmasked pairs)")
    print(f"{'reqs':>5} {'chunk':>6} {'prefix':>6} {'triton':>11} {'TFLOP/s':>8} {'sdpa':>11} "
          f"{'TFLOP/s':>8} {'reference':>11} {'max err':>8}")
    for reqs, chunk, prefix in cases:
        row = {"requests": reqs, "chunk": chunk, "prefix": prefix}
        if timer.expired():
            row["skipped"] = "time budget"
            results["prefill"].append(row)
            continue
        ctx = prefix + chunk
        k, v, _, _, tables, lens = make_paged(reqs, ctx, DTYPE, gen)
        q = torch.randn(reqs * chunk, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        cu = torch.arange(0, reqs + 1, dtype=torch.int32, device="cuda") * chunk
        pairs = reqs * (chunk * (chunk + 1) // 2 + chunk * prefix)
        flops = 4 * NUM_HEADS * HEAD_DIM * pairs
        out = triton_ops.paged_prefill_attention(q, k, v, tables, cu, lens, scale)
        t_tri = timer(triton_ops.paged_prefill_attention, q, k, v, tables, cu, lens, scale)
        row.update(triton_us=t_tri, triton_tflops=flops / t_tri / 1e6)
        if ctx <= 8192:
            want = reference.paged_prefill_attention(q, k, v, tables, cu, lens, scale)
            row["max_abs_err"] = (out.float() - want.float()).abs().max().item()
            del want
            row["reference_us"] = timer(reference.paged_prefill_attention, q, k, v, tables, cu, lens, scale)
        if prefix == 0:
            qs = q.view(reqs, chunk, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
            kc = torch.randn(reqs, NUM_KV_HEADS, chunk, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
            vc = torch.randn_like(kc)
            t = timer(sdpa, qs, kc, vc, is_causal=True, scale=scale, enable_gqa=True)
            row.update(sdpa_us=t, sdpa_tflops=flops / t / 1e6)
            del qs, kc, vc
        print(f"{reqs:>5} {chunk:>6} {prefix:>6} {fmt(t_tri)} {row['triton_tflops']:8.1f} "
              f"{fmt(row.get('sdpa_us'))} {row.get('sdpa_tflops', float('nan')):8.1f} "
              f"{fmt(row.get('reference_us'))} {row.get('max_abs_err', float('nan')):8.1e}")
        results["prefill"].append(row)
        del k, v, q, out


def bench_store(timer: Timer, gen: torch.Generator, results: dict):
    from rein.kernels import triton_ops

    tokens = 8192
    print(f"\n== store_kv: {tokens} tokens, {NUM_KV_HEADS} kv heads, d={HEAD_DIM}")
    for name, dtype in (("bf16", DTYPE), ("int8", torch.int8)):
        if timer.expired():
            results["store"].append({"cache": name, "skipped": "time budget"})
            continue
        k, v, ks, vs, _, _ = make_paged(1, 2 * tokens, dtype, gen)
        key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda", generator=gen)
        val = torch.randn_like(key)
        slots = torch.randperm(2 * tokens, device="cuda", generator=gen)[:tokens]
        t = timer(triton_ops.store_kv, key, val, k, v, slots, ks, vs)
        moved = 2 * key.numel() * key.element_size() + kv_bytes(tokens, 1, dtype)
        print(f"  {name}: {fmt(t)}  {moved / t / 1e3:7.0f} GB/s (read + written)")
        results["store"].append({"cache": name, "tokens": tokens, "us": t, "gbps": moved / t / 1e3})
        del k, v, ks, vs


# --------------------------------------------------------------------------- engine

ENGINE_REQUESTS, ENGINE_PROMPT_LEN, ENGINE_OUTPUT_LEN = 256, 128, 128
ENGINE_MAX_MODEL_LEN = 512
ENGINE_RUN_MIN_S = 20.0  # do not start an engine run (load, warm-up, run) with less time left
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json")
# Qwen2.5-0.5B's transformer shapes; the vocabulary stays the tiny tokenizer's.
QWEN2_05B_SHAPE = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
                   "num_key_value_heads": 2, "intermediate_size": 4864}


def ensure_tiny_llama(models_dir: Path) -> Path:
    from rein.fixtures.tiny_model import ensure_tiny_model

    return ensure_tiny_model(models_dir / "llama-tiny", arch="llama", seed=0, preset="tiny")


def ensure_qwen2_05b_shape(models_dir: Path, tokenizer_dir: Path, device: str) -> Path:
    """A random bf16 Qwen2ForCausalLM with Qwen2.5-0.5B's shapes and the tiny vocabulary."""
    path = models_dir / "qwen2-0.5b-shape-vocab2048"
    if not all((path / f).exists() for f in MODEL_FILES):
        print(f"# building a Qwen2.5-0.5B-shaped random model into {path} ...", flush=True)
    return build_qwen2_model(path, tokenizer_dir, device, QWEN2_05B_SHAPE, torch.bfloat16)


def build_qwen2_model(path: Path, tokenizer_dir: Path, device: str, shape: dict, dtype: torch.dtype) -> Path:
    """A random-weight Qwen2ForCausalLM of `shape` (Qwen2Config fields; the vocabulary is the
    tokenizer's unless `shape` gives vocab_size) in `path`, unless one is there already.

    Built by transformers' own class (so it is a regular checkpoint), on the meta device
    and then materialised on `device`, where the random init is fast; N(0, 0.02) weights
    and biases, norms at 1, embeddings tied. Tokenizer and generation config come from
    `tokenizer_dir`. bench/gpu_decode.py builds its models here too.
    """
    import shutil

    import transformers

    if all((path / f).exists() for f in MODEL_FILES):
        return path
    tiny = json.loads((tokenizer_dir / "config.json").read_text())
    config = transformers.Qwen2Config(**{
        "vocab_size": tiny["vocab_size"], "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True, "use_sliding_window": False, "initializer_range": 0.02,
        "bos_token_id": tiny["bos_token_id"], "eos_token_id": tiny["eos_token_id"],
        "pad_token_id": tiny["pad_token_id"], **shape})
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    model.tie_weights()  # to_empty gives lm_head its own storage; share the embedding again
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    del model
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, tmp / name)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)  # only a complete directory is ever reused
    return path


class DecodeProbe:
    """Per engine step: runner.execute time (synchronized) and the model forward time (CUDA
    events); kept for steps that only decode, with their batch and total context length."""

    def __init__(self, engine) -> None:
        self.runner = engine.runner
        self.cuda = self.runner.device.type == "cuda"
        self.records: list[tuple[int, int, float, object, object]] = []
        self._events: list = []

    def __enter__(self) -> DecodeProbe:
        execute, forward = self.runner.execute, self.runner.model.forward

        def timed_execute(scheduled):
            self._sync()
            self._events = []
            start = time.perf_counter()
            result = execute(scheduled)
            self._sync()
            seconds = time.perf_counter() - start
            if all(s.num_new_tokens == 1 for s in scheduled):
                events = self._events if len(self._events) == 2 else (None, None)
                self.records.append((len(scheduled), sum(s.end for s in scheduled), seconds, *events))
            return result

        def timed_forward(*args, **kwargs):
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                hidden = forward(*args, **kwargs)
                end.record()
                self._events = [begin, end]
                return hidden
            return forward(*args, **kwargs)

        # Instance attributes shadow the methods (the engine calls self.runner.execute and
        # nn.Module.__call__ looks up self.forward); removed again on exit.
        self.runner.execute = timed_execute
        self.runner.model.forward = timed_forward
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute
        del self.runner.model.forward

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def summary(self, weight_bytes: int, kv_bytes_per_token: int, peak: float) -> dict:
        if not self.records:
            return {"decode_steps": 0}
        steps = len(self.records)
        seconds = sum(r[2] for r in self.records)
        nbytes = sum(weight_bytes + r[1] * kv_bytes_per_token for r in self.records)
        out = {
            "decode_steps": steps,
            "decode_mean_batch": sum(r[0] for r in self.records) / steps,
            "decode_tokens_per_s": sum(r[0] for r in self.records) / seconds,
            "decode_step_ms": 1e3 * seconds / steps,
            "decode_gb_per_step": nbytes / steps / 1e9,
            "decode_step_gbps": nbytes / seconds / 1e9,
            "decode_step_pct_peak": 100 * nbytes / seconds / 1e9 / peak,
        }
        timed = [r for r in self.records if r[3] is not None]
        if timed:
            fwd_s = sum(r[3].elapsed_time(r[4]) for r in timed) / 1e3
            fwd_bytes = sum(weight_bytes + r[1] * kv_bytes_per_token for r in timed)
            out.update(forward_ms=1e3 * fwd_s / len(timed), forward_gbps=fwd_bytes / fwd_s / 1e9,
                       forward_pct_peak=100 * fwd_bytes / fwd_s / 1e9 / peak)
        return out


def num(x: float | None, spec: str) -> str:
    """`x` formatted (a trailing % in `spec` is printed after it), or a dash of the same
    width when it was not measured."""
    suffix = "%" if spec.endswith("%") else ""
    spec = spec.removesuffix("%")
    return format(x, spec) + suffix if x is not None else "-".rjust(int(spec.split(".")[0]) + len(suffix))


def engine_generate(engine, prompts: list[list[int]], output_len: int) -> int:
    """All requests up front (greedy, ignore_eos), step() until done; output tokens made."""
    from rein.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    produced = 0
    while engine.has_unfinished():
        produced += sum(len(out.new_token_ids) for out in engine.step())
    return produced


def engine_run(model_dir: Path, kv_cache_dtype: str, prompts: list[list[int]], output_len: int,
               kv_memory: int, peak: float, enforce_eager: bool = False) -> dict:
    import gc
    import random

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=str(model_dir), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=kv_memory, max_model_len=ENGINE_MAX_MODEL_LEN,
        max_num_seqs=ENGINE_REQUESTS, seed=0, enforce_eager=enforce_eager))
    try:
        spec = engine.spec
        # Warm-up: mixed prompt lengths (chunked prefill, prefill + decode steps) and block
        # tables of 7..16 blocks, so the kernels compile for what the timed run meets.
        rng = random.Random(1)
        warm = [[rng.randrange(0, 2000) for _ in range(rng.randint(100, 232))] for _ in range(16)]
        engine_generate(engine, warm, 24)
        # And the timed workload itself with a few output tokens: the same prefill chunks and
        # mixed steps, so the timed run compiles nothing (Triton specializes on shapes and on
        # strides such as the block table's width; without this, whichever of the CUDA-graph
        # and eager runs came first paid ~2 s of compiling inside its timing).
        engine_generate(engine, prompts, 8)
        with DecodeProbe(engine) as probe:
            start = time.perf_counter()
            produced = engine_generate(engine, prompts, output_len)
            wall = time.perf_counter() - start
        if engine.pool.num_used:
            raise RuntimeError(f"{engine.pool.num_used} KV blocks still in use after the run")
        elem = torch.empty((), dtype=engine.runner.dtype).element_size()
        weight_bytes = spec.num_parameters() * elem
        if not spec.tie_word_embeddings:
            weight_bytes -= spec.vocab_size * spec.hidden_size * elem
        kv_per_token = spec.kv_bytes_per_token(engine.runner.cache_dtype)
        return {
            "kv_cache": kv_cache_dtype, "cuda_graphs": engine.runner.decode_graphs is not None,
            "tokens_per_s": produced / wall, "wall_s": wall,
            "output_tokens": produced, "kv_blocks": engine.pool.num_blocks,
            "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_per_token,
            "preemptions": engine.stats.preemptions,
            **probe.summary(weight_bytes, kv_per_token, peak),
        }
    finally:
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_figures(peak: float, deadline: float, quick: bool, models_dir: Path) -> dict:
    """End-to-end engine tokens/s and decode bandwidth, bf16 vs int8 KV cache (see the docstring).

    Each model's build and each run stand alone: a failure is recorded and printed, not raised.
    """
    import random
    import traceback

    from rein.model.spec import ModelSpec

    requests = 64 if quick else ENGINE_REQUESTS
    rng = random.Random(0)
    # Ids below 2000 avoid the tiny vocabulary's special tokens (2043..2047).
    prompts = [[rng.randrange(0, 2000) for _ in range(ENGINE_PROMPT_LEN)] for _ in range(requests)]
    figures: dict = {"requests": requests, "prompt_len": ENGINE_PROMPT_LEN,
                     "output_len": ENGINE_OUTPUT_LEN, "max_num_seqs": ENGINE_REQUESTS,
                     "weights": "bfloat16", "models": {}}
    print(f"\n== engine: {requests} requests x {ENGINE_PROMPT_LEN} prompt / {ENGINE_OUTPUT_LEN} output "
          f"tokens, greedy, max_num_seqs {ENGINE_REQUESTS}, bf16 weights; bandwidth over decode-only "
          f"steps = (weights + K/V read) / time")
    print(f"{'model':<24} {'cache':>10} {'tok/s':>8} {'wall s':>7} {'steps':>6} {'batch':>6} "
          f"{'step ms':>8} {'GB/step':>8} {'%peak':>6} {'fwd ms':>7} {'%peak':>6}")
    tiny_dir: Path | None = None
    for name in ("llama-tiny", "qwen2-0.5b-shape"):
        row: dict = {}
        figures["models"][name] = row
        if time.perf_counter() + ENGINE_RUN_MIN_S > deadline:
            row["skipped"] = "time budget"
            print(f"{name:<24} skipped: time budget")
            continue
        try:
            if name == "llama-tiny":
                model_dir = tiny_dir = ensure_tiny_llama(models_dir)
            else:
                model_dir = ensure_qwen2_05b_shape(models_dir, tiny_dir or ensure_tiny_llama(models_dir),
                                                   "cuda" if torch.cuda.is_available() else "cpu")
            spec = ModelSpec.from_dir(model_dir)
            row["parameters"] = spec.num_parameters()
            need = requests * (ENGINE_PROMPT_LEN + ENGINE_OUTPUT_LEN + BLOCK_SIZE)
            kv_memory = int(1.1 * need * spec.kv_bytes_per_token(torch.bfloat16))
        except Exception as exc:  # keep what the kernels measured; report the engine's failure
            row["error"] = f"{type(exc).__name__}: {exc}"
            print(f"{name:<24} failed: {row['error']}", flush=True)
            traceback.print_exc(file=sys.stderr)
            continue
        for cache, eager in (("bfloat16", False), ("bfloat16", True), ("int8", False), ("int8", True)):
            label = ("bf16" if cache == "bfloat16" else cache) + ("-eager" if eager else "")
            if time.perf_counter() + ENGINE_RUN_MIN_S > deadline:
                row[label] = {"skipped": "time budget"}
                print(f"{name:<24} {label:>10} skipped: time budget")
                continue
            try:
                r = engine_run(model_dir, cache, prompts, ENGINE_OUTPUT_LEN, kv_memory, peak, enforce_eager=eager)
            except Exception as exc:
                row[label] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{name:<24} {label:>10} failed: {row[label]['error']}", flush=True)
                traceback.print_exc(file=sys.stderr)
                continue
            row[label] = r
            print(f"{name:<24} {label:>10} {r['tokens_per_s']:8.0f} {r['wall_s']:7.2f} "
                  f"{r['decode_steps']:6d} {num(r.get('decode_mean_batch'), '6.0f')} "
                  f"{num(r.get('decode_step_ms'), '8.2f')} {num(r.get('decode_gb_per_step'), '8.3f')} "
                  f"{num(r.get('decode_step_pct_peak'), '5.1f%')} {num(r.get('forward_ms'), '7.2f')} "
                  f"{num(r.get('forward_pct_peak'), '5.1f%')}", flush=True)
        for label in ("bf16", "int8"):
            graphs, eager = row.get(label, {}), row.get(f"{label}-eager", {})
            if "tokens_per_s" in graphs and "tokens_per_s" in eager:
                row[f"{label}_graphs_over_eager_tokens_per_s"] = graphs["tokens_per_s"] / eager["tokens_per_s"]
                print(f"{name:<24} {label:>10} CUDA graphs / eager: "
                      f"{row[f'{label}_graphs_over_eager_tokens_per_s']:.2f}x tokens/s")
        if "tokens_per_s" in row.get("bf16", {}) and "tokens_per_s" in row.get("int8", {}):
            row["int8_over_bf16_tokens_per_s"] = row["int8"]["tokens_per_s"] / row["bf16"]["tokens_per_s"]
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="peak HBM bandwidth in GB/s (default: from the device name)")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per figure (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--no-flush", action="store_true", help="do not flush L2 between launches")
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end engine figures")
    parser.add_argument("--models-dir", default=".cache/bench-models",
                        help="where the engine figures' random-weight models are built/reused")
    parser.add_argument("--unfused-elementwise", action="store_true",
                        help="run a layer's element-wise work as torch ops instead of rein's Triton kernels "
                             "(rein.kernels.triton_elementwise): the step time before the fusion, for comparison")
    args = parser.parse_args(argv)
    if args.unfused_elementwise:
        from rein.kernels import elementwise

        for op in ("rms_norm", "add_rms_norm", "silu_and_mul"):
            setattr(elementwise, op, lambda *a: None)
        elementwise.rotary_ = lambda *a: False

    if not torch.cuda.is_available():
        print("bench/attention_kernels.py: no CUDA device; these are GPU kernel benchmarks, nothing to measure.")
        print(json.dumps({"cuda": False, "skipped": "no CUDA device"}))
        return 0
    try:
        import triton
    except ImportError:
        print("bench/attention_kernels.py: triton is not installed; nothing to measure.")
        print(json.dumps({"cuda": True, "triton": False, "skipped": "triton not installed"}))
        return 0

    start = time.perf_counter()
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or peak_gbps_for(name)
    peak_source = "--peak-gbps" if args.peak_gbps else "table"
    if peak is None:
        peak, peak_source = 2000.0, "unknown device, assumed"
    props = torch.cuda.get_device_properties(0)
    print(f"device: {name}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.0f} GiB; peak {peak:.0f} GB/s ({peak_source}); "
          f"torch {torch.__version__}, triton {triton.__version__}")
    results: dict = {"device": name, "sms": props.multi_processor_count, "peak_gbps": peak,
                     "peak_source": peak_source, "torch": torch.__version__,
                     "triton": triton.__version__, "l2_flush": not args.no_flush,
                     "decode": [], "int8_vs_bf16": [], "prefill": [], "store": []}
    kernel_deadline = start + DEADLINE_S - (0.0 if args.no_engine else ENGINE_RESERVE_S)
    timer = Timer(args.iters, args.warmup, not args.no_flush, kernel_deadline)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.inference_mode():
        bench_decode(timer, peak, args.quick, gen, results)
        bench_int8(timer, peak, args.quick, gen, results)
        bench_prefill(timer, args.quick, gen, results)
        bench_store(timer, gen, results)
    del timer  # its L2 flush buffer
    if args.no_engine:
        results["engine"] = {"skipped": "--no-engine"}
    else:
        results["engine"] = engine_figures(peak, start + DEADLINE_S, args.quick, Path(args.models_dir))
    results["wall_s"] = time.perf_counter() - start
    print(f"\ntotal {results['wall_s']:.0f}s")
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
