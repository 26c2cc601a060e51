"""One job's log lines, API to worker, in one process: rein's JSON handler on a buffer, the
app through TestClient, and the job task's logic (process_job) on a worker context with the
tiny model taking the real queue messages. Every line about the job carries its ids; no
line carries the key's secret or the prompt."""

from __future__ import annotations

import base64
import io
import json
import logging
import secrets
import threading
from collections.abc import Iterator

import pytest
from api_support import auth
from support import wait_for

from rein.core.logging import configure_logging, remove_handler
from rein.jobs.queues import queue_keys
from rein.store.messages import JobMessage
from rein.worker.app import make_worker_celery

WORKER = "logs@test"


@pytest.fixture
def log_buffer() -> Iterator[io.StringIO]:
    buffer = io.StringIO()
    level = logging.getLogger().level
    handler = configure_logging(logging.INFO, "json", buffer)
    try:
        yield buffer
    finally:
        remove_handler(handler)
        logging.getLogger().setLevel(level)


def run_queue(context, settings, model: str, stop: threading.Event) -> None:
    """What Celery does for the worker here: take each message off the model's queue, run the task."""
    from rein.worker.tasks import process_job

    lists = queue_keys(settings, model)
    while not stop.is_set():
        popped = context.redis.brpop(lists, timeout=0.2)
        if popped is None:
            continue
        envelope = json.loads(popped[1])
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        process_job(context, JobMessage.from_dict(args[0]))


def test_a_jobs_lines_carry_its_ids_and_no_secret_or_prompt(make_client, make_key, tenant, model_dir,
                                                            log_buffer):
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.context import WorkerSpec, build_context

    model = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{model}={model_dir}@512")
    settings = client.app.state.settings
    config = EngineConfig(model=model_dir, kv_cache_memory="8MiB", max_model_len=512, max_num_seqs=2)
    context = build_context(make_worker_celery(settings), WorkerSpec(settings=settings, model_name=model,
                                                              engine_factory=lambda: LLMEngine(config)), WORKER)
    stop = threading.Event()
    worker = threading.Thread(target=run_queue, args=(context, settings, model, stop), daemon=True)
    worker.start()
    key = make_key(tenant)
    key_id, secret = key.split("_")[1], key.split("_")[2]
    prompts = ["zebrafinch marmalade seventeen", "quokka harpsichord ninety"]
    try:
        chat = client.post("/v1/chat/completions", headers=auth(key), json={
            "model": model, "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 4})
        assert chat.status_code == 200, chat.text
        created = client.post("/v1/jobs", headers=auth(key), json={
            "endpoint": "/v1/completions", "body": {"model": model, "prompt": prompts[1], "max_tokens": 4}})
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()["status"] == "succeeded",
                 60, f"job {job_id} to succeed")
    finally:
        stop.set()
        worker.join(10)
        context.stop()

    text = log_buffer.getvalue()
    lines = [json.loads(line) for line in text.splitlines()]
    listed = [job["id"] for job in client.get("/v1/jobs", headers=auth(key)).json()["data"]]
    assert len(listed) == 2 and job_id in listed      # the chat completion's job and the async job
    for job in listed:
        about = [line for line in lines if line.get("job_id") == job]
        accepted = [line for line in about if line["msg"].startswith(f"job {job} accepted")]
        assert len(accepted) == 1, about
        assert (accepted[0]["key_id"], accepted[0]["model"]) == (key_id, model)
        in_worker = [line for line in about if line.get("worker") == WORKER]
        assert [line["msg"].split(":")[0] for line in in_worker] == [f"job {job} started",
                                                                     f"job {job} attempt 1 ended"]
        assert all((line["key_id"], line["model"]) == (key_id, model) for line in in_worker)
    assert secret not in text and key not in text
    assert not any(word in text for prompt in prompts for word in prompt.split())
