"""Embeddings offline: `rein.LLM.embed` and /v1/embeddings lines in `rein run-batch`, mixed
with completion lines in one file."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from rein import LLM, PoolingParams, SamplingParams
from rein.offline.run_batch import run_batch


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(str(tiny_models("qwen3", embedding="last")), kv_cache_memory="8MiB", max_model_len=256,
               dtype="float32", max_num_batched_tokens=32)


def hf_last_token(model_dir, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(hidden[-1], dim=-1)


def test_llm_embed(llm, tiny_models):
    texts = ["The quick brown fox", "jumps over the lazy dog"]
    outputs = llm.embed(texts + [[5, 6, 7]], use_tqdm=False)
    assert len(outputs) == 3
    eos = llm.get_tokenizer().eos_token_id
    assert outputs[0].prompt_token_ids[-1] == eos       # the tokenizer appends it, as Qwen3-Embedding's
    for output in outputs:
        expected = hf_last_token(tiny_models("qwen3", embedding="last"), output.prompt_token_ids)
        assert (torch.tensor(output.outputs.embedding) - expected).abs().max() < 1e-4
    [cut] = llm.embed("The quick brown fox", PoolingParams(dimensions=8), use_tqdm=False)
    full = torch.tensor(outputs[0].outputs.embedding)
    assert torch.allclose(torch.tensor(cut.outputs.embedding), torch.nn.functional.normalize(full[:8], dim=0),
                          atol=1e-6)
    with pytest.raises(ValueError, match="prompt 1: dimensions must be at most 64"):
        llm.embed(["a", "b"], [PoolingParams(), PoolingParams(dimensions=65)], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0 is too long"):
        llm.embed([list(range(300))], use_tqdm=False)
    # The same model still generates (tied embeddings): generation and embeddings share the engine.
    [generated] = llm.generate("The quick", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(generated.outputs[0].token_ids) == 3


def test_run_batch_with_embeddings_lines(llm, tmp_path):
    lines = [
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings", "body": {"input": "The quick brown fox"}},
        {"custom_id": "many", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": ["The quick brown fox", "jumps", "x" * 50], "encoding_format": "base64"}},
        {"custom_id": "gen", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "Hello", "max_tokens": 4, "temperature": 0}},
        {"custom_id": "cut", "method": "POST", "url": "/v1/embeddings",
         "body": {"input": [[5, 6, 7]], "dimensions": 16}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": []}},
        {"custom_id": "long", "method": "POST", "url": "/v1/embeddings", "body": {"input": [[1], list(range(300))]}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    summary = run_batch(llm.engine, source, out, error_path=errors, model_name="tiny-embed", progress=False)
    assert (summary.requests_ok, summary.requests_failed) == (4, 2)

    answers = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    one = answers["one"]["response"]["body"]
    assert one["object"] == "list" and one["model"] == "tiny-embed"
    [entry] = one["data"]
    assert entry["object"] == "embedding" and entry["index"] == 0 and len(entry["embedding"]) == 64
    many = answers["many"]["response"]["body"]
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    decoded = [struct.unpack("<64f", base64.b64decode(d["embedding"])) for d in many["data"]]
    assert decoded[0] == pytest.approx(entry["embedding"], abs=1e-6)   # the same text, the same vector
    assert many["usage"]["prompt_tokens"] == many["usage"]["total_tokens"] == \
        sum(len(llm.get_tokenizer().encode(text)) for text in ("The quick brown fox", "jumps", "x" * 50))
    assert len(answers["cut"]["response"]["body"]["data"][0]["embedding"]) == 16
    assert answers["gen"]["response"]["body"]["object"] == "text_completion"

    failures = {line["custom_id"]: line["error"] for line in map(json.loads, errors.read_text().splitlines())}
    assert "line 5" in failures["bad"]["message"] and "empty list" in failures["bad"]["message"]
    assert failures["long"]["code"] == "context_length_exceeded" and "input[1]" in failures["long"]["message"]
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks and not llm.engine.requests
