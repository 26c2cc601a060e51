"""n > 1, best_of, echo and prompt logprobs offline, on the tiny llama model: `rein.LLM`
(vLLM's outputs: one CompletionOutput per choice, RequestOutput.prompt_logprobs) and
`rein run-batch` (the same bodies as the API's)."""

from __future__ import annotations

import json

import pytest

from rein import LLM, SamplingParams
from rein.offline.run_batch import run_batch

MAX_LEN = 128
PROMPT = "def main():"


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), kv_cache_memory="32MiB", max_num_seqs=4, max_model_len=MAX_LEN)


def test_llm_n_choices_are_each_seeded_choice(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    # Choice i samples as a lone request seeded seed + i (rein.engine.sampling_params).
    for choice in out.outputs:
        alone = SamplingParams(temperature=1.0, seed=7 + choice.index, max_tokens=6, ignore_eos=True)
        (single,) = llm.generate(PROMPT, alone, use_tqdm=False)
        assert single.outputs[0].token_ids == choice.token_ids


def test_llm_prompt_logprobs(llm):
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)
    entries = out.prompt_logprobs
    assert entries is not None and len(entries) == len(out.prompt_token_ids) and entries[0] is None
    for token_id, entry in zip(out.prompt_token_ids[1:], entries[1:], strict=True):
        assert token_id in entry and 2 <= len(entry) <= 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    (plain,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert plain.prompt_logprobs is None


def _run(llm, tmp_path, bodies: dict[str, dict]) -> dict[str, dict]:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": name, "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, **body}})
                           + "\n" for name, body in bodies.items()))
    summary = run_batch(llm.engine, src, dst, progress=False)
    assert summary.requests_failed == 0
    return {line["custom_id"]: line["response"]["body"] for line in map(json.loads, dst.read_text().splitlines())}


def test_run_batch_echo_without_logprobs(llm, tmp_path):
    bodies = _run(llm, tmp_path, {"plain": {"temperature": 0}, "echo": {"temperature": 0, "echo": True}})
    assert bodies["echo"]["choices"][0]["text"] == PROMPT + bodies["plain"]["choices"][0]["text"]
    assert bodies["echo"]["usage"] == bodies["plain"]["usage"] | {"prompt_tokens_details":
                                                                  bodies["echo"]["usage"]["prompt_tokens_details"]}


def test_run_batch_n_best_of_and_echo_logprobs(llm, tmp_path):
    bodies = _run(llm, tmp_path, {
        "n": {"n": 3, "temperature": 1.0, "seed": 3},
        "best_of": {"n": 1, "best_of": 3, "temperature": 1.0, "seed": 3, "logprobs": 0},
        "echo": {"temperature": 0, "echo": True, "logprobs": 1},
    })
    n = bodies["n"]
    assert [c["index"] for c in n["choices"]] == [0, 1, 2]
    assert n["usage"]["completion_tokens"] == 12 and n["usage"]["total_tokens"] == n["usage"]["prompt_tokens"] + 12
    best = bodies["best_of"]
    assert len(best["choices"]) == 1 and best["usage"]["completion_tokens"] == 12   # every choice is billed
    # The kept choice is the likeliest of the three n=3 generated (same seeds).
    def total(choice):
        return sum(choice["logprobs"]["token_logprobs"])
    n_logprobs = _run(llm, tmp_path, {"n": {"n": 3, "temperature": 1.0, "seed": 3, "logprobs": 0}})["n"]
    assert total(best["choices"][0]) == pytest.approx(max(total(c) for c in n_logprobs["choices"]))
    echo = bodies["echo"]["choices"][0]
    assert echo["text"].startswith(PROMPT)
    prompt_tokens = bodies["echo"]["usage"]["prompt_tokens"]
    logprobs = echo["logprobs"]
    assert len(logprobs["tokens"]) == prompt_tokens + 4
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
