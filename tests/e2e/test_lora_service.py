"""LoRA adapters through the service: `rein api` and `rein worker` as processes, adapters made by
PEFT on the tiny model. An adapter named in REIN_LORA_MODULES and one registered over the API
(POST /v1/load_lora_adapter) answer as transformers + PEFT do, mixed with the base model's jobs;
the registered one runs on the worker that was running when it was registered and on one
started afterwards; unloading it refuses new jobs for it; usage and the worker's metrics are per
adapter. A bad adapter (damaged weights, another base's shapes) fails its jobs, through the API
and in a batch line, with the reason, and the worker goes on serving."""

from __future__ import annotations

import io
import json
import secrets
import shutil
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from e2e_support import MODEL, Service, run_service
from lora_support import make_peft_adapter, peft_greedy
from support import free_port, wait_for

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
PROMPTS = [[5, 17, 33, 2, 90, 41], [7, 7, 120, 64, 3]]


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[SimpleNamespace]:
    model = tiny_models("llama")
    root = tmp_path_factory.mktemp("adapters")
    static = make_peft_adapter(model, root / "static", r=8, target_modules=["q_proj", "v_proj", "o_proj"], seed=11,
                               weight_std=0.3)
    runtime = make_peft_adapter(model, root / "runtime", r=16, target_modules=["gate_proj", "up_proj", "down_proj"],
                                use_rslora=True, seed=12, weight_std=0.3)
    damaged = root / "damaged"
    shutil.copytree(static, damaged)
    weights = damaged / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])          # cut short, as an interrupted copy
    # Trained on a wider model: the same module names, other shapes.
    other = make_peft_adapter(tiny_models("llama", preset="small"), root / "other", r=8, target_modules=["q_proj"],
                              seed=13)
    env = {"REIN_LORA_MODULES": f"static={static}", "REIN_MAX_LORA_RANK": "16", "REIN_MAX_LORAS": "2",
           "REIN_AUTH_CACHE_SECONDS": "0"}
    with run_service(tmp_path_factory.mktemp("e2e-lora"), model, scopes="inference,usage,batch,admin",
                     extra_env=env) as service:
        yield SimpleNamespace(service=service, model=model, static=static, runtime=runtime, damaged=damaged,
                              other=other)


def answer(service: Service, client: httpx.Client, model: str, prompt: list[int]) -> dict:
    response = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": {
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 1}})
    assert response.status_code == 202, response.text
    return {"id": response.json()["id"]}


def finished(service: Service, client: httpx.Client, job: dict) -> dict:
    return service.wait_job(client, job["id"])


def tokens_of(job: dict) -> list[str]:
    """The answer's tokens, as the completion's logprobs give them."""
    assert job["status"] == "succeeded", job
    return job["response"]["body"]["choices"][0]["logprobs"]["tokens"]


def reference(lora: SimpleNamespace, adapter, prompt: list[int]) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(lora.model))
    return [tokenizer.decode([token]) for token in peft_greedy(lora.model, adapter, prompt, MAX_TOKENS)]


def test_adapters_answer_as_peft_mixed_with_the_base(lora):
    service = lora.service
    with service.client("a") as client:
        jobs = [(model, prompt, answer(service, client, model, prompt))
                for prompt in PROMPTS for model in (MODEL, "static")]
        listed = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
        assert listed["static"]["parent"] == MODEL
        got = {(model, tuple(prompt)): tokens_of(finished(service, client, job)) for model, prompt, job in jobs}
    for prompt in PROMPTS:
        assert got[(MODEL, tuple(prompt))] == reference(lora, None, prompt)
        assert got[("static", tuple(prompt))] == reference(lora, lora.static, prompt)
    assert any(got[(MODEL, tuple(p))] != got[("static", tuple(p))] for p in PROMPTS)   # the adapter matters


def test_registered_adapter_runs_on_running_and_later_workers(lora):
    service = lora.service
    name = f"rt-{secrets.token_hex(3)}"
    with service.client("a") as client:
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(lora.runtime)})
        assert loaded.status_code == 200, loaded.text
        # The running worker heard of it and read it before its first job.
        wait_for(lambda: f"LoRA adapter {name} loaded for the fleet" in (service.logs / "worker.log").read_text(
            errors="replace"), 10, "the worker's announcement line")
        want = reference(lora, lora.runtime, PROMPTS[0])
        assert tokens_of(finished(service, client, answer(service, client, name, PROMPTS[0]))) == want

        # A worker started afterwards, the first one stopped: the adapter's jobs run there.
        metrics_port = free_port()
        second = service.spawn("worker-later", "worker", "--model", MODEL, "--hostname",
                               f"later-{secrets.token_hex(3)}@localhost", "--loglevel", "info",
                               env_update={"REIN_WORKER_METRICS_PORT": str(metrics_port)})
        wait_for(lambda: _metrics(metrics_port) is not None, 150, "the later worker's metrics")
        service.worker.terminate()
        service.worker.wait(30)
        try:
            job = finished(service, client, answer(service, client, name, PROMPTS[1]))
            assert tokens_of(job) == reference(lora, lora.runtime, PROMPTS[1])
            assert job["model"] == name
            scraped = _metrics(metrics_port)
            assert f'rein:lora_requests_total{{lora_name="{name}",model_name="{MODEL}",status="succeeded"}} 1.0' \
                in scraped, scraped
            assert f'rein:lora_generation_tokens_total{{lora_name="{name}",model_name="{MODEL}"}} {MAX_TOKENS}.0' \
                in scraped
            usage = {row["model"]: row for row in client.get("/v1/usage").json()["data"]}
            assert usage[name]["completion_tokens"] == 2 * MAX_TOKENS

            unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert unloaded.status_code == 200, unloaded.text
            refused = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": {
                "model": name, "prompt": PROMPTS[0]}})
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        finally:
            # The module's later tests run on this worker.
            service.worker = second


def _metrics(port: int) -> str | None:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None


def test_bad_adapters_fail_their_jobs_and_the_worker_serves_on(lora):
    service = lora.service
    with service.client("a") as client:
        for name, path, says in (("damaged", lora.damaged, "could not be read"),
                                 ("other", lora.other, "trained on another base model")):
            # The API's checks pass (config, rank, files present): the weights are the worker's to find wrong.
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path),
                                                                "base_model_name": MODEL})
            assert loaded.status_code == 200, loaded.text
            job = finished(service, client, answer(service, client, name, PROMPTS[0]))
            assert job["status"] == "failed", job
            assert job["error"]["code"] == "invalid_lora_adapter" and says in job["error"]["message"], job["error"]
        # The worker goes on: the base model and a good adapter still answer.
        assert tokens_of(finished(service, client, answer(service, client, "static", PROMPTS[1]))) == \
            reference(lora, lora.static, PROMPTS[1])

        # In a batch: the bad line's error names the reason, the others answer.
        lines = [{"custom_id": cid, "method": "POST", "url": "/v1/completions",
                  "body": {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                           "ignore_eos": True}}
                 for cid, model in (("base", MODEL), ("good", "static"), ("bad", "damaged"))]
        uploaded = client.post("/v1/files", data={"purpose": "batch"}, files={"file": (
            "in.jsonl", io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode()),
            "application/jsonl")})
        assert uploaded.status_code == 200, uploaded.text
        batch = client.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                 "endpoint": "/v1/completions", "completion_window": "24h"})
        assert batch.status_code == 200, batch.text
        done = wait_for(lambda: (b := client.get(f"/v1/batches/{batch.json()['id']}").json())["status"]
                        in ("completed", "failed", "expired") and b, 120, "the batch")
        assert done["status"] == "completed" and done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
        outputs = [json.loads(raw) for raw in client.get(f"/v1/files/{done['output_file_id']}/content").text.splitlines()]
        errors = [json.loads(raw) for raw in client.get(f"/v1/files/{done['error_file_id']}/content").text.splitlines()]
        assert sorted(o["custom_id"] for o in outputs) == ["base", "good"]
        [failed] = errors
        assert failed["custom_id"] == "bad" and "could not be read" in json.dumps(failed), failed
