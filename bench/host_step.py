"""Engine steps per second where the step is host-bound: async scheduling on against off, and
optionally against an earlier commit.

    python bench/host_step.py [--batch 256] [--max-tokens 200] [--steps 120] [--rounds 3]
                              [--threads 1] [--base REV ...] [--sync-only] [--model-dir DIR]

The tiny random-weight llama (`rein make-tiny-model`, built once into --model-dir) decodes a
batch of --batch requests (16 prompt tokens each, greedy, ignore_eos, --max-tokens each). Once
every request is decoding, --steps engine steps are timed (wall time, and CPU time of the whole
process: both threads under async scheduling). Each measurement runs in a process of its own,
and the variants alternate round by round (base, off, on, base, off, on, ...) so that drift on
a shared machine falls on all of them alike; each variant's median round is compared.

Variants: `off` and `on` are this checkout with --no-async-scheduling / --async-scheduling
(--sync-only: `off` alone); with --base REV, `base` is that commit (checked out into a
temporary git worktree, as bench/ab_commits.py does), run synchronously as it is. --base may
be given again, for more commits side by side (`base2`, `base3`, ...: the branch point of a
change, say, beside the commit before issue 47). Prints every round, then the medians and the
ratios on/off, off/base and on/base (the figure issue 47 asks for, read with async scheduling
off, its default: steps/s at batch 256, at least 1.5x the commit before the change); the last
line of stdout is one JSON object.

On a machine other processes load, the wall figures move with them: read `uptime` (printed at
the start and the end) and prefer the ratios of one run to figures across runs. Beside the
medians the bench prints `best` figures: each timed step's fastest time over the rounds, summed
(every round times the same steps), which other processes disturb least.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 16


def measure(args: argparse.Namespace) -> dict:
    """One round in this process (the child): steady-state decode steps of the batch."""
    import torch

    from rein.engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(args.threads)
    options = {"async_scheduling": args.variant == "on"} if args.variant != "base" else {}
    engine = LLMEngine(EngineConfig(model=args.model_dir, max_num_seqs=args.batch, max_model_len=512,
                                    max_num_batched_tokens=max(2048, args.batch * PROMPT_TOKENS), **options))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [rng.randrange(5, 500) for _ in range(PROMPT_TOKENS)], params)
    tokens = 0
    while tokens < 3 * args.batch:   # the prefill, and each request's first decodes
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    if args.steps + 8 > args.max_tokens:
        sys.exit(f"--steps {args.steps} does not fit in --max-tokens {args.max_tokens} (steady decode)")
    step_ms = []
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - started) * 1e3)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    planned_ahead = getattr(engine.stats, "planned_ahead", 0)
    engine.close()
    return {"steps_per_s": args.steps / wall, "wall_ms": wall / args.steps * 1e3,
            "cpu_ms": cpu / args.steps * 1e3, "planned_ahead": planned_ahead, "step_ms": step_ms}


def child(root: Path, variant: str, args: argparse.Namespace) -> dict:
    env = os.environ | {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--model-dir", args.model_dir,
           "--batch", str(args.batch), "--max-tokens", str(args.max_tokens), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{variant} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def uptime() -> str:
    try:
        return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--steps", type=int, default=120, help="steps timed per round, in steady decode")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--base", action="append", default=[],
                    help="also measure this commit (synchronous, as it is); may be given again")
    ap.add_argument("--sync-only", action="store_true", help="leave out `on` (async scheduling)")
    ap.add_argument("--model-dir", default=str(Path.home() / ".cache" / "rein" / "bench" / "tiny-llama"))
    ap.add_argument("--child", choices=("base", "off", "on"), dest="variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.variant is not None:
        print(json.dumps(measure(args)))
        return 0

    from rein.fixtures.tiny_model import ensure_tiny_model

    ensure_tiny_model(args.model_dir)
    figures: dict[str, list[dict]] = {}
    print(f"# batch {args.batch}, {args.steps} steps timed a round, {args.threads} torch thread(s); {uptime()}",
          flush=True)
    # Each base's label: `base`, then `base2`, `base3`, ...
    bases = {("base" if i == 0 else f"base{i + 1}"): rev for i, rev in enumerate(args.base)}
    with tempfile.TemporaryDirectory(prefix="rein-host-step-") as tmp:
        roots = {label: Path(tmp) / label for label in bases}
        roots |= {"off": HEAD} if args.sync_only else {"off": HEAD, "on": HEAD}
        try:
            for label, rev in bases.items():
                subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(roots[label]), rev], cwd=HEAD,
                               check=True)
            for round_ in range(args.rounds):
                for variant, root in roots.items():
                    figure = child(root, "base" if variant in bases else variant, args)
                    figures.setdefault(variant, []).append(figure)
                    print(f"round {round_ + 1} {variant:5s}: {figure['steps_per_s']:7.1f} steps/s "
                          f"({figure['wall_ms']:.2f} ms wall, {figure['cpu_ms']:.2f} ms CPU a step; "
                          f"{figure['planned_ahead']} planned ahead)", flush=True)
        finally:
            for label in bases:
                subprocess.run(["git", "worktree", "remove", "--force", str(roots[label])], cwd=HEAD, check=False)
    medians = {variant: statistics.median(f["steps_per_s"] for f in rounds) for variant, rounds in figures.items()}
    # Each timed step's fastest round, summed: the run a machine that other processes load leaves
    # least disturbed (the same steps in every round, so they compare step for step).
    best = {variant: 1e3 * args.steps / sum(map(min, zip(*(f["step_ms"] for f in rounds), strict=True)))
            for variant, rounds in figures.items()}
    summary: dict = {"batch": args.batch, "threads": args.threads, "rounds": figures, "median_steps_per_s": medians,
                     "best_steps_per_s": best}
    for label, rev in bases.items():
        summary[label] = rev
    for name, figure in (("median", medians), ("best", best)):
        ratios = {}
        if "on" in figure:
            ratios["on/off"] = figure["on"] / figure["off"]
        for label in bases:
            for variant in ("off", "on"):
                if variant in figure:
                    ratios[f"{variant}/{label}"] = figure[variant] / figure[label]
        summary[f"{name}_ratios"] = ratios
        print(f"{name} steps/s: " + ", ".join(f"{v} {m:.1f}" for v, m in figure.items()) + "; "
              + ", ".join(f"{ratio_name} {ratio:.3f}" for ratio_name, ratio in ratios.items()))
    print(f"# {uptime()}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
