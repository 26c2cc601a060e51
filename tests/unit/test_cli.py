"""`rein run-batch`, `rein generate` and `rein estimate` on the tiny llama model."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest

from rein.cli.main import main
from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.offline.run_batch import BatchSummary, run_batch

KV = "64MiB"
MAX_LEN = 512


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=KV, max_num_seqs=4, max_model_len=MAX_LEN))


def batch_line(custom_id, url="/v1/completions", **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


GOOD = {"chat-ok", "chat-lp", "comp-ok", "comp-lp", "comp-ids"}
# input line number -> (custom_id, code, words in the message)
BAD = {
    5: (None, "invalid_json_line", "not valid JSON"),
    6: (None, "invalid_request_error", "custom_id"),
    7: ("wrong-url", "invalid_request_error", "url"),
    8: ("chat-ok", "duplicate_custom_id", "already used"),
    9: ("too-long", "context_length_exceeded", "maximum context length is 512 tokens"),
    10: ("bad-param", "invalid_request_error", "temperature"),
    12: ("bad-token", "invalid_request_error", "vocabulary"),
}


def write_input(path) -> None:
    lines = [
        batch_line("chat-ok", "/v1/chat/completions", model="my-model", max_tokens=4,
                   messages=[{"role": "user", "content": "Hi"}]),
        batch_line("chat-lp", "/v1/chat/completions", max_tokens=3, logprobs=True, top_logprobs=2,
                   messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]),
        batch_line("comp-ok", prompt="def main():", max_tokens=5, temperature=0),
        batch_line("comp-lp", prompt="import os", max_tokens=3, logprobs=1, seed=7),
        '{"custom_id": "broken", "method": ',                                 # 5 bad JSON
        json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}),  # 6
        batch_line("wrong-url", "/v1/rerank", input="x"),                      # 7
        batch_line("chat-ok", prompt="again"),                                 # 8 duplicate
        batch_line("too-long", prompt="x", max_tokens=MAX_LEN),                # 9
        batch_line("bad-param", prompt="x", temperature=5),                    # 10
        "   ",                                                                 # 11 blank: skipped
        batch_line("bad-token", prompt=[1, 2, 10**6]),                         # 12 outside the vocab
        batch_line("comp-ids", prompt=[10, 20, 30], max_tokens=2),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_output(lines: list[dict], model_name: str) -> None:
    assert len(lines) == len(GOOD) + len(BAD)
    ok = [x for x in lines if x["error"] is None]
    errors = [x for x in lines if x["error"] is not None]
    assert Counter(x["custom_id"] for x in ok) == Counter(GOOD)   # each answered once
    for x in errors:
        assert x["response"] is None
        number = int(re.match(r"line (\d+):", x["error"]["message"]).group(1))
        custom_id, code, words = BAD[number]
        assert (x["custom_id"], x["error"]["code"]) == (custom_id, code)
        assert words in x["error"]["message"]
    assert sorted(int(re.match(r"line (\d+)", x["error"]["message"]).group(1)) for x in errors) == sorted(BAD)

    by_id = {x["custom_id"]: x for x in ok}
    for custom_id, x in by_id.items():
        assert x["id"].startswith("batch_req_")
        response = x["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["id"].endswith(response["request_id"])
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
        if custom_id.startswith("chat"):
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert isinstance(choice["text"], str)
    assert by_id["chat-ok"]["response"]["body"]["model"] == "my-model"
    assert by_id["comp-ok"]["response"]["body"]["model"] == model_name
    assert by_id["chat-ok"]["response"]["body"]["usage"]["completion_tokens"] <= 4
    assert by_id["comp-ids"]["response"]["body"]["usage"]["prompt_tokens"] == 3
    assert by_id["chat-ok"]["response"]["body"]["choices"][0]["logprobs"] is None

    chat_lp = by_id["chat-lp"]["response"]["body"]
    content = chat_lp["choices"][0]["logprobs"]["content"]
    assert len(content) == chat_lp["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    comp_lp = by_id["comp-lp"]["response"]["body"]["choices"][0]["logprobs"]
    n = by_id["comp-lp"]["response"]["body"]["usage"]["completion_tokens"]
    assert len(comp_lp["tokens"]) == len(comp_lp["token_logprobs"]) == len(comp_lp["text_offset"]) == n
    assert all(1 <= len(top) <= 2 for top in comp_lp["top_logprobs"])


def test_run_batch_answers_every_line_once(engine, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(src)
    summary = run_batch(engine, src, out, progress=False)
    lines = read_jsonl(out)
    check_output(lines, engine.model_dir.name)
    assert isinstance(summary, BatchSummary)
    assert (summary.requests_ok, summary.requests_failed) == (len(GOOD), len(BAD))
    ok = [x["response"]["body"]["usage"] for x in lines if x["error"] is None]
    assert summary.completion_tokens == sum(u["completion_tokens"] for u in ok)
    assert summary.prompt_tokens == sum(u["prompt_tokens"] for u in ok)
    assert summary.wall_seconds > 0 and summary.output_tokens_per_second > 0
    assert not engine.has_unfinished()


def test_run_batch_keeps_a_bounded_window(engine, tmp_path, monkeypatch):
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    src.write_text("".join(batch_line(f"r{i}", prompt=f"line {i}", max_tokens=2 + i % 3) + "\n"
                           for i in range(12)) + "{oops\n")
    in_engine = []
    add_request = engine.add_request

    def spy(*args, **kwargs):
        in_engine.append(len(engine.requests) + 1)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", spy)
    summary = run_batch(engine, src, out, error_path=err, max_in_flight=3, progress=False)
    assert max(in_engine) <= 3 and len(in_engine) == 12
    assert sorted(x["custom_id"] for x in read_jsonl(out)) == sorted(f"r{i}" for i in range(12))
    (error,) = read_jsonl(err)
    assert error["error"]["message"].startswith("line 13:")
    assert (summary.requests_ok, summary.requests_failed) == (12, 1)


def test_run_batch_cli(model_dir, tmp_path, capsys):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(src)
    code = main(["run-batch", str(src), "-o", str(out), "--model", str(model_dir), "--kv-cache-memory", KV,
                 "--max-model-len", str(MAX_LEN), "--max-num-seqs", "2"])
    assert code == 0
    check_output(read_jsonl(out), model_dir.name)
    err = capsys.readouterr().err
    assert f"{len(GOOD)} ok, {len(BAD)} failed" in err
    assert "tokens/s" in err


def test_run_batch_cli_missing_input(model_dir, tmp_path, capsys):
    assert main(["run-batch", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl"),
                 "--model", str(model_dir)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_generate_streams_the_greedy_text(model_dir, engine, capsys):
    prompt = "def main():"
    code = main(["generate", "--model", str(model_dir), prompt, "--max-tokens", "6", "--temperature", "0",
                 "--ignore-eos", "--kv-cache-memory", KV, "--max-model-len", str(MAX_LEN)])
    assert code == 0
    captured = capsys.readouterr()
    # the same request straight through the engine
    engine.add_request("expected", engine.tokenizer.encode(prompt, add_special_tokens=True),
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text_delta for o in engine.step())
    assert captured.out == text + "\n"
    assert "6 tokens" in captured.err and "tokens/s" in captured.err and "finish reason: length" in captured.err


def test_generate_chat_and_errors(model_dir, capsys):
    args = ["generate", "--model", str(model_dir), "Hi", "--kv-cache-memory", KV, "--max-model-len", "24"]
    assert main([*args, "--chat", "--max-tokens", "3", "--seed", "1"]) == 0
    assert "finish reason" in capsys.readouterr().err
    # without --max-tokens: what is left of a short context
    assert main([*args, "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    prompt_len = int(re.search(r"\[(\d+) prompt tokens", err).group(1))
    assert f"{24 - prompt_len} tokens in" in err and "finish reason: length" in err
    assert main([*args, "--max-tokens", "100"]) == 2
    assert "maximum context length is 24 tokens" in capsys.readouterr().err
    assert main([*args, "--temperature", "9"]) == 2
    assert "temperature must be between 0 and 2" in capsys.readouterr().err


def tiny_config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_estimate_matches_hand_arithmetic(model_dir, capsys):
    c = tiny_config(model_dir)
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // heads
    assert not c["tie_word_embeddings"] and not c["attention_bias"]
    # q, k, v, o projections + gate/up/down + two norms per layer; embeddings, lm head, final norm
    per_layer = hidden * (heads * head_dim) * 2 + hidden * (kv_heads * head_dim) * 2 + 3 * hidden * inter + 2 * hidden
    params = 2 * vocab * hidden + layers * per_layer + hidden
    weights = params * 4                                   # float32
    per_token = 2 * layers * kv_heads * head_dim * 4       # K and V, float32
    memory = 64 * 1024**2
    blocks = (memory - weights) // (per_token * 16)
    context = 300
    concurrent = blocks // math.ceil(context / 16)

    code = main(["estimate", "--model", str(model_dir), "--memory", "64MiB", "--dtype", "float32",
                 "--context-len", str(context)])
    assert code == 0
    out = capsys.readouterr().out
    assert f"{params:,} parameters x 4 bytes (float32) = {weights:,} bytes" in out
    assert (f"2 x {layers} layers x {kv_heads} kv_heads x {head_dim} head_dim x 4 bytes (float32) "
            f"= {per_token:,} bytes") in out
    assert f"{memory:,} - {weights:,} = {memory - weights:,} bytes" in out
    assert f"{blocks:,} blocks x 16 tokens = {blocks * 16:,} tokens" in out
    assert f"concurrent requests at {context} tokens: {concurrent:,}" in out


def test_estimate_int8_and_too_little_memory(model_dir, capsys):
    c = tiny_config(model_dir)
    layers, kv_heads = c["num_hidden_layers"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * layers * kv_heads * head_dim * 1 + 2 * layers * kv_heads * 4   # int8 + fp32 scales
    assert main(["estimate", "--model", str(model_dir), "--memory", "1GiB", "--dtype", "bfloat16",
                 "--kv-cache-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert f"= {per_token} bytes" in out and "(bfloat16)" in out
    assert main(["estimate", "--model", str(model_dir), "--memory", "100KiB", "--dtype", "float32"]) == 2
    assert "weights alone" in capsys.readouterr().err


def test_estimate_splits_a_windowed_models_kv_by_layer_kind(tmp_path, capsys):
    """Gemma 3's shape (config only): five windowed layers to one full-attention layer."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=128,
                              max_position_embeddings=4096)
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(tmp_path)
    assert main(["estimate", "--model", str(tmp_path), "--memory", "64MiB", "--dtype", "float32",
                 "--max-model-len", "2048"]) == 0
    out = capsys.readouterr().out
    per_layer = 2 * 1 * 32 * 4
    assert (f"5 sliding-window layers (window 128) x {per_layer} + 1 full-attention layers x {per_layer} "
            f"bytes per token") in out
    assert f"windowed layers attend to 128 positions ({5 * per_layer * 128:,} bytes of their " \
           f"{5 * per_layer * 2048:,})" in out
    # The windowed layers' own storage: its bound (64 seqs x (128/16 + 1) + 2048/16 + 64 blocks),
    # and the full-attention layers' pool takes the rest at 1/6 of the bytes per block.
    bound = 64 * 9 + 128 + 64
    weights = int(out.split(" = ")[1].split(" bytes")[0].replace(",", ""))
    full_blocks = (64 * 2**20 - weights - bound * 5 * per_layer * 16) // (per_layer * 16)
    assert f"rein keeps only what the windows cover: the windowed layers' own storage holds {bound:,} blocks" in out
    assert f"KV cache (full-attention layers): {full_blocks:,} blocks x 16 tokens" in out
    assert full_blocks > 4 * (64 * 2**20 - weights) // (6 * per_layer * 16)   # over 4x keeping every position
    assert main(["estimate", "--model", str(tmp_path), "--memory", "64MiB", "--dtype", "float32",
                 "--max-model-len", "2048", "--max-num-seqs", "512"]) == 0
    assert "rein keeps every position in every layer" in capsys.readouterr().out


def test_estimate_counts_a_transformers_backend_models_own_parameters(tmp_path, capsys):
    """An architecture without native code (Phi-3): the spec is the Transformers backend's and the
    weights are counted on the model transformers builds (meta device, no weights needed)."""
    from transformers import AutoModelForCausalLM, Phi3Config

    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config.architectures = ["Phi3ForCausalLM"]
    config.save_pretrained(tmp_path)
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert main(["estimate", "--model", str(tmp_path), "--memory", "64MiB", "--dtype", "float32"]) == 0
    assert f"weights: {params:,} parameters x 4 bytes (float32)" in capsys.readouterr().out
    assert main(["estimate", "--model", str(tmp_path), "--memory", "64MiB", "--model-impl", "rein"]) == 2
    assert "--model-impl transformers" in capsys.readouterr().err


def test_estimate_per_rank_under_tensor_parallelism(model_dir, capsys):
    """--tensor-parallel-size: one rank's weights and KV cache. The tiny llama's two KV heads split
    over two ranks; over four they are replicated, so a rank's cache costs what it does at two."""
    c = tiny_config(model_dir)
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads, kv_heads, inter = c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    head_dim = c.get("head_dim") or hidden // heads
    assert (heads, kv_heads) == (4, 2)
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter + 2 * hidden
    params = 2 * vocab * hidden + layers * per_layer + hidden
    for size, rank_kv_heads in ((2, 1), (4, 1)):
        # a rank: its query heads, its KV head (its own at 2, a copy at 4), its slices; norms whole
        rank_layer = (2 * hidden * (heads // size) * head_dim + 2 * hidden * rank_kv_heads * head_dim
                      + 3 * hidden * (inter // size) + 2 * hidden)
        rank_params = 2 * (vocab // size) * hidden + layers * rank_layer + hidden
        weights = params * 4 * rank_params // params
        per_token = 2 * layers * rank_kv_heads * head_dim * 4
        blocks = (64 * 1024**2 - weights) // (per_token * 16)
        assert main(["estimate", "--model", str(model_dir), "--memory", "64MiB", "--dtype", "float32",
                     "--tensor-parallel-size", str(size)]) == 0
        out = capsys.readouterr().out
        assert f"weights per rank: {rank_params:,} of {params:,} parameters = about {weights:,} bytes" in out
        assert f"2 x {layers} layers x {rank_kv_heads} kv_heads x {head_dim} head_dim x 4 bytes" in out
        assert f"{blocks:,} blocks x 16 tokens" in out
        replicated = "1 KV head of 2, replicated: each KV head is computed and cached on 2 ranks"
        assert (replicated in out) == (size == 4)
    assert main(["estimate", "--model", str(model_dir), "--memory", "64MiB", "--tensor-parallel-size", "3"]) == 2
    assert "tensor parallel size 3 does not divide the model's 4 attention heads" in capsys.readouterr().err
