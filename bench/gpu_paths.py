"""End to end, rein's CUDA paths against its CPU engine (part of gpu_check: `cuda_paths`), and
tensor parallelism over NCCL (`tensor_parallel`).

Each case builds a tiny model, runs the same greedy requests through an engine on CUDA
(CUDA graphs on) and through a reference engine, both fp32, and compares the tokens: PASS when
every request's tokens are equal, or differ first where the reference run's own top-2 logprob
margin is under `near_tie` (a near-tie, not a kernel error). The reference of a GGUF case is
the same file dequantized at load (`--quantization none`: cuBLAS on the float weights) on the
same device; of the others, the CPU engine (its C kernels). The cases, and the CUDA path each
one drives:

* gguf_q4_k, gguf_q5_k, gguf_q6_k: the small Llama as a GGUF file of that type (written by
  rein.fixtures.tiny_gguf; down_proj's 1408 columns are not whole 256-blocks and stay F32):
  rein/kernels/triton_quantized.py, the packed 5/6-bit `_packed_matmul_kernel` for Q5_K / Q6_K;
* gguf_moe_q4_0: the tiny Mixtral as GGUF, Q8_0 with Q4_0 experts: the grouped quantized
  MoE kernel (rein/kernels/triton_quantized_moe.py);
* gemma3_windowed: a tiny Gemma 3 (6 layers, window 8, prompts past it): the sliding-window
  Triton kernels and the windowed storage's CUDA-graph buffers (rein/engine/cuda_graphs.py);
* gemma3_vision: the tiny Gemma 3 vision model with images: the image-block (bidirectional)
  attention in the Triton prefill; then the same engine in bf16 (the bf16 vision tower), whose
  token agreement with the fp32 CPU run must be at least BF16_AGREEMENT;
* int4_g32_at_load: the tiny Llama quantized to 4 bits in groups of 32 as it loads, on both
  sides (CPU: its C kernels): the 4-bit affine matmul AWQ and GPTQ checkpoints run on;
* lora: the tiny Llama with a rank-8 adapter on every projection, every other request under
  it: the Triton LoRA kernels (rein/kernels/triton_lora.py), under CUDA graphs in decode.

The fused MoE kernel (unquantized) runs in gpu_check's greedy_tiny (MoE archs == HF); the
kernels' own tests (AWQ/GPTQ 4-bit, all of the above) in its cuda_tests.

step_graphs (first, in the same part): the whole-step decode graphs (rein/engine/cuda_graphs.py:
forward, logits and sampling of a decode step in one graph) against an enforce_eager engine on
the same device, fp32: greedy rows and seeded random ones (temperature, top-k, top-p, min-p), in
batches whose size changes as requests end (buckets, padding rows), with async scheduling off
and on. PASS when the tokens agree as above (the reference asks for logprobs, which its host
sampler reports without changing a token) and decode steps did sample inside the graph. On CPU
the graph engine gets the same graphs run eagerly (`DecodeGraphs(capture=False)`).

tensor_parallel: with two CUDA devices or more, a two-rank engine (NCCL), eager and replaying
decode graphs (REIN_CUDA_GRAPHS_TENSOR_PARALLEL=1), gives the one-rank
engine's greedy tokens, and a rank killed mid-run fails the next steps with RankDiedError
naming it. With one device it is a SKIP saying so.

On CPU (gpu_check's dry run) the same code runs on the CPU_CASES, with the CPU engine on both
sides: it checks the script (and the CPU's own quantized path against the dequantized file),
not a CUDA kernel, and says so.
"""

from __future__ import annotations

import importlib.util
import io
import json
import random
import shutil
import time
from pathlib import Path

import torch

BF16_AGREEMENT = 0.5
MAX_TOKENS = 12
LENGTHS = (1, 9, 17, 40, 75)


def result(status: str, reason: str, **details) -> dict:
    return {"status": status, "reason": reason, **details}


# --------------------------------------------------------------------------- models


def gguf_case(models_dir: Path, qtype: str) -> Path:
    from rein.fixtures.tiny_gguf import write_gguf
    from rein.fixtures.tiny_model import ensure_tiny_model

    out = models_dir / f"llama-small-{qtype}.gguf"
    if not out.is_file():
        write_gguf(ensure_tiny_model(models_dir / "llama-small", arch="llama", preset="small"), out, qtype)
    return out


def gguf_moe_case(models_dir: Path) -> Path:
    from rein.fixtures.tiny_gguf import write_gguf
    from rein.fixtures.tiny_model import ensure_tiny_model

    out = models_dir / "mixtral-q8_0-experts-q4_0.gguf"
    if not out.is_file():
        write_gguf(ensure_tiny_model(models_dir / "mixtral", arch="mixtral"), out, "Q8_0", expert_qtype="Q4_0")
    return out


def gemma3_case(models_dir: Path) -> Path:
    """A random tiny Gemma 3 text model (window 8 on five of its six layers) with the tiny
    llama's tokenizer."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    from rein.fixtures.tiny_model import ensure_tiny_model

    out = models_dir / "gemma3-window8"
    if (out / "config.json").is_file():
        return out
    source = ensure_tiny_model(models_dir / "llama", arch="llama")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=512,
                              query_pre_attn_scalar=16, num_hidden_layers=6, bos_token_id=1, eos_token_id=2,
                              pad_token_id=0, initializer_range=0.2)
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".partial")
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copyfile(source / name, tmp / name)
    tmp.rename(out)
    return out


def vision_case(models_dir: Path) -> Path:
    from rein.fixtures.tiny_vision import tiny_vision_model

    out = models_dir / "gemma3-vision"
    if (out / "config.json").is_file():
        return out
    return tiny_vision_model(out, "gemma3")


def lora_case(models_dir: Path) -> tuple[Path, Path]:
    """The tiny Llama and a rank-8 LoRA adapter on all seven of its projections (PEFT's files,
    written directly: A and B N(0, 0.05), as tests/lora_support.py draws them)."""
    from safetensors.torch import save_file

    from rein.fixtures.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(models_dir / "llama", arch="llama")
    adapter = models_dir / "llama-lora-r8"
    if (adapter / "adapter_model.safetensors").is_file():
        return model, adapter
    config = json.loads((model / "config.json").read_text())
    hidden, inter, rank = config["hidden_size"], config["intermediate_size"], 8
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv),
              "self_attn.o_proj": (q, hidden), "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter),
              "mlp.down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.05
    tmp = adapter.with_name(adapter.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(m.split(".")[1] for m in shapes), "task_type": "CAUSAL_LM"}))
    tmp.rename(adapter)
    return model, adapter


def png(seed: int, size: tuple[int, int]) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


# --------------------------------------------------------------------------- running


def text_requests() -> dict:
    """Prompts of LENGTHS random ids below 2000 (inside every tiny model's vocabulary)."""
    rng = random.Random(0)
    return {f"p{n}": ([rng.randrange(10, 2000) for _ in range(n)], None) for n in LENGTHS}


def image_requests(engine) -> dict:
    """Chat prompts with one, then two images (the tiny vision fixtures' ChatML template)."""
    from rein.core.images import open_image

    def chat(turn: str) -> str:
        return f"<|begin_of_text|><|im_start|>user\n{turn}<|im_end|>\n<|im_start|>assistant\n"

    image = "<start_of_image>"
    cases = {"one": (chat(f"{image}What is this?"), [png(1, (40, 60))]),
             "two": (chat(f"Compare {image} and {image}, please."), [png(2, (40, 60)), png(3, (30, 30))])}
    processor = engine.vision_processor
    return {name: (processor.expand(text, [open_image(d) for d in images]).token_ids, images)
            for name, (text, images) in cases.items()}


def run(model: Path, device: str, requests: dict | None, dtype: str = "float32", adapter: Path | None = None,
        **config) -> tuple[dict, dict, object]:
    """Greedy tokens and each token's top-2 logprobs per request; the engine. With `adapter`,
    every other request runs under it (a step mixes adapted and base rows)."""
    from rein.core.images import ImageInput
    from rein.engine import EngineConfig, LLMEngine, SamplingParams
    from rein.model.lora.request import LoRARequest

    if adapter is not None:
        config["enable_lora"] = True

    engine = LLMEngine(EngineConfig(model=str(model), device=device, dtype=dtype, kv_cache_memory="64MiB",
                                    max_model_len=512, max_num_seqs=8, **config))
    if requests is None:
        requests = image_requests(engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    for i, (rid, (ids, images)) in enumerate(requests.items()):
        extra = {"images": [ImageInput.of(d) for d in images]} if images else {}
        if adapter is not None and i % 2 == 0:
            extra["lora_request"] = LoRARequest("gpu-check", 1, str(adapter))
        engine.add_request(rid, ids, params, **extra)
    return *run_to_end(engine), engine


def run_to_end(engine) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Step the engine until its requests end: each request's tokens and top logprobs."""
    tokens: dict[str, list[int]] = {}
    tops: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            tops.setdefault(out.request_id, []).extend(lp.top for lp in out.logprobs or [])
    return tokens, tops


# Every row kind a whole-step graph samples: greedy, temperature alone, and each filter.
STEP_GRAPH_KINDS = ({"temperature": 0}, {"temperature": 0.8}, {"temperature": 1.2, "top_k": 5},
                    {"temperature": 0.9, "top_p": 0.8}, {"temperature": 1.0, "min_p": 0.1})


def run_step_graphs(model: Path, device: str, requests: dict, reference: bool, **config) -> tuple[dict, dict, object]:
    """Tokens (and top-2 logprobs, `reference`: enforce_eager, every step sampled on the host) of
    the requests, each of a STEP_GRAPH_KINDS kind and seed and a length that ends them apart;
    without `reference`, on CPU, the engine gets rank 0's sampling graphs run eagerly."""
    from rein.engine import EngineConfig, LLMEngine, SamplingParams
    from rein.engine.cuda_graphs import STEP_MODES, DecodeGraphs

    engine = LLMEngine(EngineConfig(model=str(model), device=device, dtype="float32", kv_cache_memory="64MiB",
                                    max_model_len=512, max_num_seqs=8, enforce_eager=reference, **config))
    runner = engine.runner
    if device == "cpu" and not reference:
        runner.decode_graphs = DecodeGraphs(
            runner.model, runner.caches, max_num_seqs=8, max_blocks_per_seq=-(-runner.max_model_len // runner.block_size),
            device=runner.device, capture=False, vocab_size=runner.spec.vocab_size, modes=STEP_MODES)
    for i, (rid, (ids, _)) in enumerate(requests.items()):
        engine.add_request(rid, ids, SamplingParams(max_tokens=MAX_TOKENS - 2 * i, ignore_eos=True, seed=i,
                                                    logprobs=2 if reference else None,
                                                    **STEP_GRAPH_KINDS[i % len(STEP_GRAPH_KINDS)]))
    tokens, tops = run_to_end(engine)
    engine.close()
    return tokens, tops, engine


def step_graphs_check(device: str, models_dir: Path, near_tie: float) -> dict:
    """The whole-step decode graphs against enforce_eager (module docstring: step_graphs)."""
    from rein.fixtures.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(models_dir / "llama", arch="llama")
    requests = text_requests()
    want, want_tops, _ = run_step_graphs(model, device, requests, reference=True)
    row: dict = {"problems": []}
    for name, config in (("sync", {}), ("async", {"async_scheduling": True})):
        got, _, engine = run_step_graphs(model, device, requests, reference=False, **config)
        graphs = engine.runner.decode_graphs
        runs = dict(graphs.runs) if graphs is not None else {}
        row[name] = {**compare(got, want, want_tops, near_tie), "runs": runs}
        if row[name]["diverged"]:
            row["problems"].append(f"{name}: diverged at {', '.join(row[name]['diverged'])}")
        if device == "cuda" and (graphs is None or not graphs.captured):
            row["problems"].append(f"{name}: no CUDA graphs were captured")
        if not runs.get("device"):
            row["problems"].append(f"{name}: no decode step sampled inside its graph")
        if engine.pool.num_used:
            row["problems"].append(f"{name}: {engine.pool.num_used} KV blocks leaked")
    return row


def compare(got: dict, want: dict, want_tops: dict, near_tie: float) -> dict:
    """identical / near-tie / diverged requests, and the token agreement."""
    identical, near_ties, diverged, margins = 0, 0, [], []
    for rid, ref in want.items():
        mine = got.get(rid, [])
        if mine == ref:
            identical += 1
            continue
        k = next((i for i, (a, b) in enumerate(zip(ref, mine, strict=False)) if a != b), min(len(ref), len(mine)))
        top = want_tops.get(rid, [])
        margin = top[k][0][1] - top[k][1][1] if k < len(top) and len(top[k]) >= 2 else None
        margins.append(None if margin is None else round(margin, 6))
        if margin is not None and margin < near_tie:
            near_ties += 1
        else:
            diverged.append(f"{rid}@{k}")
    pairs = [(a, b) for rid, ref in want.items() for a, b in zip(ref, got.get(rid, []), strict=False)]
    return {"requests": len(want), "identical": identical, "near_ties": near_ties, "diverged": diverged,
            "margins": margins, "agreement": round(sum(a == b for a, b in pairs) / max(1, len(pairs)), 3)}


# In the order they run: when time runs short the last ones are listed as not run.
CASES = ("gguf_q6_k", "gemma3_windowed", "gguf_moe_q4_0", "gemma3_vision", "lora", "int4_g32_at_load", "gguf_q5_k",
         "gguf_q4_k")
# The small Llama's GGUF runs take minutes on a loaded 2-core CPU: the dry run leaves them out.
CPU_CASES = ("gguf_moe_q4_0", "gemma3_windowed", "gemma3_vision", "lora")


def case_model(name: str, models_dir: Path) -> Path:
    from rein.fixtures.tiny_model import ensure_tiny_model

    if name.startswith("gguf_q"):
        return gguf_case(models_dir, name.removeprefix("gguf_").upper())
    if name == "gguf_moe_q4_0":
        return gguf_moe_case(models_dir)
    if name == "gemma3_windowed":
        return gemma3_case(models_dir)
    if name in ("lora", "int4_g32_at_load"):
        return lora_case(models_dir)[0] if name == "lora" else ensure_tiny_model(models_dir / "llama", arch="llama")
    return vision_case(models_dir)


def check_case(name: str, device: str, models_dir: Path, near_tie: float) -> dict:
    model = case_model(name, models_dir)
    requests = None if name == "gemma3_vision" else text_requests()   # images: the processor makes them
    # A GGUF file's reference is the same file dequantized at load (the kernel's own reference,
    # and fast); the others' is the CPU engine.
    gguf = name.startswith("gguf")
    adapter = lora_case(models_dir)[1] if name == "lora" else None
    quantization = {"quantization": "int4-g32"} if name == "int4_g32_at_load" else {}
    want, want_tops, reference = run(model, device if gguf else "cpu", requests, adapter=adapter,
                                     **({"quantization": "none"} if gguf else quantization))
    if requests is None:
        requests = image_requests(reference)
    del reference
    got, _, engine = run(model, device, requests, adapter=adapter, **quantization)
    row = compare(got, want, want_tops, near_tie)
    problems = [f"diverged at {', '.join(row['diverged'])}"] if row["diverged"] else []
    if engine.pool.num_used:
        problems.append(f"{engine.pool.num_used} KV blocks leaked")
    if device == "cuda" and (engine.runner.decode_graphs is None or not engine.runner.decode_graphs.captured):
        problems.append("no CUDA graphs were captured")
    if name == "gemma3_windowed" and engine.windows is None:
        problems.append("no windowed storage (the sliding-window path did not run)")
    if gguf or quantization:
        held = sorted({type(m.quantized).__name__ for m in engine.runner.model.modules()
                       if getattr(m, "quantized", None) is not None})
        row["held_quantized"] = held
        if not held:
            problems.append("no weight was held quantized")
    del engine
    if name == "lora":   # the adapter must matter, or the check would pass with it ignored
        base, _, engine = run(model, "cpu", requests)
        adapted = [rid for i, rid in enumerate(requests) if i % 2 == 0]
        row["adapted_requests_changed"] = sum(base[rid] != want[rid] for rid in adapted)
        if not row["adapted_requests_changed"]:
            problems.append("the adapter changed no adapted request's tokens")
        del engine
    if name == "gemma3_vision":
        bf16, _, engine = run(model, device, requests, dtype="bfloat16")
        row["bf16_agreement"] = compare(bf16, want, want_tops, near_tie)["agreement"]
        if row["bf16_agreement"] < BF16_AGREEMENT:
            problems.append(f"bf16 agrees on {row['bf16_agreement']:.2f} of the tokens (< {BF16_AGREEMENT})")
        del engine
    row["problems"] = problems
    return row


def paths_check(device: str, models_dir: Path, near_tie: float, time_left, on_case=None) -> dict:
    """Every case, CUDA (or, on CPU, the CPU engine again) against the CPU engine."""
    rows: dict = {}
    not_run: list[str] = []
    failures: list[str] = []
    last = 0.0
    missing: dict[str, str] = {}
    started = time.perf_counter()
    try:
        step_graphs = step_graphs_check(device, models_dir, near_tie)
    except Exception as exc:   # its crash is its failure; the cases still run
        import traceback
        traceback.print_exc()
        step_graphs = {"problems": [f"{type(exc).__name__}: {str(exc)[:300]}"]}
    step_graphs["seconds"] = round(time.perf_counter() - started, 1)
    print(f"cuda_paths: {'step_graphs':16s} {step_graphs}", flush=True)
    if step_graphs["problems"]:
        failures.append(f"step_graphs: {'; '.join(step_graphs['problems'])}")
    for name in CASES if device == "cuda" else CPU_CASES:
        needs = "gguf" if name.startswith("gguf") else "PIL" if name == "gemma3_vision" else None
        if needs and importlib.util.find_spec(needs) is None:
            missing[name] = f"the {needs} package is not installed"
            continue
        if rows and time_left() < 1.5 * last + 10:
            not_run.append(name)
            continue
        started = time.perf_counter()
        try:
            row = check_case(name, device, models_dir, near_tie)
        except Exception as exc:   # one case's crash is its failure; the others still run
            import traceback

            traceback.print_exc()
            row = {"problems": [f"{type(exc).__name__}: {str(exc)[:300]}"]}
        row["seconds"] = round(time.perf_counter() - started, 1)
        last = row["seconds"]
        rows[name] = row
        print(f"cuda_paths: {name:16s} {row}", flush=True)
        if row["problems"]:
            failures.append(f"{name}: {'; '.join(row['problems'])}")
        if on_case:
            on_case({"cases": rows, "failures": failures})
    where = ("CUDA == the reference engine" if device == "cuda"
             else "CPU mode, the CPU engine on both sides (checks the script, not a CUDA kernel)")
    note = f"; not run for lack of time: {', '.join(not_run)}" if not_run else ""
    note += "".join(f"; {name} skipped: {why}" for name, why in missing.items())
    if failures:
        return result("FAIL", "; ".join(failures) + note, cases=rows, not_run=not_run, missing=missing,
                      step_graphs=step_graphs)
    if not rows:
        return result("SKIP", "no case could run" + note, cases=rows, not_run=not_run, missing=missing,
                      step_graphs=step_graphs)
    ties = sum(r.get("near_ties", 0) for r in rows.values())
    return result("PASS", f"{where}: greedy tokens of {', '.join(rows)}" + (f" ({ties} near-ties)" if ties else "")
                  + "; whole-step graphs == enforce_eager (greedy and seeded sampling, async off and on)"
                  + note, cases=rows, not_run=not_run, missing=missing, step_graphs=step_graphs)


def tensor_parallel_check(device: str, tokenizer_model: Path) -> dict:
    """Two ranks over NCCL, eager and replaying decode graphs, == one rank; a dead rank fails
    the step naming it."""
    import os
    import signal

    from rein.core.settings import get_settings, swap_environment
    from rein.engine import EngineConfig, LLMEngine, SamplingParams
    from rein.engine.rank_processes import RankDiedError

    count = torch.cuda.device_count() if device == "cuda" else 0
    if count < 2:
        return result("SKIP", f"{count} CUDA device(s): tensor parallelism over NCCL needs two"
                      + ("" if device == "cuda" else " (CPU mode; gloo runs in the suite's tests)"))
    requests = text_requests()

    def engine(ranks: int, graphs: bool = False):
        # Graphs under tensor parallelism are opt-in (REIN_CUDA_GRAPHS_TENSOR_PARALLEL): run both.
        previous = swap_environment({"REIN_CUDA_GRAPHS_TENSOR_PARALLEL": "1" if graphs else None})
        get_settings.cache_clear()
        try:
            return LLMEngine(EngineConfig(model=str(tokenizer_model), device="cuda", dtype="float32",
                                          tensor_parallel_size=ranks, kv_cache_memory="32MiB", max_model_len=256,
                                          max_num_seqs=8))
        finally:
            swap_environment(previous)
            get_settings.cache_clear()

    outputs = {}
    for ranks, graphs in ((1, False), (2, False), (2, True)):
        eng = engine(ranks, graphs)
        try:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
            for rid, (ids, _) in requests.items():
                eng.add_request(rid, ids, params)
            tokens: dict = {}
            while eng.has_unfinished():
                for out in eng.step():
                    tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            outputs[ranks, graphs] = tokens
        finally:
            eng.close()
    problems = [f"two ranks' greedy tokens ({'graphs' if graphs else 'eager'}) differ from one rank's"
                for ranks, graphs in ((2, False), (2, True)) if outputs[ranks, graphs] != outputs[1, False]]
    eng = engine(2)
    died = None
    try:
        eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        eng.step()
        process = eng.ranks.processes[0]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)
        try:
            for _ in range(10):
                eng.step()
        except RankDiedError as exc:
            died = str(exc)
    finally:
        eng.close()
    if died is None or "rank 1" not in died:
        problems.append(f"killing rank 1 gave {died!r}, not a RankDiedError naming rank 1")
    if problems:
        return result("FAIL", "; ".join(problems), devices=count)
    return result("PASS", f"two ranks over NCCL, eager and with decode graphs, == one rank ({len(requests)} requests);"
                  f" a killed rank: {died[:120]}",
                  devices=count)
