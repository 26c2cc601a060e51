"""`rein.LLM` (the vLLM-style offline API) on the tiny llama model: the same answers as the
engine and `rein run-batch`, every prompt form, per-prompt params, chat templates, input
order, logprobs, errors that name the prompt, and a torch-free `import rein`."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from dataclasses import fields

import pytest

import rein.offline.llm as llm_module
from rein import LLM, CompletionOutput, GenerationOutput, Logprob, RequestOutput, SamplingParams
from rein.engine.config import EngineConfig
from rein.offline.driver import drive
from rein.offline.run_batch import run_batch

MAX_LEN = 128
WINDOW = 3
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = ["def main():", "import os", "class Point:", "for i in range(10):", "x = 1"]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), kv_cache_memory="32MiB", max_num_seqs=2, max_model_len=MAX_LEN,
               max_in_flight=WINDOW)


def engine_greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """The reference: the prompts' requests added straight to the engine and stepped to the end."""
    engine = llm.engine
    ids = [f"reference-{i}" for i in range(len(prompts))]
    for request_id, token_ids in zip(ids, prompts, strict=True):
        engine.add_request(request_id, token_ids, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[request_id] for request_id in ids]


def completion(out: GenerationOutput) -> CompletionOutput:
    (only,) = out.outputs
    return only


def test_greedy_matches_the_engine_and_run_batch(llm, tmp_path):
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    tokenizer = llm.get_tokenizer()
    reference = engine_greedy(llm, [o.prompt_token_ids for o in outputs], GREEDY)
    for prompt, out, expected in zip(PROMPTS, outputs, reference, strict=True):
        assert out.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=True)
        got = completion(out)
        assert got.token_ids == expected
        assert got.text == tokenizer.decode(got.token_ids)
        assert (got.index, got.finish_reason, got.stop_reason) == (0, "length", None)
        assert got.logprobs is None and got.cumulative_logprob is None

    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}})
                           + "\n" for i, p in enumerate(PROMPTS)))
    run_batch(llm.engine, src, dst, progress=False)
    batch = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
             for line in map(json.loads, dst.read_text().splitlines())}
    assert [batch[str(i)] for i in range(len(PROMPTS))] == [completion(o).text for o in outputs]


def test_prompt_forms(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("import os", add_special_tokens=True)
    by_text = completion(llm.generate("import os", GREEDY, use_tqdm=False)[0]).token_ids

    (one,) = llm.generate(ids, GREEDY, use_tqdm=False)          # a list of ints is one prompt
    assert one.prompt is None and one.prompt_token_ids == ids
    assert completion(one).token_ids == by_text

    outs = llm.generate([ids, {"prompt_token_ids": ids}, {"prompt": "import os"}, "import os", (7, 8, 9)],
                        GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == [None, None, "import os", "import os", None]
    assert [completion(o).token_ids for o in outs[:4]] == [by_text] * 4
    assert outs[4].prompt_token_ids == [7, 8, 9]
    assert len({o.request_id for o in outs}) == len(outs)
    assert llm.generate([], GREEDY) == []


def test_per_prompt_params_and_input_order(llm, monkeypatch):
    # The first prompt asks for the most tokens, so prompts finish in the reverse of input order.
    max_tokens = [9, 7, 5, 3, 1]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    finished_order: list[int] = []
    in_engine: list[int] = []

    def spy_drive(engine, items, admit, finish, max_in_flight):
        def spy_finish(done):
            finished_order.append(done.state)
            finish(done)
        return drive(engine, items, admit, spy_finish, max_in_flight)

    add_request = llm.engine.add_request

    def spy_add(*args, **kwargs):
        in_engine.append(len(llm.engine.requests) + 1)
        return add_request(*args, **kwargs)

    monkeypatch.setattr(llm_module, "drive", spy_drive)
    monkeypatch.setattr(llm.engine, "add_request", spy_add)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert [len(completion(o).token_ids) for o in outputs] == max_tokens
    assert all(completion(o).finish_reason == "length" for o in outputs)
    assert finished_order != sorted(finished_order)              # they did finish out of order
    assert len(in_engine) == len(PROMPTS) and max(in_engine) <= WINDOW


def test_chat_applies_the_template(llm):
    tokenizer = llm.get_tokenizer()
    first = [{"role": "user", "content": "Hi"}]
    second = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    (single,) = llm.chat(first, GREEDY, use_tqdm=False)
    pair = llm.chat([first, second], GREEDY, use_tqdm=False)
    templated = [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
                 for c in (first, second)]
    reference = engine_greedy(llm, templated, GREEDY)
    for out, expected, tokens in [(single, templated[0], reference[0]), (pair[0], templated[0], reference[0]),
                                  (pair[1], templated[1], reference[1])]:
        assert out.prompt_token_ids == expected
        assert out.prompt == tokenizer.decode(expected, skip_special_tokens=False)
        assert completion(out).token_ids == tokens
    with pytest.raises(ValueError, match=r"^conversation 1: messages\[0\]\.role"):
        llm.chat([first, [{"role": "wizard", "content": "x"}]], GREEDY)


def test_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True)
    (out,) = llm.generate("def main():", params, use_tqdm=False)
    got = completion(out)
    assert len(got.logprobs) == len(got.token_ids) == 4
    for token_id, entry in zip(got.token_ids, got.logprobs, strict=True):
        assert next(iter(entry)) == token_id                  # the chosen token first
        assert len(entry) == 2                                # greedy: the chosen token is the top one
        assert entry[token_id].rank == 1
        assert all(isinstance(lp, Logprob) and lp.logprob <= 0 and isinstance(lp.decoded_token, str)
                   for lp in entry.values())
        assert sorted(lp.rank for lp in entry.values()) == [1, 2]
    chosen = [entry[t].logprob for t, entry in zip(got.token_ids, got.logprobs, strict=True)]
    assert got.cumulative_logprob == pytest.approx(sum(chosen))

    sampled = SamplingParams(temperature=1.0, max_tokens=4, logprobs=0, seed=3, ignore_eos=True)
    got = completion(llm.generate("def main():", sampled, use_tqdm=False)[0])
    assert [list(e) for e in got.logprobs] == [[t] for t in got.token_ids]   # logprobs=0: the chosen only
    assert all(entry[t].rank is None for t, entry in zip(got.token_ids, got.logprobs, strict=True))  # unknown


def test_bad_prompts_name_their_index_before_any_work(llm, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("a request reached the engine")

    monkeypatch.setattr(llm.engine, "add_request", no_work)
    vocab = llm.engine.spec.vocab_size
    cases = [
        (["ok", "x " * MAX_LEN], r"^prompt 1 is too long for the context: \d+ prompt tokens \+ max_tokens 6"),
        (["ok", "fine", ""], r"^prompt 2: the prompt is empty"),
        (["ok", []], r"^prompt 1: the prompt is empty"),
        ([[1, 2], [3, vocab]], rf"^prompt 1: token id {vocab} \(at position 1\) is outside the vocabulary"),
        ([[1, -1]], r"^prompt 0: token id -1"),
        (["ok", [1, "2"]], r"^prompt 1: token ids must be integers"),
        ([{"prompt_token_ids": [1], "mm_processor_kwargs": {}}], r"^prompt 0: unsupported keys"),
        # images (rein.model.vision) come with text holding the model's placeholders
        ([{"prompt_token_ids": [1], "multi_modal_data": {}}], r"^prompt 0: a prompt with multi_modal_data needs"),
        (["ok", 3.5], r"^prompt 1: expected text"),
    ]
    for prompts, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompts, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate(["a", "b"], [GREEDY, {"max_tokens": 3}], use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_progress_bar_goes_to_stderr(llm, capsys):
    llm.generate(["a", "b"], GREEDY)
    captured = capsys.readouterr()
    assert "Processed prompts" in captured.err and "2/2" in captured.err and captured.out == ""
    llm.generate(["a"], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_an_error_mid_run_aborts_what_is_in_flight(llm):
    def admit(index):
        request_id = f"mid-run-{index}"
        llm.engine.add_request(request_id, [5, 6, 7], GREEDY)
        return request_id, index

    def finish(done):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        drive(llm.engine, range(4), admit, finish, max_in_flight=2)
    llm.engine.step()                                   # hands back the aborted requests' last outputs
    assert not llm.engine.has_unfinished() and not llm.engine.requests
    assert len(llm.generate(["a"], GREEDY, use_tqdm=False)) == 1


def test_engine_arguments():
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    signature = inspect.signature(LLM.__init__).parameters
    shared = set(defaults) & set(signature) - {"model"}
    assert shared >= {"dtype", "kv_cache_dtype", "max_num_seqs", "max_model_len", "enable_prefix_caching", "seed",
                      "gpu_memory_utilization", "enforce_eager", "block_size", "max_num_batched_tokens"}
    assert set(defaults) - {"model"} <= set(signature)           # every engine setting is reachable
    assert {name: signature[name].default for name in shared} == {name: defaults[name] for name in shared}
    # Refused before any model is loaded.
    with pytest.raises(ValueError, match="quantization 'fp8' is not one rein knows"):
        LLM("no-such-model", quantization="fp8")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not supported"):
        LLM("no-such-model", pipeline_parallel_size=2)
    assert RequestOutput is GenerationOutput


def test_import_rein_stays_torch_free():
    code = ("import sys, rein, rein.offline, rein.cli.main; print('torch' in sys.modules); "
            "from rein import LLM, SamplingParams; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]
