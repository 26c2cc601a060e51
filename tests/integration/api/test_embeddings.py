"""POST /v1/embeddings and embeddings jobs through the API (TestClient, real Postgres and Redis,
a fake worker): validation with OpenAI's 400s, the job row and queue message, the answer
built from the stored vectors (float and base64), POST /v1/jobs and batches with the
/v1/embeddings endpoint."""

from __future__ import annotations

import base64
import json
import struct
import threading
import time

import pytest
from api_support import auth
from sqlalchemy import select, update

from rein.openai.embeddings import split_inputs, stored_response
from rein.openai.response import usage_body
from rein.store.messages import JobMessage, TokenEvent
from rein.store.tables import Job, Result, Usage

VECTORS = [[0.6, 0.8, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]


@pytest.fixture
def embed_client(make_client, tiny_models):
    """The API serving the tiny embedding model (Matryoshka, last-token pooling) as `emb`."""
    return make_client(models=f"emb={tiny_models('qwen3', embedding='last')}@256")


@pytest.fixture
def key(make_key, tenant) -> str:
    return make_key(tenant)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "input"),
    ({"input": ["ok", ""]}, "input", "input[1] is an empty string"),
    ({"input": [[1, 5000]]}, "input[0]", "not a token id"),
    ({"input": list(range(257))}, "input", "maximum context length is 256"),
    ({"input": ["a"] * 2049}, "input", "2048"),
    ({"input": "a", "dimensions": 0}, "dimensions", ""),
    ({"input": "a", "dimensions": 65}, "dimensions", "at most 64"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "base64"),
    ({"input": "a", "stream": True}, "stream", "Unrecognized request argument"),
])
def test_embeddings_refusals_name_the_parameter(embed_client, key, body, param, words):
    error = error_of(embed_client.post("/v1/embeddings", json={"model": "emb", **body}, headers=auth(key)), 400)
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_dimensions_refused_for_a_model_without_matryoshka(client, key):
    error = error_of(client.post("/v1/embeddings", json={"model": "tiny", "input": "a", "dimensions": 8},
                                 headers=auth(key)), 400)
    assert error["param"] == "dimensions" and "does not support matryoshka representation" in error["message"]


def serve_embeddings(sessions, redis, keys, tenant: str, vectors: list[list[float]]) -> threading.Thread:
    """A fake worker: wait for the tenant's queued embeddings job, record `vectors`, publish the end."""
    def work() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with sessions() as session:
                job = session.scalar(select(Job).where(Job.tenant == tenant, Job.status == "queued"))
                if job is not None:
                    session.expunge(job)
            if job is None:
                time.sleep(0.02)
                continue
            with sessions.begin() as session:
                session.execute(update(Job).where(Job.id == job.id).values(
                    status="succeeded", started_at=job.queued_at, finished_at=job.queued_at, attempt=1))
                session.add(Result(job_id=job.id, text="", finish_reason="stop", token_ids=[],
                                   response=stored_response(vectors)))
                session.add(Usage(job_id=job.id, tenant=job.tenant, key_id=job.key_id, model=job.model,
                                  prompt_tokens=job.prompt_tokens, completion_tokens=0))
            event = TokenEvent(seq=1, text="", finish_reason="stop", usage=usage_body(job.prompt_tokens, 0))
            redis.xadd(keys.job_stream(job.id), {"data": event.to_json()}, id="1-0")
            return

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
def test_embeddings_answer_from_the_stored_vectors(embed_client, key, tenant, db_sessionmaker, redis_client,
                                                   settings, encoding_format):
    from rein.store.redis_keys import RedisKeys

    keys = RedisKeys.from_settings(settings)
    worker = serve_embeddings(db_sessionmaker, redis_client, keys, tenant, VECTORS)
    response = embed_client.post("/v1/embeddings", headers=auth(key), json={
        "model": "emb", "input": ["hello", "world"], "encoding_format": encoding_format})
    worker.join()
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["model"] == "emb"
    assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"embedding"}
    if encoding_format == "base64":
        got = [list(struct.unpack("<4f", base64.b64decode(d["embedding"]))) for d in body["data"]]
        assert [x for v in got for x in v] == pytest.approx([x for v in VECTORS for x in v], abs=1e-7)
    else:
        assert [d["embedding"] for d in body["data"]] == VECTORS

    with db_sessionmaker() as session:
        job = session.scalar(select(Job).where(Job.tenant == tenant))
    tokenizer = embed_client.app.state.registry.get("emb").tokenizer
    hello, world = tokenizer.encode("hello"), tokenizer.encode("world")   # with the end-of-text token
    assert hello[-1] == tokenizer.eos_token_id
    total = len(hello) + len(world)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert job.endpoint == "/v1/embeddings" and job.prompt_tokens == total
    assert job.params["input_lengths"] == [len(hello), len(world)]
    assert job.params["sampling"] == {"dimensions": None, "normalize": None}
    message = JobMessage.for_job(job)          # what the reaper would send again
    assert split_inputs(message.prompt_token_ids, message.input_lengths) == [hello, world]
    # GET /v1/jobs/{id} shows the same body
    shown = embed_client.get(f"/v1/jobs/{job.id}", headers=auth(key)).json()
    assert shown["response"]["body"] == body and shown["usage"]["completion_tokens"] == 0


def test_post_jobs_takes_embeddings(embed_client, key, tenant, db_sessionmaker):
    response = embed_client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/embeddings", "body": {"model": "emb", "input": [[1, 2], [3]], "dimensions": 16}})
    assert response.status_code == 202, response.text
    with db_sessionmaker() as session:
        job = session.get(Job, response.json()["id"])
    assert job.prompt_token_ids == [1, 2, 3] and job.params["input_lengths"] == [2, 1]
    assert job.params["sampling"]["dimensions"] == 16
    error = error_of(embed_client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/embeddings", "body": {"model": "emb", "input": []}}), 400)
    assert error["param"] == "input"


def test_a_batch_of_embeddings_lines_is_validated(make_client, tiny_models, make_key, tenant, tmp_path):
    client = make_client(models=f"emb={tiny_models('qwen3', embedding='last')}@256", files_dir=str(tmp_path))
    key = make_key(tenant, "inference,batch")
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": "x"}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "emb", "input": ["y", ""]}}]
    state = _validated_embeddings_batch(client, key, lines)
    assert state["status"] == "failed", state
    [problem] = state["errors"]["data"]
    assert problem["line"] == 2 and "input[1] is an empty string" in problem["message"]


def _validated_embeddings_batch(client, key: str, lines: list[dict]) -> dict:
    """Upload `lines`, create an embeddings batch of them and return it once validation ended."""
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.post("/v1/files", headers=auth(key), files={"file": ("in.jsonl", content)},
                          data={"purpose": "batch"}).json()["id"]
    batch = client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        state = client.get(f"/v1/batches/{batch.json()['id']}", headers=auth(key)).json()
        if state["status"] != "validating":
            break
        time.sleep(0.1)
    return state


def test_a_batch_past_the_embedding_input_cap_fails_naming_it(make_client, tiny_models, make_key, tenant, tmp_path):
    client = make_client(models=f"emb={tiny_models('qwen3', embedding='last')}@256", files_dir=str(tmp_path),
                         batch_max_embedding_inputs=3)
    key = make_key(tenant, "inference,batch")
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": "x"}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "emb", "input": ["y", "z", "w"]}}]
    state = _validated_embeddings_batch(client, key, lines)
    assert state["status"] == "failed", state
    [problem] = state["errors"]["data"]
    assert problem["code"] == "too_many_embedding_inputs" and problem["line"] == 2
    assert "3" in problem["message"] and "REIN_BATCH_MAX_EMBEDDING_INPUTS" in problem["message"]
