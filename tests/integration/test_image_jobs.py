"""A vision model's job in the worker against real Redis and Postgres: the API's preparation
(rein.jobs.prepare with the request's images) makes the job row, the image goes to the file store
by sha256, and `process_job` on a worker context with the tiny Qwen2-VL engine reads it back and
runs it: the answer is rein.LLM's for the same conversation (greedy), also from the message the
reaper rebuilds from the row; a job whose image is gone from the store fails saying so."""

from __future__ import annotations

import base64
import dataclasses
import io
import secrets

import pytest
from PIL import Image

from rein.core.settings import ServedModel
from rein.jobs.image_sources import ImageSources, image_file_id, store_images
from rein.jobs.prepare import prepare
from rein.jobs.registry import ModelRegistry, load_model
from rein.store.messages import JobMessage
from rein.store.tables import ApiKey, Job, Result
from rein.worker.app import make_worker_celery


def data_url(width: int, height: int, color) -> str:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


MESSAGES = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(56, 56, (250, 0, 0))}},
                                         {"type": "text", "text": "What colour?"}]}]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> str:
    from rein.fixtures.tiny_vision import tiny_vision_model

    return str(tiny_vision_model(tmp_path_factory.mktemp("vlm") / "qwen2_vl"))


@pytest.fixture
def vision_context(make_settings, vlm_dir, tmp_path):
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.context import WorkerSpec, build_context

    settings = make_settings(files_dir=str(tmp_path / "files"), models=f"vlm={vlm_dir}@1024")
    config = EngineConfig(model=vlm_dir, kv_cache_memory="16MiB", max_model_len=1024, max_num_seqs=2)
    spec = WorkerSpec(settings=settings, model_name="vlm", engine_factory=lambda: LLMEngine(config))
    context = build_context(make_worker_celery(settings), spec, f"vision-{secrets.token_hex(3)}@test")
    yield context
    context.stop()


def queued_job(context, sessions, vlm_dir, tenant) -> Job:
    """The job the API's intake would store for MESSAGES (its image in the file store)."""
    settings = context.settings
    registry = ModelRegistry([load_model(ServedModel(name="vlm", source=vlm_dir, max_model_len=1024))])
    body = {"model": "vlm", "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    prepared = prepare(registry, "/v1/chat/completions", body,
                       images=ImageSources(settings, context.file_store()).for_request(tenant))
    store_images(context.file_store(), prepared.images)
    sampling = dataclasses.asdict(prepared.parsed.params) | {"ignore_eos": True}
    key_id = f"k{secrets.token_hex(6)}"
    job = Job(tenant=tenant, key_id=key_id, model="vlm", endpoint="/v1/chat/completions",
              params={"body": body, "sampling": sampling, "images": prepared.image_refs},
              prompt_token_ids=prepared.parsed.prompt_token_ids, prompt_tokens=len(prepared.parsed.prompt_token_ids))
    with sessions.begin() as session:
        session.add(ApiKey(key_id=key_id, name="test", tenant=tenant, secret_hash=b"x" * 32, scopes=["inference"]))
        session.add(job)
    with sessions() as session:
        return session.get(Job, job.id)


def test_the_worker_runs_a_job_with_its_stored_image(vision_context, db_sessionmaker, vlm_dir, tenant):
    from rein import LLM, SamplingParams
    from rein.worker.tasks import process_job

    job = queued_job(vision_context, db_sessionmaker, vlm_dir, tenant)
    message = JobMessage.for_job(job)      # as the reaper rebuilds it: the images by sha256 only
    assert message.images == job.params["images"] and len(message.images) == 1
    assert process_job(vision_context, message) == "succeeded"
    with db_sessionmaker() as session:
        result = session.get(Result, job.id)
    llm = LLM(model=vlm_dir, kv_cache_memory="16MiB", max_model_len=1024)
    [expected] = llm.chat(MESSAGES, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    assert expected.prompt_token_ids == list(job.prompt_token_ids)
    assert list(result.token_ids) == list(expected.outputs[0].token_ids)


def test_a_job_whose_image_is_gone_fails_saying_so(vision_context, db_sessionmaker, vlm_dir, tenant):
    from rein.worker.tasks import process_job

    job = queued_job(vision_context, db_sessionmaker, vlm_dir, tenant)
    vision_context.file_store().delete(image_file_id(job.params["images"][0]["sha256"]))
    assert process_job(vision_context, JobMessage.for_job(job)) == "failed"
    with db_sessionmaker() as session:
        failed = session.get(Job, job.id)
    assert failed.error["code"] == "image_missing" and "file store" in failed.error["message"]
