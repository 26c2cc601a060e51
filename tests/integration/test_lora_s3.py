"""LoRA adapters on object storage (rein.model.lora.fetch), against moto's S3 server over real
HTTP: an s3:// adapter prefix is fetched once into the cache and answers as the same adapter read
from a directory; the API's checks take s3:// paths; a missing prefix or bucket is the adapter's
error, naming the URL."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_support import make_peft_adapter

from rein.core.settings import ServedModel, get_settings
from rein.jobs.adapters import check_adapter, lora_int_id
from rein.model.lora.config import AdapterError
from rein.model.lora.fetch import local_adapter
from rein.store.s3 import s3_client

pytestmark = pytest.mark.usefixtures("clean_rein_env")


@pytest.fixture
def uploaded(s3_bucket, tiny_models, tmp_path, monkeypatch):
    """(the adapter's directory, its s3:// URL) with REIN_CACHE_DIR in tmp_path."""
    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path / "cache"))
    get_settings.cache_clear()
    adapter = make_peft_adapter(tiny_models("llama"), tmp_path / "sql", r=8, target_modules=["q_proj", "down_proj"],
                                seed=5, weight_std=0.2)
    client = s3_client()
    for file in adapter.iterdir():
        client.upload_file(str(file), s3_bucket, f"adapters/sql/{file.name}")
    client.put_object(Bucket=s3_bucket, Key="adapters/sql/old/adapter_config.json", Body=b"{}")   # a sub-folder
    return adapter, f"s3://{s3_bucket}/adapters/sql"


def test_fetched_once_into_the_cache(uploaded, tmp_path):
    adapter, url = uploaded
    local = Path(local_adapter(url))
    assert local.is_relative_to(tmp_path / "cache" / "lora")
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in adapter.iterdir())
    for file in adapter.iterdir():
        assert (local / file.name).read_bytes() == file.read_bytes()
    (local / "marker").write_text("kept")          # a second call reads the cache, fetching nothing
    assert local_adapter(url) == str(local) and (local / "marker").is_file()
    assert local_adapter(str(adapter)) == str(adapter)   # a local path is used as it is


def test_the_engine_reads_an_s3_adapter_as_its_directory(uploaded, tiny_models):
    from rein import LLM, LoRARequest, SamplingParams

    adapter, url = uploaded
    llm = LLM(str(tiny_models("llama")), enable_lora=True, max_loras=2, kv_cache_memory="16MiB", device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 15, 27, 99, 4]}] * 3
    outputs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=[
        LoRARequest("from-s3", 1, url), LoRARequest("from-dir", 2, str(adapter)), None])
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens[0] == tokens[1] != tokens[2]
    missing = llm.generate(prompts[:1], greedy, use_tqdm=False, lora_request=LoRARequest("gone", 3, url + "-v2"))
    assert "nothing is stored under that prefix" in missing[0].error


def test_the_api_checks_take_s3_urls(uploaded, s3_bucket):
    adapter, url = uploaded
    base = ServedModel(name="tiny", source="/models/tiny")
    ref = check_adapter("sql", url, base, max_lora_rank=16, check_base=False)
    assert (ref.path, ref.lora_int_id) == (url, lora_int_id("sql", url))
    with pytest.raises(AdapterError, match="rank 8, above the server's maximum LoRA rank 4"):
        check_adapter("sql", url, base, max_lora_rank=4, check_base=False)
    with pytest.raises(AdapterError, match="could not be fetched .*NoSuchBucket"):
        local_adapter("s3://rein-no-such-bucket/adapters/sql")
    with pytest.raises(AdapterError, match="names a bucket alone"):
        local_adapter(f"s3://{s3_bucket}")
