"""Where an engine step's time goes on the real model (SmolLM2-135M-Instruct, float32, CPU).

    python bench/profile_step.py [--threads 1] [--decode-batches 32,64] [--prefill-lens 512,768,1024]
                                 [--steps 8] [--top 14] [--cprofile] [--cache-dir ~/.cache/rein/bench]

Uses bench/peers.py's float32 safetensors folder (made once from rein's packaged GGUF) and its
English text for the prompts. Two scenarios, each on a fresh prefix cache:

* decode: B requests (prompts 128-384 tokens) are prefilled, then `--steps` steps in which all B
  decode one token each are measured;
* prefill: requests with the given prompt lengths and one output token each; every step until
  they finish is measured (the 2048-token step budget chunks them as the engine would).

For each scenario it prints
1. the step split into phases, CPU time per step (time.process_time: with one thread every op
   runs on the stepping thread, and CPU time does not count the time neighbours on a shared
   machine hold the core; wall time per step is printed too): schedule (scheduler.schedule), prepare
   (runner.execute less the forward and the lm_head: laying out inputs, metadata tensors),
   forward (the model's layers, final norm included), lm_head (logits of the sampled rows),
   sample (the sampler and grammar masks), detokenize (IncrementalDetokenizer.add_token), other
   (the rest of engine.step: outputs, stop checks, bookkeeping);
2. torch.profiler's per-op self CPU time of the same steps (top --top ops, and the shares of op
   families: matmul, attention, KV gather/store, element-wise, ...); profiler overhead makes
   these times larger than the phase timings, the shares are what to read. Caveat: with the
   profiler on, the large decode gathers of batch 64 page-fault again (29k minor faults a step
   measured, against none without it, despite rein.model.cpu_allocator), which inflates
   index_select there; batch 32's and the prefill's shares were not affected. rein's native CPU
   kernels (rein.kernels.cpu_native: decode attention, the fused element-wise ops) are ctypes
   calls, which the profiler does not see: their time is in the phase table's forward but in no
   op of this one (REIN_CPU_KERNELS=0 shows the torch ops they replace);
3. with --cprofile, cProfile's top Python functions by own time over the decode steps.

Figures depend on the machine's load: compare runs taken one after the other, and read
`uptime` (printed at the start and end).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import MAX_NUM_BATCHED_TOKENS, Text, ensure_f32_model  # noqa: E402

from rein.engine.config import EngineConfig  # noqa: E402
from rein.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from rein.engine.engine import LLMEngine  # noqa: E402
from rein.engine.sampling_params import SamplingParams  # noqa: E402

PHASES = ("schedule", "prepare", "forward", "lm_head", "sample", "detokenize", "other")

# Op families for the summary; the first matching rule wins (names are aten op names).
FAMILIES = [
    ("matmul", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm", "aten::baddbmm",
                "mkldnn", "aten::_mkl", "aten::mkl")),
    ("attention (sdpa)", ("scaled_dot_product", "flash_attention", "_efficient_attention", "aten::_softmax",
                          "aten::softmax")),
    ("kv gather/store", ("aten::index_select", "aten::index_put", "aten::index", "aten::gather",
                         "aten::scatter", "aten::_index_put")),
    ("copies/layout", ("aten::copy_", "aten::contiguous", "aten::clone", "aten::cat", "aten::to",
                       "aten::_to_copy", "aten::stack", "aten::empty", "aten::zeros", "aten::fill_",
                       "aten::zero_", "aten::resize_")),
    ("element-wise", ("aten::mul", "aten::add", "aten::sub", "aten::rsqrt", "aten::pow", "aten::mean",
                      "aten::silu", "aten::neg", "aten::div", "aten::where", "aten::lt", "aten::le",
                      "aten::ge", "aten::gt", "aten::sum", "aten::exp", "aten::sqrt", "aten::arange",
                      "aten::clamp", "aten::masked_fill", "aten::embedding", "aten::argmax", "aten::max",
                      "aten::min", "aten::ne", "aten::eq", "aten::all", "aten::any")),
    ("views/shape", ("aten::view", "aten::reshape", "aten::slice", "aten::split", "aten::transpose",
                     "aten::permute", "aten::unsqueeze", "aten::select", "aten::narrow", "aten::as_strided",
                     "aten::expand", "aten::t", "aten::squeeze", "aten::unbind", "aten::flatten",
                     "aten::_unsafe_view", "aten::alias", "aten::detach", "aten::lift", "aten::_reshape_alias")),
]


def family(name: str) -> str:
    for label, prefixes in FAMILIES:
        if any(name.startswith(p) or p in name for p in prefixes):
            return label
    return "other ops"


class PhaseTimer:
    """Wraps the engine's pieces with CPU-time timing; `totals[phase]` in seconds."""

    def __init__(self, engine: LLMEngine) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.active = False
        runner, model = engine.runner, engine.runner.model
        timer = self

        def timed(phase, fn):
            def wrapper(*args, **kwargs):
                if not timer.active:
                    return fn(*args, **kwargs)
                t = time.process_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    timer.totals[phase] += time.process_time() - t
            return wrapper

        engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
        runner.execute = timed("execute", runner.execute)
        model.forward = timed("forward", model.forward)
        model.compute_logits = timed("lm_head", model.compute_logits)
        sampler = engine.sampler
        engine.sampler = timed("sampler", sampler)
        engine.grammars.apply_masks = timed("masks", engine.grammars.apply_masks)
        self._original_add_token = IncrementalDetokenizer.add_token
        IncrementalDetokenizer.add_token = timed("detokenize", IncrementalDetokenizer.add_token)
        self.engine = engine

    def step(self) -> list:
        self.active = True
        t, wall = time.process_time(), time.perf_counter()
        try:
            return self.engine.step()
        finally:
            self.totals["step"] += time.process_time() - t
            self.totals["wall"] += time.perf_counter() - wall
            self.steps += 1
            self.active = False

    def reset(self) -> None:
        self.totals.clear()
        self.steps = 0

    def phases(self) -> dict[str, float]:
        t = self.totals
        out = {
            "schedule": t["schedule"],
            "prepare": t["execute"] - t["forward"] - t["lm_head"],
            "forward": t["forward"],
            "lm_head": t["lm_head"],
            "sample": t["sampler"] + t["masks"],
            "detokenize": t["detokenize"],
        }
        out["other"] = t["step"] - sum(out.values())
        return out

    def close(self) -> None:
        IncrementalDetokenizer.add_token = self._original_add_token


def print_phases(title: str, timer: PhaseTimer, tokens: int) -> dict:
    phases = timer.phases()
    total = timer.totals["step"]
    n = max(timer.steps, 1)
    print(f"\n## {title}: {timer.steps} steps, {1000 * total / n:.1f} CPU ms/step "
          f"({tokens / total if total else 0:.0f} tokens per CPU second; wall {1000 * timer.totals['wall'] / n:.1f} "
          f"ms/step)")
    print(f"{'phase':<12}{'CPU ms/step':>12}{'share':>9}")
    for name in PHASES:
        print(f"{name:<12}{1000 * phases[name] / n:>12.2f}{100 * phases[name] / total:>8.1f}%")
    return {"cpu_ms_per_step": 1000 * total / n, **{k: 1000 * v / n for k, v in phases.items()}}


def print_ops(prof, top: int) -> dict:
    events = prof.key_averages()
    rows = [(e.key, e.self_cpu_time_total, e.count) for e in events]
    total = sum(r[1] for r in rows) or 1
    fams: dict[str, float] = defaultdict(float)
    for name, t, _ in rows:
        fams[family(name)] += t
    print(f"\n{'op family':<22}{'self ms':>10}{'share':>9}")
    for name, t in sorted(fams.items(), key=lambda kv: -kv[1]):
        print(f"{name:<22}{t / 1000:>10.1f}{100 * t / total:>8.1f}%")
    print(f"\n{'op':<44}{'calls':>8}{'self ms':>10}{'share':>9}")
    for name, t, count in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"{name[:43]:<44}{count:>8}{t / 1000:>10.1f}{100 * t / total:>8.1f}%")
    return {k: v / total for k, v in fams.items()}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_decode(engine: LLMEngine, timer: PhaseTimer, text: Text, batch: int, steps: int, top: int,
               use_cprofile: bool) -> dict:
    engine.pool.reset_cache()
    rng = random.Random(f"profile-decode-{batch}")
    for i in range(batch):
        engine.add_request(f"d{batch}-{i}", text.excerpt(rng, rng.randint(128, 384)), greedy(2048))
    # Prefill everything (not measured), until a step decodes all `batch` requests at once.
    while True:
        engine.step()
        running = engine.scheduler.running
        if len(running) == batch and all(r.num_computed_tokens == r.num_tokens - 1 for r in running) \
                and engine.num_waiting == 0:
            break
    for _ in range(2):   # warm-up of the decode shapes
        engine.step()
    timer.reset()
    for _ in range(steps):
        timer.step()
    result = {"phases": print_phases(f"decode, batch {batch}", timer, batch * steps)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    result["op_shares"] = print_ops(prof, top)
    if use_cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            engine.step()
        profiler.disable()
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(top)
        print("\ncProfile (own time) over", steps, "decode steps:")
        print("\n".join(buf.getvalue().splitlines()[:top + 12]))
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return result


def run_prefill(engine: LLMEngine, timer: PhaseTimer, text: Text, lengths: list[int], top: int) -> dict:
    rng = random.Random("profile-prefill")
    prompts = [text.excerpt(rng, n) for n in lengths]
    out = {}
    for label, profile in (("timed", False), ("profiled", True)):
        engine.pool.reset_cache()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p-{label}-{i}", prompt, greedy(1))
        timer.reset()
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                while engine.has_unfinished():
                    engine.step()
            out["op_shares"] = print_ops(prof, top)
        else:
            while engine.has_unfinished():
                timer.step()
            out["phases"] = print_phases(f"prefill of {len(lengths)} prompts ({sum(lengths)} tokens)", timer,
                                         sum(lengths))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode-batches", default="32,64")
    ap.add_argument("--prefill-lens", default="512,768,1024")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "rein" / "bench"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# load average at start: {os.getloadavg()}; torch {torch.__version__}, threads {args.threads}")
    model_dir = ensure_f32_model(Path(args.cache_dir).expanduser())
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=64,
                                    max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, kv_cache_memory="1GiB"))
    print(f"# engine start-up {time.perf_counter() - t:.1f}s")
    text = Text(engine.tokenizer)
    timer = PhaseTimer(engine)
    with torch.inference_mode():
        # Warm-up: a short prefill and a few decodes, so first-call costs stay out.
        engine.add_request("warm", text.excerpt(random.Random(0), 64), greedy(4))
        while engine.has_unfinished():
            engine.step()
        for batch in (int(b) for b in args.decode_batches.split(",") if b):
            run_decode(engine, timer, text, batch, args.steps, args.top, args.cprofile)
        if args.prefill_lens:
            run_prefill(engine, timer, text, [int(n) for n in args.prefill_lens.split(",")], args.top)
    timer.close()
    print(f"\n# load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
