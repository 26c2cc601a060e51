"""Two commits side by side: offline throughput and `rein run-batch` tokens/s of this checkout
against another commit, in alternating rounds on the same machine, models and inputs.

    python bench/ab_commits.py --base REV [--rounds 3] [--requests 256] [--max-tokens 64]
                               [--out-dir DIR] [--skip throughput|run-batch]

The base commit is checked out into a temporary git worktree; each measurement runs in a
process of its own with PYTHONPATH at one checkout (base or this one), so each side runs its
own rein and its own bench script. The rounds alternate (base, head, base, head, ...) so drift
on a shared machine falls on both alike; each side's median round is compared.

* throughput: each side's bench/throughput.py, rein alone (`--skip static,batch`), on the
  `small` random-weight model and the `mixed` workload; its `rein_tps`.
* run-batch: `rein run-batch` on one JSONL file of completions (greedy, ignore_eos, the same
  max_tokens for each) on the same `small` model; the `output: N tokens/s` of its summary
  (stderr).

Prints every round and the medians with head/base ratios; the last line of stdout is one JSON
object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HEAD = Path(__file__).resolve().parents[1]


def run(cmd: list[str], root: Path, cwd: Path) -> str:
    env = os.environ | {"PYTHONPATH": str(root), "PYTHONSAFEPATH": "1"}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return done.stdout + done.stderr


def throughput(root: Path, out_dir: Path) -> float:
    out = run([sys.executable, str(root / "bench" / "throughput.py"), "--models", "small", "--workloads", "mixed",
               "--skip", "static,batch", "--out-dir", str(out_dir)], root, out_dir)
    last = next(line for line in reversed(out.splitlines()) if line.startswith("{"))
    return json.loads(last)["results"]["small"]["mixed"]["rein_tps"]


def run_batch(root: Path, out_dir: Path, model: Path, lines: Path) -> float:
    out = run([sys.executable, "-c", "import sys; from rein.cli.main import main; sys.exit(main())", "run-batch",
               str(lines), "-o", str(out_dir / "out.jsonl"), "--model", str(model), "--no-progress"], root, out_dir)
    found = re.search(r"output: ([0-9.]+) tokens/s", out)
    if not found:
        sys.exit(f"no tokens/s in run-batch's output:\n{out[-2000:]}")
    return float(found.group(1))


def batch_lines(path: Path, requests: int, max_tokens: int) -> None:
    words = "the quick brown fox jumps over a lazy dog while seven silver birds sing".split()
    with path.open("w") as f:
        for i in range(requests):
            prompt = " ".join(words[(i + k) % len(words)] for k in range(8 + i % 24))
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (e.g. HEAD~5, a hash)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=256, help="run-batch lines")
    ap.add_argument("--max-tokens", type=int, default=64, help="each run-batch line's max_tokens")
    ap.add_argument("--out-dir", default=".cache/bench-models", help="where the models are built/reused")
    ap.add_argument("--skip", default="", help="comma list: throughput, run-batch")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)

    from rein.fixtures.tiny_model import make_tiny_model

    model = out_dir / "ab-small"
    if not (model / "config.json").exists():
        make_tiny_model(model, arch="llama", preset="small", seed=0)
    lines = out_dir / "ab-lines.jsonl"
    batch_lines(lines, args.requests, args.max_tokens)

    figures: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="rein-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(base), args.base], cwd=HEAD, check=True)
        try:
            sides = {"base": base, "head": HEAD}
            print(f"# base {args.base}, head {HEAD}; {args.rounds} rounds, alternating", flush=True)
            for round_ in range(args.rounds):
                for side, root in sides.items():
                    if "throughput" not in skip:
                        tps = throughput(root, out_dir)
                        figures.setdefault("throughput", {}).setdefault(side, []).append(tps)
                        print(f"round {round_ + 1} {side}: throughput {tps:.1f} tok/s", flush=True)
                    if "run-batch" not in skip:
                        tps = run_batch(root, out_dir, model, lines)
                        figures.setdefault("run-batch", {}).setdefault(side, []).append(tps)
                        print(f"round {round_ + 1} {side}: run-batch {tps:.1f} tok/s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=HEAD, check=False)

    summary = {}
    for name, sides_figures in figures.items():
        base_median = statistics.median(sides_figures["base"])
        head_median = statistics.median(sides_figures["head"])
        summary[name] = {"base": sides_figures["base"], "head": sides_figures["head"], "base_median": base_median,
                         "head_median": head_median, "head_over_base": head_median / base_median}
        print(f"{name}: base {base_median:.1f} tok/s, head {head_median:.1f} tok/s, head/base "
              f"{head_median / base_median:.3f}")
    print(json.dumps({"base": args.base, "rounds": args.rounds, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
