"""Embeddings jobs in the worker against real Redis and Postgres (rein.worker.embeddings):
every input through the engine, one recorded result, usage, the final event, refusals
naming the input, and a cancel aborting every input of the job."""

from __future__ import annotations

import base64
import math
import secrets
import struct

import pytest
from support import wait_for

from rein.jobs.results import response_body
from rein.model.pooling_config import PoolingConfig
from rein.openai.embeddings import parse_embeddings_request
from rein.store.messages import STREAM_FIELD, JobMessage, TokenEvent
from rein.store.redis_keys import RedisKeys
from rein.store.tables import ApiKey, Job, Result, Usage
from rein.worker.app import make_worker_celery

MODEL = "tiny-embed"


@pytest.fixture
def context(make_settings, tiny_models):
    """`context(pooling="last", **engine)`: a worker context on a tiny embedding model, without Celery."""
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.context import WorkerSpec, build_context

    built = []

    def make(pooling: str = "last", **engine):
        settings = make_settings()
        config = EngineConfig(model=str(tiny_models("qwen3", embedding=pooling)),
                              **({"kv_cache_memory": "16MiB", "max_model_len": 256, "max_num_seqs": 8} | engine))
        spec = WorkerSpec(settings=settings, model_name=MODEL, engine_factory=lambda: LLMEngine(config))
        built.append(build_context(make_worker_celery(settings), spec, f"embed-{secrets.token_hex(3)}@test"))
        return built[-1]

    yield make
    for made in built:
        made.stop()


@pytest.fixture
def make_job(db_sessionmaker, tenant):
    """`make_job(body) -> JobMessage`: an embeddings job stored as intake stores one."""
    key_id = f"k{secrets.token_hex(6)}"
    with db_sessionmaker.begin() as session:
        session.add(ApiKey(key_id=key_id, name="test", tenant=tenant, secret_hash=b"x" * 32, scopes=["inference"]))

    class Tokenizer:
        def __len__(self) -> int:
            return 2048

    def make(body: dict) -> JobMessage:
        parsed = parse_embeddings_request(body, Tokenizer(), 10_000, PoolingConfig(is_matryoshka=True))
        job = Job(tenant=tenant, key_id=key_id, model=MODEL, endpoint="/v1/embeddings",
                  params={"body": body, "sampling": {"dimensions": parsed.params.dimensions, "normalize": None},
                          "input_lengths": parsed.input_lengths},
                  prompt_token_ids=parsed.prompt_token_ids, prompt_tokens=len(parsed.prompt_token_ids))
        with db_sessionmaker.begin() as session:
            session.add(job)
        return JobMessage.for_job(job)   # as the reaper or the batch manager rebuild it

    return make


def stored(sessions, job_id: str) -> tuple[Job, Result | None, list[Usage]]:
    with sessions() as session:
        job = session.get(Job, job_id)
        result = session.get(Result, job_id)
        usage = list(session.query(Usage).filter(Usage.job_id == job_id))
        session.expunge_all()
    return job, result, usage


def events(redis_client, settings, job_id: str) -> list[TokenEvent]:
    keys = RedisKeys.from_settings(settings)
    return [TokenEvent.from_json(fields[STREAM_FIELD.encode()]) for _, fields in
            redis_client.xrange(keys.job_stream(job_id))]


def test_an_embeddings_job_runs_every_input_and_records_one_result(context, make_job, db_sessionmaker,
                                                                   redis_client, settings):
    from rein.worker.tasks import process_job

    worker = context()
    inputs = [[5, 6, 7], list(range(100, 140)), [5, 6, 7]]
    message = make_job({"input": inputs, "encoding_format": "base64"})
    assert message.input_lengths == [3, 40, 3]
    assert process_job(worker, message) == "succeeded"

    job, result, [usage] = stored(db_sessionmaker, message.job_id)
    assert job.status == "succeeded" and result.finish_reason == "stop"
    vectors = [entry["embedding"] for entry in result.response["data"]]
    assert [entry["index"] for entry in result.response["data"]] == [0, 1, 2]
    assert all(len(v) == 64 and math.isclose(sum(x * x for x in v), 1.0, rel_tol=1e-5) for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]          # the same input, the same vector
    assert (usage.prompt_tokens, usage.completion_tokens) == (46, 0)

    body = response_body(job, result)                        # base64, as the request asked
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["usage"] == {"prompt_tokens": 46, "total_tokens": 46}
    decoded = [list(struct.unpack("<64f", base64.b64decode(d["embedding"]))) for d in body["data"]]
    assert [x for v in decoded for x in v] == pytest.approx([x for v in vectors for x in v], abs=1e-7)

    [final] = events(redis_client, settings, message.job_id)   # one event: the end
    assert final.finish_reason == "stop" and final.usage["prompt_tokens"] == 46
    assert worker.engine.pool.num_free == worker.engine.pool.num_blocks and not worker.engine.requests


def test_dimensions_reach_the_engine(context, make_job, db_sessionmaker):
    from rein.worker.tasks import process_job

    worker = context()
    full = make_job({"input": [[9, 10, 11]]})
    cut = make_job({"input": [[9, 10, 11]], "dimensions": 16})
    assert process_job(worker, full) == process_job(worker, cut) == "succeeded"
    [vector] = [e["embedding"] for e in stored(db_sessionmaker, full.job_id)[1].response["data"]]
    [short] = [e["embedding"] for e in stored(db_sessionmaker, cut.job_id)[1].response["data"]]
    norm = math.sqrt(sum(x * x for x in vector[:16]))
    assert short == pytest.approx([x / norm for x in vector[:16]], abs=1e-6)


def test_an_input_the_engine_refuses_fails_the_job_naming_it(context, make_job, db_sessionmaker):
    from rein.worker.tasks import process_job

    worker = context(max_model_len=64)
    message = make_job({"input": [[1, 2, 3], list(range(100, 200))]})
    assert process_job(worker, message) == "failed"
    job, result, usage = stored(db_sessionmaker, message.job_id)
    assert job.error["type"] == "invalid_request_error" and "input[1]" in job.error["message"]
    assert "maximum context length is 64" in job.error["message"]
    assert result is None and usage == []
    # The inputs queued before the refused one are aborted by the engine thread, within a step.
    engine = worker.engine
    wait_for(lambda: engine.pool.num_free == engine.pool.num_blocks and not engine.requests, 10,
             "the aborted inputs' blocks to be freed")


def test_a_cancel_aborts_every_input(context, make_job, db_sessionmaker, redis_client, settings, monkeypatch):
    """The cancel path aborts the job id; that aborts all of its engine requests."""
    from rein.jobs.cancel import request_cancel
    from rein.worker.tasks import process_job

    # Mean pooling in 16-token chunks: each input takes many steps, so the cancel lands mid-way.
    worker = context(pooling="mean", max_num_batched_tokens=16, max_num_seqs=2)
    message = make_job({"input": [list(range(100, 340))] * 4})
    submit_group = worker.runner.submit_group

    def submit_then_cancel(*args, **kwargs):
        streams = submit_group(*args, **kwargs)
        request_cancel(redis_client, RedisKeys.from_settings(settings), message.job_id, 60)
        return streams

    monkeypatch.setattr(worker.runner, "submit_group", submit_then_cancel)
    assert process_job(worker, message) == "cancelled"
    job, result, [usage] = stored(db_sessionmaker, message.job_id)
    assert job.status == "cancelled" and result is None
    assert usage.prompt_tokens < 4 * 240      # not every input was computed
    assert events(redis_client, settings, message.job_id)[-1].finish_reason == "abort"
    assert worker.engine.pool.num_free == worker.engine.pool.num_blocks and not worker.engine.requests
