"""Images through the API on real Postgres and Redis, a tiny Qwen2-VL's tokenizer and processor
(rein.fixtures.tiny_vision) served as `vlm` beside the text-only `tiny`: a chat job's image is
expanded into the prompt, kept in the file store by sha256 and named in the job's params and
rebuilt message; bad images, too many images, a text-only model and another tenant's file are
400s / 404s naming the part; uploads with purpose vision; Responses' input_image; a batch whose
bad image line fails alone (FakeWorker plays the worker)."""

from __future__ import annotations

import base64
import io
import json

import pytest
from api_support import auth, jsonl
from PIL import Image
from sqlalchemy import select
from support import wait_for

from rein.jobs.image_sources import image_file_id
from rein.store.messages import JobMessage
from rein.store.tables import Job

pytestmark = pytest.mark.usefixtures("end_leftover_batches")


def png(width: int = 56, height: int = 56, color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(*images: str, model: str = "vlm", text: str = "What is in the picture?", **extra) -> dict:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return {"model": model, "messages": [{"role": "user", "content": parts}], "max_tokens": 4, **extra}


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> str:
    from rein.fixtures.tiny_vision import tiny_vision_model

    return str(tiny_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl"))


@pytest.fixture
def files_dir(tmp_path):
    return tmp_path / "files"


@pytest.fixture
def vision_client(make_client, model_dir, vlm_dir, files_dir):
    return make_client(models=f"vlm={vlm_dir}@2048,tiny={model_dir}@512", files_dir=str(files_dir),
                       batch_poll_seconds=0.05, limit_mm_per_prompt="image=2")


def submit(client, key, body, endpoint="/v1/chat/completions"):
    return client.post("/v1/jobs", json={"endpoint": endpoint, "body": body}, headers=auth(key))


def image_pad_id(vlm_dir: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vlm_dir).convert_tokens_to_ids("<|image_pad|>")


def test_a_chat_job_with_an_image(vision_client, make_key, tenant, db_sessionmaker, files_dir, vlm_dir):
    key = make_key(tenant)
    image = png(56, 84)
    response = submit(vision_client, key, image_chat(data_url(image)))
    assert response.status_code == 202, response.text
    with db_sessionmaker() as session:
        job = session.get(Job, response.json()["id"])
    sha = __import__("hashlib").sha256(image).hexdigest()
    assert job.params["images"] == [{"sha256": sha, "detail": "auto"}]
    # 56 x 84 pixels: a 4 x 6 grid of 14-pixel patches, merged 2 x 2: 6 image tokens in the prompt.
    assert job.prompt_token_ids.count(image_pad_id(vlm_dir)) == 6
    assert (files_dir / image_file_id(sha)).read_bytes() == image
    # the message a reaper rebuilds from the row names the same images, and never holds their bytes
    message = JobMessage.for_job(job)
    assert message.images == [{"sha256": sha, "detail": "auto"}]
    assert image not in json.dumps(message.to_dict()).encode() and "base64" not in json.dumps(job.params["images"])
    # the params keep the request body without the image's bytes (they are in the file store)
    kept = job.params["body"]["messages"][0]["content"][1]["image_url"]["url"]
    assert kept.startswith("data:omitted;sha256=") and len(kept) < 100
    assert job.params["body"]["messages"][0]["content"][0] == {"type": "text", "text": "What is in the picture?"}


def test_an_idempotent_replay_of_an_image_request(vision_client, make_key, tenant):
    key = make_key(tenant)
    body = image_chat(data_url(png()))
    headers = auth(key) | {"Idempotency-Key": "img-1"}
    first = vision_client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=headers)
    again = vision_client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=headers)
    assert first.status_code == 202 and again.json()["id"] == first.json()["id"]
    other = image_chat(data_url(png(color=(0, 0, 0))))
    conflict = vision_client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": other}, headers=headers)
    assert conflict.status_code == 409


def test_detail_low_counts_fewer_tokens(vision_client, make_key, tenant, db_sessionmaker, vlm_dir):
    key = make_key(tenant)
    big = data_url(png(560, 560))
    counts = {}
    for detail in ("high", "low"):
        body = image_chat(big)
        body["messages"][0]["content"][1]["image_url"]["detail"] = detail
        response = submit(vision_client, key, body)
        assert response.status_code == 202, response.text
        with db_sessionmaker() as session:
            job = session.get(Job, response.json()["id"])
        counts[detail] = job.prompt_token_ids.count(image_pad_id(vlm_dir))
        assert job.params["images"][0]["detail"] == detail
    assert counts["low"] <= counts["high"]


def test_image_refusals_name_the_part(vision_client, make_key, tenant):
    key = make_key(tenant)

    def error(body, endpoint="/v1/chat/completions"):
        response = vision_client.post(endpoint, json=body, headers=auth(key))
        assert response.status_code == 400, response.text
        return response.json()["error"]

    corrupt = error(image_chat(data_url(png()[:40])))
    assert corrupt["param"] == "messages[0].content[1]" and corrupt["code"] == "invalid_image"
    too_many = error(image_chat(*[data_url(png())] * 3))
    assert "at most 2" in too_many["message"] and too_many["param"] == "messages[0].content[3]"
    text_only = error(image_chat(data_url(png()), model="tiny"))
    assert text_only["code"] == "images_not_supported" and "takes no images" in text_only["message"]
    fetch_off = error(image_chat("https://example.com/cat.png"))
    assert "REIN_IMAGE_FETCH=off" in fetch_off["message"]
    streaming = error(image_chat(data_url(b"GIF89a-not-really"), stream=True))
    assert streaming["code"] == "invalid_image"
    responses = error({"model": "vlm", "instructions": "Be brief.", "input": [
        {"role": "user", "content": "first"},
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(b"nope")}]}]}, "/v1/responses")
    assert responses["param"] == "input[1].content[0]" and responses["code"] == "invalid_image"


def test_a_vision_file_by_id_and_tenant_isolation(vision_client, make_key, tenant, db_sessionmaker, vlm_dir):
    mine, theirs = make_key(tenant, "batch,inference"), make_key(tenant + "-other", "batch,inference")
    uploaded = vision_client.post("/v1/files", headers=auth(mine), data={"purpose": "vision"},
                                  files={"file": ("cat.png", io.BytesIO(png()), "image/png")})
    assert uploaded.status_code == 200, uploaded.text
    file = uploaded.json()
    assert file["purpose"] == "vision" and file["filename"] == "cat.png"
    body = {"model": "vlm", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "file_id": file["id"]}]}],
            "max_output_tokens": 4}
    response = submit(vision_client, mine, body, "/v1/responses")
    assert response.status_code == 202, response.text
    with db_sessionmaker() as session:
        job = session.get(Job, response.json()["id"])
    assert len(job.params["images"]) == 1 and image_pad_id(vlm_dir) in job.prompt_token_ids
    # another tenant's file is not found, as a missing one is
    other = submit(vision_client, theirs, body, "/v1/responses")
    assert other.status_code == 404 and other.json()["error"]["code"] == "file_not_found"
    assert other.json()["error"]["message"] == submit(vision_client, theirs, {
        **body, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": file["id"] + "x"}]}]},
        "/v1/responses").json()["error"]["message"].replace(file["id"] + "x", file["id"])
    # a batch input file is not an image
    batch_file = vision_client.post("/v1/files", headers=auth(mine), data={"purpose": "batch"},
                                    files={"file": ("in.jsonl", io.BytesIO(b"{}\n"), "application/jsonl")}).json()
    chat = {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "input_image", "file_id": batch_file["id"]}]}]}
    wrong = submit(vision_client, mine, chat)
    assert wrong.status_code == 400 and "purpose 'vision'" in wrong.json()["error"]["message"]


def test_a_batch_with_one_bad_image_line(vision_client, make_key, tenant, db_sessionmaker, fake_worker):
    key = make_key(tenant, "batch,inference")

    def chat_line(custom_id, url):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": image_chat(url)}

    content = jsonl(chat_line("good-1", data_url(png())), chat_line("bad", data_url(b"\x89PNG broken")),
                    chat_line("good-2", data_url(png(28, 28, (0, 0, 255)))))
    uploaded = vision_client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                                  files={"file": ("in.jsonl", io.BytesIO(content), "application/jsonl")}).json()
    batch = vision_client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}).json()

    def current():
        return vision_client.get(f"/v1/batches/{batch['id']}", headers=auth(key)).json()

    running = wait_for(lambda: (b := current())["status"] in ("in_progress", "failed") and b, 30, "validation")
    assert running["status"] == "in_progress", running.get("errors")
    assert running["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    with db_sessionmaker() as session:
        jobs = list(session.scalars(select(Job).where(Job.batch_id == batch["id"]).order_by(Job.batch_line)))
    assert [(j.custom_id, j.status) for j in jobs] == [("good-1", "queued"), ("bad", "failed"), ("good-2", "queued")]
    assert jobs[1].error["code"] == "invalid_image" and jobs[1].error["param"] == "body.messages[0].content[1]"
    assert all(len(j.params["images"]) == 1 for j in (jobs[0], jobs[2]))
    view = vision_client.get(f"/v1/jobs/{jobs[1].id}", headers=auth(key)).json()
    assert view["status"] == "failed" and view["error"]["code"] == "invalid_image"
    assert "base64" not in json.dumps([j.params for j in jobs])
    fake_worker.record(jobs[0].id, "red", [5])
    fake_worker.record(jobs[2].id, "blue", [6])
    done = wait_for(lambda: (b := current())["status"] == "completed" and b, 30, "the batch to complete")
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    errors = vision_client.get(f"/v1/files/{done['error_file_id']}/content", headers=auth(key)).text.splitlines()
    assert len(errors) == 1
    error_line = json.loads(errors[0])
    assert error_line["custom_id"] == "bad" and error_line["response"]["status_code"] == 400
    assert error_line["response"]["body"]["error"]["code"] == "invalid_image"
    assert "image" in error_line["response"]["body"]["error"]["message"]


def test_tokenize_counts_an_images_tokens(vision_client, make_key, tenant, vlm_dir, files_dir):
    key = make_key(tenant)
    body = image_chat(data_url(png(56, 84)))
    counted = vision_client.post("/tokenize", json={"model": "vlm", "messages": body["messages"]}, headers=auth(key))
    assert counted.status_code == 200, counted.text
    assert counted.json()["tokens"].count(image_pad_id(vlm_dir)) == 6
    job = submit(vision_client, key, body)
    assert job.status_code == 202
    bad = vision_client.post("/tokenize", json={"model": "vlm", "messages": image_chat(data_url(b"x"))["messages"]},
                             headers=auth(key))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].content[1]"
