"""The service's view of LoRA adapters (rein.jobs.adapters): stable engine ids, which served
model an adapter runs over, what is checked before any worker reads its weights, and the
registry's adapter entries (the base model's tokenizer and length, the base's queue)."""

from __future__ import annotations

import json

import pytest

from rein.core.settings import LoRAModule, ServedModel, Settings
from rein.jobs.adapters import AdapterCatalog, AdapterRef, base_for, check_adapter, lora_int_id
from rein.jobs.registry import ModelEntry, ModelRegistry
from rein.model.lora.config import AdapterError

pytestmark = pytest.mark.usefixtures("clean_rein_env")

MODELS = (ServedModel(name="llama", source="/models/Llama-3.1-8B"),
          ServedModel(name="qwen", source="Qwen/Qwen2.5-0.5B"))


def adapter_dir(tmp_path, name: str = "sql", **config) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16} | config))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


def test_engine_ids_are_stable_and_new_for_a_new_path():
    assert lora_int_id("sql", "/a/sql") == lora_int_id("sql", "/a/sql") > 0
    assert lora_int_id("sql", "/a/sql-v2") != lora_int_id("sql", "/a/sql")
    assert lora_int_id("sql", "/a/x") != lora_int_id("x", "/a/sql")
    assert all(0 < lora_int_id(f"n{i}", "/p") < 2**31 for i in range(200))


def test_the_base_is_the_named_one_else_the_recorded_one_else_the_first(tmp_path):
    trained = adapter_dir(tmp_path, "q", base_model_name_or_path="Qwen/Qwen2.5-0.5B")
    assert base_for(LoRAModule(name="a", path=trained), MODELS).name == "qwen"
    local_copy = adapter_dir(tmp_path, "l", base_model_name_or_path="/home/me/Llama-3.1-8B")
    assert base_for(LoRAModule(name="a", path=local_copy), MODELS).name == "llama"
    unknown = adapter_dir(tmp_path, "u", base_model_name_or_path="org/other")
    assert base_for(LoRAModule(name="a", path=unknown), MODELS).name == "llama"
    assert base_for(LoRAModule(name="a", path=trained, base_model_name="llama"), MODELS).name == "llama"
    with pytest.raises(AdapterError, match="not served"):
        base_for(LoRAModule(name="a", path=trained, base_model_name="gone"), MODELS)


def test_checks_before_the_weights(tmp_path):
    path = adapter_dir(tmp_path, rank_pattern={"o_proj": 32}, base_model_name_or_path="Qwen/Qwen2.5-0.5B")
    ref = check_adapter("sql", path, MODELS[1], max_lora_rank=32)
    assert ref == AdapterRef("sql", "qwen", path, lora_int_id("sql", path), "Qwen/Qwen2.5-0.5B")
    with pytest.raises(AdapterError, match="rank 32, above the server's maximum LoRA rank 16"):
        check_adapter("sql", path, MODELS[1], max_lora_rank=16)
    with pytest.raises(AdapterError, match="was trained on 'Qwen/Qwen2.5-0.5B'.*base_model_name: 'llama'"):
        check_adapter("sql", path, MODELS[0], max_lora_rank=32)
    assert check_adapter("sql", path, MODELS[0], max_lora_rank=32, check_base=False).base == "llama"
    with pytest.raises(AdapterError, match="relative"):
        check_adapter("sql", "adapters/sql", MODELS[0], max_lora_rank=32)
    with pytest.raises(AdapterError, match="uses DoRA"):
        check_adapter("d", adapter_dir(tmp_path, "dora", use_dora=True), MODELS[0], max_lora_rank=32)
    gguf = tmp_path / "sql.gguf"
    with pytest.raises(AdapterError, match="does not exist"):
        check_adapter("g", str(gguf), MODELS[0], max_lora_rank=32)
    gguf.write_bytes(b"GGUF")
    assert check_adapter("g", str(gguf), MODELS[0], max_lora_rank=32).path == str(gguf)


def test_registry_entries_of_adapters(tmp_path):
    path = adapter_dir(tmp_path)
    settings = Settings(models=MODELS, lora_modules=f"sql={path}")
    base = ModelEntry("llama", "/models/Llama-3.1-8B", tokenizer=object(), max_model_len=4096)
    registry = ModelRegistry([base], AdapterCatalog.from_settings(settings))
    entry = registry.get("sql")
    assert entry.lora.name == "sql" and entry.queue_model == "llama" and entry.name == "sql"
    assert entry.tokenizer is base.tokenizer and entry.max_model_len == 4096
    assert registry.get("llama").lora is None and registry.get("llama").queue_model == "llama"
    assert registry.get("nope") is None
    assert [e.name for e in registry] == ["llama"]      # iterating lists the models alone
