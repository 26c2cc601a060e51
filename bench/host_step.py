"""The engine's per-step host cost: decode steps/s of a tiny random model at batch 1 and 256,
this checkout against another, in alternating rounds on the same machine.

    python bench/host_step.py [--base DIR] [--rounds 5] [--steps 100] [--batches 1,256]
                              [--model DIR] [--profile]

With a model this small (rein make-tiny-model: 2 layers, hidden 64, vocab 2,048) the forward
costs little, so a step's time is mostly the engine's own work on the host: the plan, the
sampler, the detokenizer, the scheduler's update and the outputs. Each measurement runs in a
process of its own with PYTHONPATH at one checkout (`--base`: another checkout, e.g. a git
worktree of main; without it, this checkout alone) and one torch thread. A round builds an
engine, adds the batch (greedy, ignore_eos, max_tokens 200), steps until every request has its
first token, then times `--steps` decode steps by CPU time (time.process_time, which a loaded
machine disturbs less than wall time). The rounds alternate base, head, base, head, ...; each
side's median round is compared. `--profile`: one cProfile of this checkout's batch instead.

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD = Path(__file__).resolve().parents[1]


def measure(model: str, batch: int, steps: int) -> float:
    """Decode steps per CPU second of an engine on `model` with `batch` greedy requests."""
    import torch

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    from rein.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=256, max_num_batched_tokens=2048,
                                    kv_cache_memory="512MiB"))
    params = SamplingParams(max_tokens=steps + 100, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i * 7 + k) % 1000 for k in range(8 + i % 24)], params)
    while engine.num_waiting or any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    for _ in range(5):   # warm-up
        engine.step()
    started = time.process_time()
    for _ in range(steps):
        engine.step()
    return steps / (time.process_time() - started)


def profile(model: str, batch: int, steps: int) -> None:
    import cProfile
    import pstats

    import torch

    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    from rein.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=model, max_num_seqs=256, max_num_batched_tokens=2048,
                                    kv_cache_memory="512MiB"))
    params = SamplingParams(max_tokens=steps + 100, ignore_eos=True, temperature=0)
    for i in range(batch):
        engine.add_request(f"r{i}", [1 + (i * 7 + k) % 1000 for k in range(8 + i % 24)], params)
    for _ in range(10):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


def run_side(root: Path, model: str, batch: int, steps: int) -> float:
    env = os.environ | {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(HEAD / "bench" / "host_step.py"), "--measure", str(batch),
                           "--model", model, "--steps", str(steps)],
                          cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}) at {root}:\n{done.stderr[-4000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="another checkout to compare with (e.g. a git worktree of main)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batches", default="1,256")
    ap.add_argument("--model", help="a model directory (default: a fresh rein make-tiny-model)")
    ap.add_argument("--profile", action="store_true", help="cProfile this checkout's first batch instead")
    ap.add_argument("--measure", type=int, help=argparse.SUPPRESS)   # one side's run, in its own process
    args = ap.parse_args(argv)
    if args.measure is not None:
        print(measure(args.model, args.measure, args.steps))
        return 0
    model = args.model
    if model is None:
        model = str(Path(tempfile.mkdtemp(prefix="rein-host-step-")) / "tiny")
        from rein.fixtures.tiny_model import make_tiny_model
        make_tiny_model(model)
    batches = [int(b) for b in args.batches.split(",")]
    if args.profile:
        profile(model, batches[0], args.steps)
        return 0
    sides = {"head": HEAD} | ({"base": Path(args.base).resolve()} if args.base else {})
    results: dict[str, dict[int, list[float]]] = {name: {b: [] for b in batches} for name in sides}
    for round_ in range(args.rounds):
        for batch in batches:
            for name in reversed(sides):   # base first, then head
                value = run_side(sides[name], model, batch, args.steps)
                results[name][batch].append(value)
                print(f"round {round_ + 1} batch {batch:4d} {name}: {value:8.1f} steps/s", flush=True)
    summary: dict[str, dict] = {"load": os.getloadavg(), "steps": args.steps}
    for batch in batches:
        row = {name: statistics.median(results[name][batch]) for name in sides}
        if "base" in row:
            row["ratio"] = row["head"] / row["base"]
        summary[str(batch)] = row
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
