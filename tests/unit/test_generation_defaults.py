"""Sampling defaults from a model's generation_config.json (vLLM's `--generation-config`):
read once per model, applied to the fields a request leaves out, on every entry point
(parse_request as the API and the batch validator use it, `rein generate`, `rein run-batch`,
`rein.LLM`); a request's own values win; `vllm` (or `none`) ignores the file."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from rein import LLM, SamplingParams
from rein.cli.main import main
from rein.core.settings import ServedModel
from rein.engine.generation_defaults import (
    GenerationConfigError,
    GenerationDefaults,
    check_generation_config,
    load_generation_defaults,
)
from rein.jobs.registry import ModelLoadError, load_model
from rein.openai.request import parse_request

MAX_LEN = 128
KV = "16MiB"


def write_generation_config(folder, **values) -> None:
    path = folder / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **values}))


@pytest.fixture(scope="module")
def greedy_model(tiny_models, tmp_path_factory):
    """The tiny llama model whose generation_config.json says temperature 0 (and a top_p)."""
    folder = tmp_path_factory.mktemp("greedy-model") / "model"
    shutil.copytree(tiny_models("llama"), folder)
    write_generation_config(folder, temperature=0.0, top_p=0.8, top_k=50, repetition_penalty=1.0)
    return folder


def test_load_reads_the_sampling_fields(greedy_model, tmp_path):
    defaults = load_generation_defaults(greedy_model)
    # top_k 50 and repetition_penalty 1 are transformers' own defaults: vLLM leaves them out too.
    assert dict(defaults.values) == {"temperature": 0.0, "top_p": 0.8}
    assert defaults.sampling_params().greedy and defaults.sampling_params(max_tokens=3).max_tokens == 3
    assert "'temperature': 0.0" in defaults.describe() and "'top_k': 0" in defaults.describe()
    for builtin in ("vllm", "none"):
        assert load_generation_defaults(greedy_model, builtin).values == {}
    # a folder of its own
    write_generation_config(tmp_path, top_k=20, min_p=0.05, do_sample=True, max_new_tokens=9)
    assert dict(load_generation_defaults(greedy_model, str(tmp_path)).values) == {"top_k": 20, "min_p": 0.05}
    # no file: no defaults
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_generation_defaults(empty).values == {}


def test_bad_generation_configs_are_refused(tmp_path):
    with pytest.raises(GenerationConfigError, match="neither 'auto', 'vllm' nor a folder"):
        check_generation_config("greedy")
    with pytest.raises(GenerationConfigError, match="holds no generation_config.json"):
        check_generation_config(str(tmp_path))
    write_generation_config(tmp_path, temperature=7)
    with pytest.raises(GenerationConfigError, match="temperature must be between 0 and 2.*--generation-config vllm"):
        load_generation_defaults(tmp_path)
    write_generation_config(tmp_path, temperature=0.5, top_k=2.5)
    with pytest.raises(GenerationConfigError, match="top_k must be an integer"):
        load_generation_defaults(tmp_path)


def test_parse_request_as_the_api_uses_it(greedy_model):
    """The API's ModelEntry carries the defaults; intake passes them to parse_request."""
    entry = load_model(ServedModel(name="greedy", source=str(greedy_model)))
    assert dict(entry.generation_defaults.values) == {"temperature": 0.0, "top_p": 0.8}

    def params(body, defaults=entry.generation_defaults):
        return parse_request("/v1/completions", {"prompt": "x", **body}, entry.tokenizer, entry.max_model_len,
                             defaults).params

    assert params({}).greedy and params({}).top_p == 0.8
    assert params({"temperature": None}).greedy                        # null is "not given"
    assert params({"temperature": 0.7, "top_p": 1}).temperature == 0.7  # the request's own value wins
    assert params({"temperature": 0.7, "top_p": 1}).top_p == 1.0
    chat = parse_request("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                         entry.tokenizer, entry.max_model_len, entry.generation_defaults).params
    assert chat.greedy
    # the API's intake (and batch validation, which prepares lines the same way) applies them
    from rein.jobs.prepare import prepare
    from rein.jobs.registry import ModelRegistry

    prepared = prepare(ModelRegistry([entry]), "/v1/completions", {"prompt": "x"})
    assert prepared.parsed.params.greedy and prepared.parsed.params.top_p == 0.8
    # no defaults (and `vllm`): rein's built-in ones
    assert params({}, None).temperature == 1.0 and params({}, GenerationDefaults()).top_p == 1.0
    builtin = load_model(ServedModel(name="greedy", source=str(greedy_model)), generation_config="vllm")
    assert builtin.generation_defaults.values == {}
    assert load_model(ServedModel(name="g", source=str(greedy_model)), max_model_len=64).max_model_len == 64
    with pytest.raises(ModelLoadError, match="neither 'auto'"):
        load_model(ServedModel(name="greedy", source=str(greedy_model)), generation_config="nope")


@pytest.fixture(scope="module")
def greedy_llm(greedy_model):
    return LLM(greedy_model, kv_cache_memory=KV, max_num_seqs=2, max_model_len=MAX_LEN, device="cpu")


def test_llm_uses_the_model_defaults(greedy_llm, greedy_model, caplog):
    defaults = greedy_llm.get_default_sampling_params()
    assert defaults.greedy and defaults.top_p == 0.8 and defaults.max_tokens == 16
    prompts = ["def main():", "import os"]
    implicit = greedy_llm.generate(prompts, use_tqdm=False)        # no params: the model's defaults
    greedy = greedy_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in implicit] == [o.outputs[0].token_ids for o in greedy]
    with caplog.at_level(logging.INFO, logger="rein.offline.llm"):
        builtin = LLM(greedy_model, kv_cache_memory=KV, max_num_seqs=2, max_model_len=MAX_LEN, device="cpu",
                      generation_config="vllm")
    assert builtin.get_default_sampling_params().temperature == 1.0
    assert "generation defaults for model" in caplog.text and "ignored" in caplog.text


def test_generate_and_run_batch_use_the_model_defaults(greedy_model, tmp_path, capsys):
    common = ["--model", str(greedy_model), "--kv-cache-memory", KV, "--max-model-len", str(MAX_LEN),
              "--device", "cpu"]
    outputs = []
    for extra in ([], ["--temperature", "0"]):
        assert main(["generate", *common, "def main():", "--max-tokens", "8", "--ignore-eos", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]

    lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "def main():", "max_tokens": 8, "ignore_eos": True, **body}}
             for cid, body in (("implicit", {}), ("greedy", {"temperature": 0}), ("seeded", {"seed": 5}))]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def run(*extra) -> dict[str, str]:
        out = tmp_path / "out.jsonl"
        assert main(["run-batch", str(source), "-o", str(out), "--no-progress", *common, *extra]) == 0
        capsys.readouterr()
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return {row["custom_id"]: row["response"]["body"]["choices"][0]["text"] for row in rows}

    texts = run()
    assert texts["implicit"] == texts["greedy"] == texts["seeded"]
    texts = run("--generation-config", "vllm")       # the file ignored: temperature 1 samples
    assert texts["implicit"] != texts["greedy"]
