"""Batch lines in prefix order (rein.offline.prefix_order) and `rein run-batch --order`."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from rein.cli.main import main
from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.offline.prefix_order import prefix_ordered
from rein.offline.run_batch import run_batch

# -- the order --------------------------------------------------------------------------------


def test_a_window_holding_every_line_groups_them_by_prefix_in_file_order_within_a_group():
    lines = [(f"line{i}", [i % 4, 7, 7]) for i in range(12)]   # four prefixes, interleaved
    out = list(prefix_ordered(lines, lambda line: line[1], window=100))
    assert [key[0] for _, key in out] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert out == sorted(lines, key=lambda line: (line[1], int(line[0][4:])))   # equal keys: file order


def test_a_window_of_one_keeps_the_file_order():
    lines = [[random.Random(i).randrange(5)] for i in range(30)]
    assert list(prefix_ordered(lines, list, window=1)) == lines


@pytest.mark.parametrize("window", [2, 5, 16])
def test_every_line_comes_out_once_and_the_sweep_goes_on_from_the_last_key(window):
    rng = random.Random(window)
    lines = [(i, [rng.randrange(6), rng.randrange(3)]) for i in range(200)]
    out = list(prefix_ordered(lines, lambda line: line[1], window=window))
    assert sorted(out) == lines
    # Each line taken is the smallest key at or after the previous one among those read so far
    # (or, past the largest, the smallest): count how often the sweep wraps.
    wraps = sum(1 for a, b in itertools.pairwise(out) if b[1] < a[1])
    assert wraps < len(lines) / window + 10


@pytest.mark.parametrize("window", [2, 8])
def test_a_line_behind_the_sweep_is_not_held_back_by_new_lines_sorting_ahead(window):
    def lines():
        yield "start", [5]
        for i in range(6, 6 + window - 1):
            yield f"new{i}", [i]
        yield "old", [0]           # read after "start" is taken: behind the sweep
        for i in itertools.count(6 + window):   # forever, each sorting ahead of the sweep
            yield f"new{i}", [i]

    taken = [name for name, _ in itertools.islice(prefix_ordered(lines(), lambda line: line[1], window), 50)]
    assert taken[:2] == ["start", "new6"]
    assert taken.index("old") == 1 + 2 * window    # read at take 1, taken 2 * window takes later


# -- run-batch --------------------------------------------------------------------------------

SYSTEM_TOKENS = 96     # six blocks of 16
PREFIXES = 4
LINES = 24


def batch_file(path) -> dict[str, list[int]]:
    """Lines over PREFIXES shared prompts, interleaved (line i: prompt i % PREFIXES)."""
    rng = random.Random(0)
    systems = [[rng.randrange(3, 250) for _ in range(SYSTEM_TOKENS)] for _ in range(PREFIXES)]
    prompts = {f"r{i}": systems[i % PREFIXES] + [rng.randrange(3, 250) for _ in range(5)] for i in range(LINES)}
    path.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                                        "body": {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                 "ignore_eos": True}}) + "\n"
                            for cid, prompt in prompts.items()))
    return prompts


def answers(path) -> dict[str, str]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(line["error"] is None for line in lines)
    return {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in lines}


def test_prefix_order_computes_each_shared_prompt_about_once_with_the_same_answers(model_dir, tmp_path):
    """A cache with room for less than two of the four prompts: the file's order evicts each prompt
    before its next line; the prefix order runs a prompt's lines together."""
    src = tmp_path / "in.jsonl"
    prompts = batch_file(src)
    computed, texts = {}, {}
    for order in ("file", "prefix"):
        engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="160KiB", max_num_seqs=2,
                                        max_model_len=256))
        out = tmp_path / f"{order}.jsonl"
        summary = run_batch(engine, src, out, progress=False, order=order, max_in_flight=2)
        assert (summary.requests_ok, summary.requests_failed) == (LINES, 0)
        computed[order], texts[order] = engine.stats.prompt_tokens, answers(out)
    assert texts["file"] == texts["prefix"] and set(texts["file"]) == set(prompts)
    every_token = sum(len(p) for p in prompts.values())
    assert computed["file"] > 0.8 * every_token                 # almost nothing was cached in time
    assert computed["prefix"] < PREFIXES * SYSTEM_TOKENS + LINES * 16 + 1   # a prompt once, then a block a line


def test_run_batch_cli_takes_the_order(model_dir, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_file(src)
    common = ["run-batch", str(src), "-o", str(out), "--model", str(model_dir), "--kv-cache-memory", "1MiB",
              "--max-model-len", "256", "--no-progress"]
    assert main([*common, "--order", "file"]) == 0
    assert len(answers(out)) == LINES
    assert main([*common, "--order-window", "0"]) == 2
    assert "--order-window 0: want at least 1 line" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "--order", "random"])
