"""A short correctness check of the CUDA path, for a machine with a GPU (not a test).

On CUDA the engine runs the Triton kernels. This checks, per architecture of the tiny
models, that the engine's greedy tokens in fp32 equal Hugging Face generate() (the same
claim the CPU tests make for the reference path), also for prompts that share their first
blocks (prefix caching), that bf16 and the int8 KV cache run end to end, and that no KV
blocks leak. Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from rein.engine import EngineConfig, LLMEngine, SamplingParams
from rein.engine.tiny_model import make_tiny_model

MAX_TOKENS = 12


def hf_greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def run_engine(model_dir: Path, prompts: list[list[int]], **config) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cuda", kv_cache_memory="64MiB",
                                    max_model_len=512, **config))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        if i % 3 == 2:
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))], engine


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        print(json.dumps({"cuda": False}))
        return 0
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 2000) for _ in range(n)] for n in (1, 5, 17, 33, 64, 100, 130, 9)]
    results = {"cuda": True, "device": torch.cuda.get_device_name(), "archs": {}}
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen2", "qwen3", "mistral"):
            model_dir = make_tiny_model(Path(tmp) / arch, arch=arch)
            expected = hf_greedy(model_dir, prompts)
            row = {}
            started = time.perf_counter()
            got, engine = run_engine(model_dir, prompts, dtype="float32")
            row["fp32_identical_requests"] = sum(a == b for a, b in zip(got, expected, strict=True))
            row["fp32_chunked_identical"] = sum(a == b for a, b in zip(
                run_engine(model_dir, prompts, dtype="float32", max_num_batched_tokens=16)[0], expected,
                strict=True))
            row["fp32_leaked_blocks"] = engine.pool.num_used
            bf16, engine = run_engine(model_dir, prompts, dtype="bfloat16")
            row["bf16_token_agreement"] = sum(
                x == y for a, b in zip(bf16, expected, strict=True) for x, y in zip(a, b, strict=True)) / (len(prompts) * MAX_TOKENS)
            int8, engine = run_engine(model_dir, prompts, dtype="float32", kv_cache_dtype="int8")
            row["int8_token_agreement"] = sum(
                x == y for a, b in zip(int8, expected, strict=True) for x, y in zip(a, b, strict=True)) / (len(prompts) * MAX_TOKENS)
            row["int8_leaked_blocks"] = engine.pool.num_used
            # Prefix caching: prompts sharing a 40-token beginning (two full blocks), arriving a
            # few at a time so later ones find the first ones' blocks; against HF as above.
            shared = [prompts[3][:40] + p for p in prompts]
            shared_expected = hf_greedy(model_dir, shared)
            got, engine = run_engine(model_dir, shared, dtype="float32")
            row["prefix_cached_identical_requests"] = sum(a == b for a, b in zip(got, shared_expected, strict=True))
            row["prefix_cache_hit_tokens"] = engine.stats.prefix_cache_hits
            row["prefix_leaked_blocks"] = engine.pool.num_used
            row["seconds"] = round(time.perf_counter() - started, 1)
            ok &= row["fp32_identical_requests"] == len(prompts) and row["fp32_leaked_blocks"] == 0
            ok &= row["prefix_cached_identical_requests"] == len(prompts) and row["prefix_cache_hit_tokens"] > 0
            ok &= row["prefix_leaked_blocks"] == 0
            results["archs"][arch] = row
            print(arch, row, flush=True)
    results["ok"] = ok
    print(json.dumps(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
