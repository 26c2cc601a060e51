"""One set of engine options (rein.engine.options) for `rein worker`, `rein run-batch`,
`rein generate` and `rein.LLM`: the same flags, each with its REIN_* variable, resolved
flag > variable > default; the defaults agree everywhere; Celery's flags on the worker."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import fields

import pytest

from rein.cli.engine_flags import CLIError, engine_config_from_args
from rein.cli.main import build_parser
from rein.cli.worker import served_model_for, worker_engine_config, worker_hostname, worker_settings
from rein.core.settings import EngineSettings, Settings, load_engine_settings
from rein.engine.config import EngineConfig
from rein.engine.options import ENGINE_OPTIONS, options_for, resolve_engine_values
from rein.offline.llm import LLM

pytestmark = pytest.mark.usefixtures("clean_rein_env")


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def engine_flags(command: str) -> set[str]:
    parser = subparser(command)
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {s for a in group._group_actions if a.help != argparse.SUPPRESS for s in a.option_strings}


def parse(command: str, *argv: str) -> argparse.Namespace:
    positional = {"worker": [], "run-batch": ["in.jsonl", "-o", "out.jsonl", "--model", "m"],
                  "generate": ["hi", "--model", "m"]}[command]
    return build_parser().parse_args([command, *positional, *argv])


def test_the_commands_share_one_set_of_options(capsys):
    offline = engine_flags("run-batch")
    assert offline - {"--tool-call-parser"} == engine_flags("generate")     # generate takes no tools
    assert offline - engine_flags("worker") == {"--generation-config", "--reasoning-parser",
                                                "--tool-call-parser"}   # the API applies those
    assert {"--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--interactive-step-budget",
            "--gpu-memory-utilization",
            "--kv-cache-memory", "--kv-cache-dtype", "--dtype", "--device", "--block-size", "--enable-prefix-caching",
            "--no-enable-prefix-caching", "--enforce-eager", "--no-enforce-eager", "--async-scheduling",
            "--no-async-scheduling", "--seed",
            "--generation-config", "--model-impl", "--tokenizer", "--revision", "--tokenizer-revision",
            "--chat-template", "--trust-remote-code", "--no-trust-remote-code", "--tensor-parallel-size",
            "--quantization", "--enable-lora", "--no-enable-lora", "--max-loras", "--max-cpu-loras",
            "--max-lora-rank", "--reasoning-parser", "--tool-call-parser", "--max-num-encoder-tokens",
            "--encoder-cache-tokens", "--max-image-pixels", "--quantized-activations"} == offline
    # what intake applies: the context length, sampling defaults, the tokenizer and template it encodes
    # with, and what it checks LoRA adapters against
    assert engine_flags("api") == {"--max-model-len", "--generation-config", "--tokenizer", "--revision",
                                   "--tokenizer-revision", "--chat-template", "--trust-remote-code",
                                   "--no-trust-remote-code", "--enable-lora", "--no-enable-lora",
                                   "--max-lora-rank", "--reasoning-parser", "--tool-call-parser"}
    for command in ("worker", "run-batch", "generate", "api"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        shown = capsys.readouterr().out
        for option in options_for(command):
            assert option.flag in shown and option.variable in shown, (command, option.name)
    assert "--served-model-name" in {s for a in subparser("run-batch")._actions for s in a.option_strings}
    # the old spelling still parses
    assert parse("run-batch", "--no-prefix-caching").enable_prefix_caching is False


def test_defaults_agree_everywhere():
    config = {f.name: f.default for f in fields(EngineConfig)}
    signature = inspect.signature(LLM.__init__).parameters
    for option in ENGINE_OPTIONS:
        assert option.name in EngineSettings.model_fields and option.name in Settings.model_fields
        assert option.default == config[option.name] == signature[option.name].default, option.name
    assert set(config) - {"model"} == {o.name for o in ENGINE_OPTIONS}      # every engine setting has a flag


@pytest.fixture
def env(monkeypatch):
    def set_(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(f"REIN_{name.upper()}", value)
    return set_


@pytest.mark.parametrize("command", ["run-batch", "generate"])
def test_offline_precedence_flag_variable_default(command, env):
    config = engine_config_from_args(parse(command), command)
    assert (config.max_num_seqs, config.gpu_memory_utilization, config.block_size, config.seed) == (64, 0.9, 16, 0)
    assert config.enable_prefix_caching is True and config.generation_config == "auto"
    env(max_num_seqs="8", gpu_memory_utilization="0.5", block_size="32", seed="3", enable_prefix_caching="false",
        generation_config="vllm", max_model_len="512", device="cpu")
    config = engine_config_from_args(parse(command), command)
    assert (config.max_num_seqs, config.gpu_memory_utilization, config.block_size, config.seed) == (8, 0.5, 32, 3)
    assert (config.enable_prefix_caching, config.generation_config, config.max_model_len) == (False, "vllm", 512)
    args = parse(command, "--max-num-seqs", "4", "--gpu-memory-utilization", "0.7", "--seed", "9",
                 "--enable-prefix-caching", "--generation-config", "auto", "--max-model-len", "256")
    config = engine_config_from_args(args, command)
    assert (config.max_num_seqs, config.gpu_memory_utilization, config.seed, config.block_size) == (4, 0.7, 9, 32)
    assert (config.enable_prefix_caching, config.generation_config, config.max_model_len) == (True, "auto", 256)
    env(gpu_memory_utilization="1.5")
    with pytest.raises(ValueError, match="REIN_GPU_MEMORY_UTILIZATION"):
        engine_config_from_args(parse(command), command)


def test_resolve_engine_values_takes_none_as_not_given(env):
    env(enforce_eager="true")
    values = resolve_engine_values({"enforce_eager": None, "max_num_seqs": 2})
    assert values["enforce_eager"] is True and values["max_num_seqs"] == 2
    assert resolve_engine_values({"enforce_eager": False})["enforce_eager"] is False
    assert load_engine_settings().enforce_eager is True


def test_llm_keywords_then_variables_then_defaults(env, monkeypatch):
    made = []

    class FakeEngine:                       # records the config; loads no model
        def __init__(self, config):
            made.append(config)
            raise RuntimeError("stop here")

    monkeypatch.setattr("rein.engine.engine.LLMEngine", FakeEngine)
    env(max_num_seqs="8", enforce_eager="true", kv_cache_memory="64MiB")
    for kwargs, expected in (({}, (8, True, 64 * 2**20)),
                             ({"max_num_seqs": 2, "enforce_eager": False, "kv_cache_memory_bytes": 1024},
                              (2, False, 1024))):
        with pytest.raises(RuntimeError, match="stop here"):
            LLM("some-model", **kwargs)
        config = made.pop()
        assert (config.max_num_seqs, config.enforce_eager, config.kv_cache_memory) == expected
        assert config.block_size == 16 and config.generation_config == "auto"


def worker_args(*argv: str) -> argparse.Namespace:
    return parse("worker", *argv)


@pytest.fixture
def settings(env):
    env(models="llama=/models/llama@4096,qwen=/models/qwen", max_num_seqs="8", max_model_len="2048",
        redis_key_prefix="t")
    return Settings()


def test_worker_precedence(settings):
    served = served_model_for(worker_args(), settings)
    resolved = worker_settings(worker_args(), settings, served)
    assert served.name == "llama" and resolved.max_num_seqs == 8 and resolved.max_model_len == 4096  # @N
    assert served_model_for(worker_args("--model", ""), settings).name == "llama"    # compose's empty WORKER_MODEL
    qwen = served_model_for(worker_args("--model", "qwen"), settings)
    assert worker_settings(worker_args("--model", "qwen"), settings, qwen).max_model_len == 2048   # REIN_*
    args = worker_args("--max-model-len", "1024", "--max-num-seqs", "3", "--gpu-memory-utilization", "0.5",
                       "--no-enable-prefix-caching", "--device", "cpu")
    resolved = worker_settings(args, settings, served)
    config = worker_engine_config(resolved, served)
    assert (config.max_model_len, config.max_num_seqs, config.gpu_memory_utilization) == (1024, 3, 0.5)
    assert config.enable_prefix_caching is False and config.model == "/models/llama"


def test_worker_takes_celery_flags(settings):
    args = worker_args("-l", "INFO", "-c", "4", "-n", "w1", "-Q", "qwen")
    assert args.loglevel == "info"
    assert worker_args("--loglevel", "Debug").loglevel == "debug"
    served = served_model_for(args, settings)
    assert served.name == "qwen"
    assert worker_settings(args, settings, served).max_num_seqs == 4                   # -c is --max-num-seqs
    # Celery's rules, the model's name where Celery says "celery"
    assert worker_hostname("w1", "qwen") == "qwen@w1" and worker_hostname("a@b", "qwen") == "a@b"
    assert worker_hostname(None, "qwen").startswith("qwen@") and "%" not in worker_hostname("a@%h", "qwen")
    # -Q takes the full queue name too, or the model's name; one queue, a served one
    assert served_model_for(worker_args("-Q", "t.model.qwen"), settings).name == "qwen"
    assert served_model_for(worker_args("-Q", "qwen", "--model", "qwen"), settings).name == "qwen"
    for argv, message in ((("-Q", "llama,qwen"), "consumes one queue"),
                          (("-Q", "celery"), "queue 'celery' is not served"),
                          (("-Q", "llama", "--model", "qwen"), "name different models")):
        with pytest.raises(CLIError, match=message):
            served_model_for(worker_args(*argv), settings)
    with pytest.raises(CLIError, match="set the same thing"):
        worker_settings(worker_args("-c", "4", "--max-num-seqs", "5"), settings, served)
    with pytest.raises(CLIError, match="at least 1"):
        worker_settings(worker_args("-c", "0"), settings, served)
    with pytest.raises(SystemExit):
        worker_args("-l", "LOUD")
    with pytest.raises(SystemExit):
        worker_args("--generation-config", "vllm")     # the API's to apply: REIN_GENERATION_CONFIG


def test_the_flags_choices_are_the_names_the_engine_checks():
    """--quantization, --model-impl, --dtype, --kv-cache-dtype and --quantized-activations list the very tuples EngineConfig
    checks against, each defined once in a module without torch (rein.model.quant.names,
    rein.model.implementation_names, rein.engine.options): every name listed is taken, others refused."""
    from rein.engine.options import DTYPES, KV_CACHE_DTYPES, QUANTIZED_ACTIVATIONS, options_by_name
    from rein.model.implementation_names import MODEL_IMPLS
    from rein.model.quant.names import QUANTIZATIONS

    checked = {"quantization": QUANTIZATIONS, "model_impl": MODEL_IMPLS, "dtype": DTYPES,
               "kv_cache_dtype": KV_CACHE_DTYPES, "quantized_activations": QUANTIZED_ACTIVATIONS}
    for name, names in checked.items():
        assert options_by_name(name).choices is names
        for value in names:
            config = EngineConfig(model="unused", device="cpu", **{name: value})
            assert config.torch_dtype is not None and config.cache_torch_dtype is not None
        with pytest.raises(ValueError, match="nonesuch"):   # --dtype is refused when it is resolved
            assert EngineConfig(model="unused", device="cpu", **{name: "nonesuch"}).torch_dtype


def test_a_tensor_parallel_size_below_one_is_refused_by_the_one_check():
    """EngineConfig and the worker supervisor (which splits devices into engines before any engine
    is configured) share rein.engine.options.check_tensor_parallel_size; the supervisor names the flag."""
    from rein.worker.supervisor import plan_engines

    with pytest.raises(ValueError, match=r"^tensor_parallel_size must be at least 1, got 0$"):
        EngineConfig(model="unused", device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size must be at least 1, got 0$"):
        plan_engines(None, 2, 0, "cpu")
