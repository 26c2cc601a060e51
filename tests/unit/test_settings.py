"""Settings from the environment: defaults, REIN_MODELS parsing, clear errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rein.core.settings import (
    MODELS_FORMAT,
    LoRAModule,
    ServedModel,
    Settings,
    SettingsError,
    get_settings,
    load_settings,
    parse_models,
    setting_or_default,
)

pytestmark = pytest.mark.usefixtures("clean_rein_env")


def test_defaults():
    s = load_settings()
    assert s.database_url == "postgresql+psycopg://postgres@127.0.0.1:5432/rein"
    assert s.redis_url == "redis://127.0.0.1:6379/0"
    assert (s.api_host, s.api_port) == ("127.0.0.1", 8000)
    assert s.models == ()
    assert s.default_rpm is None and s.default_tpm is None
    assert s.visibility_timeout_seconds > s.job_timeout_seconds
    with pytest.raises(SettingsError, match="no model is served: set REIN_MODELS"):
        _ = s.default_model


def test_every_field_is_documented():
    for name, field in Settings.model_fields.items():
        assert field.description, f"Settings.{name} has no docstring"


def test_models_from_the_environment(monkeypatch):
    monkeypatch.setenv("REIN_MODELS", " llama=/models/Llama-3.1-8B@8192 , qwen=Qwen/Qwen3-0.6B,"
                                      "odd=/data/v@2/model,x.y:z=./m@16")
    s = load_settings()
    assert s.models == (
        ServedModel(name="llama", source="/models/Llama-3.1-8B", max_model_len=8192),
        ServedModel(name="qwen", source="Qwen/Qwen3-0.6B"),
        ServedModel(name="odd", source="/data/v@2/model"),   # '@' inside a path is part of it
        ServedModel(name="x.y:z", source="./m", max_model_len=16),
    )
    assert s.default_model.name == "llama"
    assert s.served_model("qwen").source == "Qwen/Qwen3-0.6B" and s.served_model("nope") is None


def test_models_as_a_keyword():
    assert Settings(models="a=/m").models == (ServedModel(name="a", source="/m"),)
    assert Settings(models=[ServedModel(name="a", source="/m")]).default_model.source == "/m"
    assert parse_models("") == () and parse_models("  ") == ()


@pytest.mark.parametrize(("value", "says"), [
    ("llama", "entry 'llama' has no '='"),
    ("=/m", "entry '=/m' has no model name before '='"),
    ("a=", "entry 'a=' has no model path or hub id after '='"),
    ("a=/m@", "max_model_len '' after '@' must be a positive integer"),
    ("a=/m@4k", "max_model_len '4k' after '@' must be a positive integer"),
    ("a=/m@0", "max_model_len '0' after '@' must be a positive integer"),
    ("a b=/m", "model name 'a b' must start with a letter or digit"),
    ("a=/m,a=/n", "model name 'a' appears twice"),
    ("a=/m,,b=/n", "empty entry"),
])
def test_malformed_models(monkeypatch, value, says):
    monkeypatch.setenv("REIN_MODELS", value)
    with pytest.raises(SettingsError) as error:
        load_settings()
    message = str(error.value)
    assert message.startswith("invalid configuration:\n  REIN_MODELS: ")
    assert says in message
    if "twice" not in says:
        assert f"expected {MODELS_FORMAT}" in message


def test_other_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("REIN_API_PORT", "http")
    monkeypatch.setenv("REIN_DEFAULT_RPM", "0")
    monkeypatch.setenv("REIN_DTYPE", "fp8")
    with pytest.raises(SettingsError) as error:
        load_settings()
    lines = str(error.value).splitlines()[1:]
    assert lines[0].strip().startswith("REIN_API_PORT: Input should be a valid integer") and "'http'" in lines[0]
    assert any(line.strip().startswith("REIN_DEFAULT_RPM: Input should be greater than or equal to 1")
               for line in lines)
    assert any(line.strip().startswith("REIN_DTYPE:") and "float32" in line and "'fp8'" in line
               for line in lines)


def test_a_retired_variable_is_refused_with_its_replacement(monkeypatch):
    monkeypatch.setenv("REIN_OUTPUT_FILE_RETENTION_DAYS", "7")
    with pytest.raises(SettingsError, match="replaced by REIN_BATCH_FILE_EXPIRY_SECONDS"):
        load_settings()


def test_values_and_empty_variables(monkeypatch):
    monkeypatch.setenv("REIN_DEFAULT_RPM", "")          # empty counts as unset
    monkeypatch.setenv("REIN_DEFAULT_TPM", "20000")
    monkeypatch.setenv("REIN_API_PORT", "9000")
    monkeypatch.setenv("REIN_KV_CACHE_MEMORY", "4GiB")
    monkeypatch.setenv("REIN_DATABASE_URL", "postgresql+psycopg://u:p@db:5432/x")
    s = load_settings()
    assert (s.default_rpm, s.default_tpm, s.api_port) == (None, 20000, 9000)
    assert s.kv_cache_memory == "4GiB" and s.database_url.endswith("@db:5432/x")
    assert load_settings(api_port=1234).api_port == 1234      # a CLI flag wins


def test_get_settings_reads_once(monkeypatch):
    monkeypatch.setenv("REIN_API_PORT", "9001")
    assert get_settings().api_port == 9001
    monkeypatch.setenv("REIN_API_PORT", "9002")
    assert get_settings() is get_settings() and get_settings().api_port == 9001
    get_settings.cache_clear()
    assert get_settings().api_port == 9002


def test_only_settings_reads_the_environment():
    root = Path(__file__).resolve().parents[2] / "rein"
    pattern = re.compile(r"\bos\.environ\b|\bgetenv\(|\bfrom os import .*\benviron\b")
    readers = [str(path.relative_to(root)) for path in root.rglob("*.py")
               if path.name != "settings.py" and pattern.search(path.read_text())]
    assert readers == [], f"only rein/core/settings.py may read the environment: {readers}"


def test_setting_or_default_reads_one_setting_even_when_others_are_broken(monkeypatch):
    monkeypatch.setenv("REIN_CPU_KERNELS", "0")
    get_settings.cache_clear()
    try:
        assert setting_or_default("cpu_kernels") is False
        monkeypatch.setenv("REIN_API_PORT", "http")   # an unrelated setting breaks the whole set
        get_settings.cache_clear()
        assert setting_or_default("cpu_kernels") is True   # the default, not a crash
    finally:
        get_settings.cache_clear()


def test_engine_cpus_are_a_cpu_list(monkeypatch):
    assert load_settings(worker_engine_cpus="2-3").worker_engine_cpus == {2, 3}
    monkeypatch.setenv("REIN_WORKER_ENGINE_CPUS", "1,x")
    with pytest.raises(SettingsError, match=r"REIN_WORKER_ENGINE_CPUS: .*'x' in '1,x' is not a CPU number"):
        load_settings()
    with pytest.raises(SettingsError, match="REIN_WORKER_ENGINE_PROCESS is false"):
        load_settings(worker_engine_cpus="1", worker_engine_process=False)


def test_lora_modules_in_vllm_forms(monkeypatch, tmp_path):
    monkeypatch.setenv("REIN_MODELS", "base=/m/base,other=/m/other")
    monkeypatch.setenv("REIN_LORA_MODULES", "sql=/a/sql, chat=/a/chat")
    s = load_settings()
    assert s.lora_modules == (LoRAModule(name="sql", path="/a/sql"), LoRAModule(name="chat", path="/a/chat"))
    assert s.enable_lora            # naming adapters is asking for them
    monkeypatch.setenv("REIN_LORA_MODULES", '[{"name": "sql", "path": "/a/sql", "base_model_name": "other"}]')
    assert load_settings().lora_modules == (LoRAModule(name="sql", path="/a/sql", base_model_name="other"),)
    monkeypatch.setenv("REIN_LORA_MODULES", '{"name": "one", "path": "/a/one"}')
    assert load_settings().lora_modules == (LoRAModule(name="one", path="/a/one"),)
    monkeypatch.delenv("REIN_LORA_MODULES")
    assert not load_settings().enable_lora


def test_a_models_entry_naming_an_adapter_directory_is_an_adapter(monkeypatch, tmp_path):
    adapter = tmp_path / "sql-lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    monkeypatch.setenv("REIN_MODELS", f"base=/m/base,sql={adapter}")
    monkeypatch.setenv("REIN_LORA_MODULES", "chat=/a/chat")
    s = load_settings()
    assert s.models == (ServedModel(name="base", source="/m/base"),)
    assert s.lora_modules == (LoRAModule(name="chat", path="/a/chat"), LoRAModule(name="sql", path=str(adapter)))
    assert s.enable_lora and s.default_model.name == "base"
    monkeypatch.setenv("REIN_MODELS", f"base=/m/base,sql={adapter}@512")
    with pytest.raises(SettingsError, match="is a LoRA adapter .* drop the @512"):
        load_settings()


@pytest.mark.parametrize(("value", "says"), [
    ("sql", "is not name=path"),
    ("=/a", "is not name=path"),
    ("a b=/x", "is not name=path"),            # a space separates entries, as in vLLM's flag
    ("s q=", "is not name=path"),
    ("sql=/a,sql=/b", "names must be unique"),
    ("base=/a", "names both a model and a LoRA adapter"),
    ('[{"name": "x"}]', "each needs a name and a path"),
    ("[{", "not valid JSON"),
    ('{"name": "x", "path": "/p", "base_model_name": "nope"}', "which REIN_MODELS does not serve"),
    ("-x=/p", "must start with a letter or digit"),
])
def test_malformed_lora_modules(monkeypatch, value, says):
    monkeypatch.setenv("REIN_MODELS", "base=/m/base")
    monkeypatch.setenv("REIN_LORA_MODULES", value)
    with pytest.raises(SettingsError, match=re.escape(says)):
        load_settings()
