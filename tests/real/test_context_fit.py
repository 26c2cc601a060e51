"""`rein run-batch --model <Gemma 3 270M GGUF>` with no length flags answers on the CPU: the
model's own 32768-token context does not fit the default 1 GiB CPU KV cache, so the engine takes
the most that fits (max_model_len auto, rein.engine.model_runner) and says so in its log, where
it used to refuse ("the KV cache holds 29120 tokens, fewer than max_model_len 32768").

The model comes under Gemma's terms: `rein fetch-model gemma3-270m` fetches it into the cache
for these tests; rein never ships it. Without it the tests skip (fail under CI=true).
"""

from __future__ import annotations

import json
import logging

import pytest
from real_support import torch_threads

pytestmark = pytest.mark.real


def test_run_batch_answers_with_no_length_flags(gemma_path, tmp_path, monkeypatch, caplog):
    from rein.cli.main import main

    for name in ("REIN_MAX_MODEL_LEN", "REIN_KV_CACHE_MEMORY", "REIN_DEVICE"):
        monkeypatch.delenv(name, raising=False)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                               "body": {"prompt": "The capital of France is", "max_tokens": 4,
                                        "temperature": 0}}) + "\n")
    with torch_threads(1), caplog.at_level(logging.INFO, logger="rein.engine.model_runner"):
        code = main(["run-batch", str(src), "-o", str(out), "--model", str(gemma_path), "--device", "cpu",
                     "--no-progress"])
    assert code == 0
    [line] = [json.loads(x) for x in out.read_text().splitlines()]
    assert line["error"] is None and line["response"]["status_code"] == 200
    assert line["response"]["body"]["usage"]["completion_tokens"] == 4
    assert "max_model_len auto: 29120 of the model's 32768 fit the KV cache" in caplog.text
