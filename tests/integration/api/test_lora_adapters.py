"""LoRA adapters at the API, on real Postgres and Redis: named in REIN_LORA_MODULES or registered
with POST /v1/load_lora_adapter (admin scope), listed by /v1/models with their parent, and a
request naming one stored as the adapter's job but queued on its base model's queue with the
adapter in its message; batch lines too. Bad adapters are refused with the reason, and an
unloaded adapter's name is refused again. (A worker running such jobs: tests/e2e/test_lora_service.py.)"""

from __future__ import annotations

import base64
import json
import secrets

import pytest
from api_support import auth, jsonl, line
from lora_support import make_peft_adapter
from sqlalchemy import select
from support import wait_for

from rein.jobs.adapters import lora_int_id
from rein.jobs.queues import queue_keys
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job, LoRAAdapter

pytestmark = pytest.mark.usefixtures("end_leftover_batches")


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    """Three PEFT adapters of the tiny llama: rank 8 (attention), rank 16 (MLP), rank 32."""
    root = tmp_path_factory.mktemp("adapters")
    model = tiny_models("llama")
    return {
        "r8": make_peft_adapter(model, root / "r8", r=8, target_modules=["q_proj", "v_proj"], seed=1),
        "r16": make_peft_adapter(model, root / "r16", r=16, target_modules=["gate_proj", "down_proj"], seed=2),
        "r32": make_peft_adapter(model, root / "r32", r=32, target_modules=["o_proj"], seed=3),
    }


def messages(redis_client, settings, model: str) -> list[dict]:
    """The task arguments (JobMessage dicts) waiting on `model`'s queues."""
    found = []
    for queue in queue_keys(settings, model):
        for raw in redis_client.lrange(queue, 0, -1):
            found.append(json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0])
    return found


def submit(client, key: str, model: str) -> dict:
    response = client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/completions", "body": {"model": model, "prompt": "hello", "max_tokens": 3}})
    assert response.status_code == 202, response.text
    return response.json()


def test_adapter_of_lora_modules_is_listed_and_queued_on_its_base(make_client, make_key, tenant, model_dir,
                                                                   adapters, redis_client, db_sessionmaker):
    base, name = f"m{secrets.token_hex(3)}", f"sql{secrets.token_hex(3)}"
    client = make_client(models=f"{base}={model_dir}@512", lora_modules=f"{name}={adapters['r8']}")
    key = make_key(tenant)
    listed = {m["id"]: m for m in client.get("/v1/models", headers=auth(key)).json()["data"]}
    assert listed[base]["parent"] is None and listed[base]["root"] == model_dir
    assert listed[name]["parent"] == base and listed[name]["root"] == str(adapters["r8"])
    assert listed[name]["max_model_len"] == 512
    assert client.get(f"/v1/models/{name}", headers=auth(key)).json()["parent"] == base

    created = submit(client, key, name)
    with db_sessionmaker() as session:
        job = session.get(Job, created["id"])
    assert job.model == name             # usage and responses name the adapter
    lora = {"name": name, "base": base, "path": str(adapters["r8"]),
            "lora_int_id": lora_int_id(name, str(adapters["r8"])),
            "base_model_name": model_dir}      # what it was trained on, which the worker checks again
    assert job.params["lora"] == lora
    [message] = [m for m in messages(redis_client, client.app.state.settings, base) if m["job_id"] == job.id]
    assert message["model"] == base and message["lora"] == lora
    assert messages(redis_client, client.app.state.settings, name) == []

    # The base model's own jobs carry no adapter.
    plain = submit(client, key, base)
    [message] = [m for m in messages(redis_client, client.app.state.settings, base) if m["job_id"] == plain["id"]]
    assert message["lora"] is None

    refused = client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/embeddings", "body": {"model": name, "input": "hello"}})
    assert refused.status_code == 400 and "adapters serve completions" in refused.json()["error"]["message"]


def test_a_bad_adapter_in_lora_modules_stops_the_api(make_client, model_dir, adapters, tmp_path):
    with pytest.raises(ValueError, match="above the server's maximum LoRA rank 16.*--max-lora-rank 32"):
        make_client(models=f"tiny={model_dir}@512", lora_modules=f"big={adapters['r32']}")
    with pytest.raises(ValueError, match="does not exist"):
        make_client(models=f"tiny={model_dir}@512", lora_modules=f"gone={tmp_path / 'nothing'}")


def load(client, key: str, **body) -> object:
    return client.post("/v1/load_lora_adapter", headers=auth(key), json=body)


def test_load_and_unload_at_run_time(make_client, make_key, tenant, model_dir, adapters, redis_client,
                                     db_sessionmaker):
    base, name = f"m{secrets.token_hex(3)}", f"rt{secrets.token_hex(3)}"
    client = make_client(models=f"{base}={model_dir}@512", enable_lora=True, auth_cache_seconds=0)
    admin, user = make_key(tenant, "inference,admin"), make_key(tenant)
    settings = client.app.state.settings
    pubsub = redis_client.pubsub()
    pubsub.subscribe(RedisKeys.from_settings(settings).lora_events())

    assert load(client, user, lora_name=name, lora_path=str(adapters["r8"])).status_code == 403
    assert client.post("/v1/jobs", headers=auth(user), json={
        "endpoint": "/v1/completions", "body": {"model": name, "prompt": "hi"}}).status_code == 404

    loaded = load(client, admin, lora_name=name, lora_path=str(adapters["r8"]))
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["id"] == name and loaded.json()["parent"] == base
    with db_sessionmaker() as session:
        row = session.get(LoRAAdapter, name)
    assert (row.base_model, row.path, row.lora_int_id) == (base, str(adapters["r8"]),
                                                           lora_int_id(name, str(adapters["r8"])))
    announced = wait_for(lambda: pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2), 5,
                         "the load announcement")
    assert json.loads(announced["data"]) | {} == {"event": "load", **{
        "name": name, "base": base, "path": str(adapters["r8"]), "lora_int_id": row.lora_int_id,
        "base_model_name": model_dir}}

    listed = {m["id"]: m for m in client.get("/v1/models", headers=auth(user)).json()["data"]}
    assert listed[name]["parent"] == base
    created = submit(client, user, name)
    [message] = [m for m in messages(redis_client, settings, base) if m["job_id"] == created["id"]]
    assert message["lora"]["name"] == name and message["lora"]["path"] == str(adapters["r8"])

    # Registered twice: refused, unless replacing it (a new path: a new engine id).
    again = load(client, admin, lora_name=name, lora_path=str(adapters["r16"]))
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_adapter_exists"
    replaced = load(client, admin, lora_name=name, lora_path=str(adapters["r16"]), load_inplace=True)
    assert replaced.status_code == 200, replaced.text
    with db_sessionmaker() as session:
        assert session.get(LoRAAdapter, name).lora_int_id == lora_int_id(name, str(adapters["r16"]))

    unloaded = client.post("/v1/unload_lora_adapter", headers=auth(admin), json={"lora_name": name})
    assert unloaded.status_code == 200, unloaded.text
    refused = client.post("/v1/jobs", headers=auth(user), json={
        "endpoint": "/v1/completions", "body": {"model": name, "prompt": "hi"}})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert name not in {m["id"] for m in client.get("/v1/models", headers=auth(user)).json()["data"]}
    missing = client.post("/v1/unload_lora_adapter", headers=auth(admin), json={"lora_name": name})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "lora_adapter_not_found"
    # The job accepted before the unload stays queued: it still runs.
    with db_sessionmaker() as session:
        assert session.get(Job, created["id"]).status == "queued"
    pubsub.close()


@pytest.mark.parametrize("case", ["rank", "missing", "relative", "not_lora", "other_base", "base_name"])
def test_bad_adapters_are_refused_with_the_reason(make_client, make_key, tenant, model_dir, adapters, tmp_path,
                                                  case):
    client = make_client(models=f"tiny={model_dir}@512", enable_lora=True)
    admin = make_key(tenant, "admin")
    name = f"bad{secrets.token_hex(3)}"
    path, extra, says = str(adapters["r8"]), {}, ""
    if case == "rank":
        path, says = str(adapters["r32"]), "rank 32, above the server's maximum LoRA rank 16"
    elif case == "missing":
        path, says = str(tmp_path / "nowhere"), "does not exist"
    elif case == "relative":
        path, says = "adapters/r8", "is relative"
    elif case == "not_lora":
        config = json.loads((adapters["r8"] / "adapter_config.json").read_text())
        (tmp_path / "ia3").mkdir()
        (tmp_path / "ia3" / "adapter_config.json").write_text(json.dumps(config | {"peft_type": "IA3"}))
        path, says = str(tmp_path / "ia3"), "PEFT IA3 adapter"
    elif case in ("other_base", "base_name"):
        config = json.loads((adapters["r8"] / "adapter_config.json").read_text())
        other = tmp_path / "other"
        other.mkdir()
        (other / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "org/another"}))
        (other / "adapter_model.safetensors").write_bytes((adapters["r8"] / "adapter_model.safetensors").read_bytes())
        path, says = str(other), "was trained on 'org/another'"
        if case == "base_name":      # saying which base it runs over skips the check
            extra = {"base_model_name": "tiny"}
    response = load(client, admin, lora_name=name, lora_path=path, **extra)
    if case == "base_name":
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_lora_adapter" and says in error["message"], error


def test_load_needs_lora_enabled_and_a_free_name(make_client, make_key, tenant, model_dir, adapters):
    client = make_client(models=f"tiny={model_dir}@512")
    admin = make_key(tenant, "admin")
    off = load(client, admin, lora_name="x", lora_path=str(adapters["r8"]))
    assert off.status_code == 400 and "REIN_ENABLE_LORA" in off.json()["error"]["message"]
    client = make_client(models=f"tiny={model_dir}@512", lora_modules=f"fixed={adapters['r8']}")
    taken = load(client, admin, lora_name="tiny", lora_path=str(adapters["r8"]))
    assert taken.status_code == 400 and "served model's name" in taken.json()["error"]["message"]
    static = load(client, admin, lora_name="fixed", lora_path=str(adapters["r16"]))
    assert static.status_code == 400 and "REIN_LORA_MODULES" in static.json()["error"]["message"]
    bad_base = load(client, admin, lora_name="y", lora_path=str(adapters["r8"]), base_model_name="nope")
    assert bad_base.status_code == 400 and "is not served" in bad_base.json()["error"]["message"]


def test_batch_lines_name_adapters_of_one_base(make_client, make_key, tenant, model_dir, adapters, tmp_path,
                                              db_sessionmaker, redis_client):
    from test_batches import create, wait_status

    base = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{base}={model_dir}@512,other={model_dir}@512",
                         lora_modules=f"a8={adapters['r8']},a16={adapters['r16']}",
                         files_dir=str(tmp_path / "files"), batch_poll_seconds=0.05)
    key = make_key(tenant, "batch")
    content = jsonl(line("1", model="a8"), line("2", model=base), line("3", model="a16"))
    batch = create(client, key, content)
    batch = wait_status(client, key, batch["id"], "in_progress")
    assert batch["model"] == base
    with db_sessionmaker() as session:
        jobs = list(session.scalars(select(Job).where(Job.batch_id == batch["id"]).order_by(Job.batch_line)))
    assert [job.model for job in jobs] == ["a8", base, "a16"]
    assert [(job.params.get("lora") or {}).get("name") for job in jobs] == ["a8", None, "a16"]
    sent = wait_for(lambda: len(m := [m for m in messages(redis_client, client.app.state.settings, base)
                                      if m["job_id"] in {j.id for j in jobs}]) == 3 and m, 10, "the lines' messages")
    assert {m["job_id"]: (m["lora"] or {}).get("name") for m in sent} == {
        jobs[0].id: "a8", jobs[1].id: None, jobs[2].id: "a16"}

    mixed = create(client, key, jsonl(line("1", model="a8"), line("2", model="other")))
    failed = wait_status(client, key, mixed["id"], "failed")
    [error] = failed["errors"]["data"]
    assert error["code"] == "mismatched_model" and error["line"] == 2
    unknown = create(client, key, jsonl(line("1", model="nope")))
    [error] = wait_status(client, key, unknown["id"], "failed")["errors"]["data"]
    assert error["code"] == "model_not_found"


def test_an_adapters_jobs_count_in_the_tenants_share_of_the_base_queue(make_client, make_key, tenant, model_dir,
                                                                       adapters):
    base = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{base}={model_dir}@512", lora_modules=f"a8={adapters['r8']},a16={adapters['r16']}",
                         max_queue_depth=4)
    greedy, other = make_key(tenant), make_key(f"{tenant}-other")
    submit(client, greedy, "a8")
    submit(client, greedy, "a16")         # its share of the base's queue: half of 4, over two adapters
    for model in (base, "a8"):
        refused = client.post("/v1/jobs", headers=auth(greedy), json={
            "endpoint": "/v1/completions", "body": {"model": model, "prompt": "hello", "max_tokens": 3}})
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "tenant_queue_full", refused.text
    submit(client, other, base)           # the other tenant still gets in
