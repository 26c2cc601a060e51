"""The Batches API against real Postgres and Redis, with the batch manager running in the app and
the worker's part played by hand (FakeWorker): validation with line numbers, enqueueing at batch
priority within the queue window, live counts and partial output, finalizing into output and
error files, cancel, expiry, tenant isolation, and the official openai client."""

from __future__ import annotations

import io
import json
import time

import pytest
from api_support import auth, jsonl, line
from sqlalchemy import select, update
from support import queued_job_ids, wait_for

from rein.core.priorities import LAST_QUEUE_STEP, PRIORITY_BATCH
from rein.jobs.affinity import BATCH_SHARDS
from rein.jobs.queues import priority_lists
from rein.store.tables import Job

FAST = {"batch_poll_seconds": 0.05}

pytestmark = pytest.mark.usefixtures("end_leftover_batches")


@pytest.fixture
def batch_client(make_client, tmp_path):
    return make_client(files_dir=str(tmp_path / "files"), **FAST)


def upload(client, key: str, content: bytes) -> str:
    response = client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                           files={"file": ("in.jsonl", io.BytesIO(content), "application/jsonl")})
    assert response.status_code == 200, response.text
    return response.json()["id"]


def create(client, key: str, content: bytes, endpoint: str = "/v1/completions", **extra) -> dict:
    response = client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": upload(client, key, content), "endpoint": endpoint, "completion_window": "24h",
        **extra})
    assert response.status_code == 200, response.text
    return response.json()


def get(client, key: str, batch_id: str) -> dict:
    response = client.get(f"/v1/batches/{batch_id}", headers=auth(key))
    assert response.status_code == 200, response.text
    return response.json()


def wait_status(client, key: str, batch_id: str, *statuses: str, timeout: float = 30) -> dict:
    return wait_for(lambda: (b := get(client, key, batch_id))["status"] in statuses and b, timeout,
                    f"batch {batch_id} to reach {statuses}")


def batch_jobs(sessions, batch_id: str) -> list[Job]:
    with sessions() as session:
        return list(session.scalars(select(Job).where(Job.batch_id == batch_id).order_by(Job.batch_line)))


def fail_job(sessions, job_id: str) -> None:
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(
            status="failed", finished_at=Job.queued_at,
            error={"message": "the engine refused it", "type": "invalid_request_error", "code": "engine_refused"}))


def jsonl_lines(response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(x) for x in response.text.splitlines()]


def batch_lists(settings) -> list[str]:
    """The Redis lists of the tiny model's batch messages: one per shard (rein.jobs.affinity) and
    batch priority step (a line's own `priority` moves it to a later one, rein.core.priorities)."""
    return [key for step in range(PRIORITY_BATCH, LAST_QUEUE_STEP + 1)
            for key in priority_lists(settings, "tiny", step)]


def waiting_batch_messages(redis_client, settings) -> int:
    return sum(redis_client.llen(key) for key in batch_lists(settings))


def take_batch_messages(redis_client, settings) -> None:
    """As workers taking every waiting batch message would."""
    redis_client.delete(*batch_lists(settings))


def test_validation_lists_every_bad_line(batch_client, make_key, tenant, db_sessionmaker):
    key = make_key(tenant, "batch")
    content = jsonl(
        line("ok-1"),
        "{not json",
        "",                                                   # blank lines are skipped
        line("ok-1", "again"),                                # duplicate custom_id
        line("chat", url="/v1/chat/completions"),             # url differs from the batch's endpoint
        line("who", model="gpt-nope"),                        # model not served
        line("long", max_tokens=600),                         # past the 512-token context
        {**line("get"), "method": "GET"},
        line("ok-2"),
    )
    batch = create(batch_client, key, content)
    assert batch["status"] == "validating" and batch["object"] == "batch"
    failed = wait_status(batch_client, key, batch["id"], "failed")
    errors = failed["errors"]["data"]
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (4, "duplicate_custom_id"), (5, "invalid_url"), (6, "model_not_found"),
        (7, "context_length_exceeded"), (8, "invalid_request")]
    for error in errors:
        assert error["message"].startswith(f"line {error['line']}: ")
    assert "gpt-nope" in errors[3]["message"] and "512" in errors[4]["message"]
    assert failed["failed_at"] is not None and failed["in_progress_at"] is None
    assert batch_jobs(db_sessionmaker, batch["id"]) == []


def test_too_many_lines_and_empty_file(make_client, make_key, tenant, tmp_path, db_sessionmaker):
    client = make_client(files_dir=str(tmp_path / "files"), batch_max_requests=2, **FAST)
    key = make_key(tenant, "batch")
    batch = create(client, key, jsonl(line("a"), line("b"), line("c")))
    errors = wait_status(client, key, batch["id"], "failed")["errors"]["data"]
    assert [(e["line"], e["code"]) for e in errors] == [(3, "too_many_requests")]
    assert "more than 2 requests" in errors[0]["message"]
    assert batch_jobs(db_sessionmaker, batch["id"]) == []    # the two good lines' jobs rolled back
    empty = create(client, key, b"\n\n")
    assert wait_status(client, key, empty["id"], "failed")["errors"]["data"][0]["code"] == "empty_file"


def test_batch_runs_to_completion(batch_client, make_key, tenant, db_sessionmaker, fake_worker, redis_client,
                                  settings):
    key = make_key(tenant, "batch,inference")
    content = jsonl(line("first", "one"), line("second", "two"), line("third", "three"))
    batch = create(batch_client, key, content, metadata={"project": "x"})
    assert batch["metadata"] == {"project": "x"}
    running = wait_status(batch_client, key, batch["id"], "in_progress")
    assert running["request_counts"] == {"total": 3, "completed": 0, "failed": 0}
    assert running["model"] == "tiny" and running["in_progress_at"] is not None
    jobs = wait_for(lambda: (js := batch_jobs(db_sessionmaker, batch["id"])) and all(j.sent_at for j in js)
                    and js, 10, "every job sent")
    assert [(j.custom_id, j.batch_line, j.priority, j.status) for j in jobs] == [
        ("first", 1, PRIORITY_BATCH, "queued"), ("second", 2, PRIORITY_BATCH, "queued"),
        ("third", 3, PRIORITY_BATCH, "queued")]
    assert waiting_batch_messages(redis_client, settings) == 3
    # The jobs are ordinary jobs too: GET /v1/jobs/{id} shows them, and the list filters them.
    assert batch_client.get(f"/v1/jobs/{jobs[0].id}", headers=auth(key)).json()["status"] == "queued"
    other = batch_client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/completions", "body": line("x")["body"]}).json()["id"]
    listed = batch_client.get(f"/v1/jobs?batch_id={batch['id']}", headers=auth(key)).json()["data"]
    # (one INSERT made them all: same created_at, so "newest first" leaves their order open)
    assert sorted((j["custom_id"], j["batch_id"]) for j in listed) == [
        ("first", batch["id"]), ("second", batch["id"]), ("third", batch["id"])]
    everything = batch_client.get("/v1/jobs", headers=auth(key)).json()["data"]
    assert {j["id"] for j in everything} == {other, *(j.id for j in jobs)}
    assert next(j for j in everything if j["id"] == other)["batch_id"] is None

    fake_worker.record(jobs[1].id, "two done", [5, 6])
    live = get(batch_client, key, batch["id"])
    assert live["status"] == "in_progress"
    assert live["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    assert live["usage"]["output_tokens"] == 2 and live["usage"]["input_tokens"] == jobs[1].prompt_tokens
    partial = jsonl_lines(batch_client.get(f"/v1/batches/{batch['id']}/output", headers=auth(key)))
    assert [x["custom_id"] for x in partial] == ["second"]
    assert partial[0]["response"]["body"]["choices"][0]["text"] == "two done"

    fake_worker.record(jobs[0].id, "one done", [7])
    fail_job(db_sessionmaker, jobs[2].id)
    done = wait_status(batch_client, key, batch["id"], "completed")
    assert done["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert done["finalizing_at"] is not None and done["completed_at"] is not None
    output = jsonl_lines(batch_client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key)))
    assert [x["custom_id"] for x in output] == ["first", "second"]
    for entry, job in zip(output, jobs[:2], strict=True):
        assert entry["error"] is None and entry["id"].startswith("batch_req_")
        assert entry["response"]["status_code"] == 200 and entry["response"]["request_id"] == job.id
        job_view = batch_client.get(f"/v1/jobs/{job.id}", headers=auth(key)).json()
        assert entry["response"]["body"] == job_view["response"]["body"]
    errors = jsonl_lines(batch_client.get(f"/v1/files/{done['error_file_id']}/content", headers=auth(key)))
    assert [x["custom_id"] for x in errors] == ["third"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "engine_refused"
    # The partial view of a finished batch is the output file.
    assert jsonl_lines(batch_client.get(f"/v1/batches/{batch['id']}/output", headers=auth(key))) == output
    file = batch_client.get(f"/v1/files/{done['output_file_id']}", headers=auth(key)).json()
    assert file["purpose"] == "batch_output" and file["filename"] == f"{batch['id']}_output.jsonl"


def test_queue_window_feeds_as_workers_drain(make_client, make_key, tenant, db_sessionmaker, redis_client,
                                             settings, tmp_path):
    """The window holds across the batch queue's shards (rein.jobs.affinity: these short
    prompts spread over them)."""
    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=2, **FAST)
    key = make_key(tenant, "batch")
    batch = create(client, key, jsonl(*(line(f"r{i}") for i in range(5))))
    wait_status(client, key, batch["id"], "in_progress")

    def sent() -> int:
        return sum(1 for j in batch_jobs(db_sessionmaker, batch["id"]) if j.sent_at)

    wait_for(lambda: sent() == 2, 10, "two jobs sent")
    assert waiting_batch_messages(redis_client, settings) == 2
    take_batch_messages(redis_client, settings)             # a worker took both messages
    wait_for(lambda: sent() == 4, 10, "two more jobs sent")
    assert waiting_batch_messages(redis_client, settings) == 2


def test_a_batch_sends_its_better_priority_lines_first(make_client, make_key, tenant, db_sessionmaker,
                                                       redis_client, settings, tmp_path):
    """A line's `priority` (vLLM's: lower first) orders the batch's feeding and puts its message
    at its priority step; the batch class is kept (priority 6 and worse) whatever the line asks."""
    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=2, batch_affinity=False,
                         batch_order="file", **FAST)
    key = make_key(tenant, "batch")
    priorities = [3, 0, 2, None, -5]
    batch = create(client, key, jsonl(*(line(f"r{i}", **({} if p is None else {"priority": p}))
                                        for i, p in enumerate(priorities))))
    wait_status(client, key, batch["id"], "in_progress")
    jobs = batch_jobs(db_sessionmaker, batch["id"])
    assert [j.priority for j in jobs] == [PRIORITY_BATCH + 3, PRIORITY_BATCH, PRIORITY_BATCH + 2, PRIORITY_BATCH,
                                          PRIORITY_BATCH]
    ids = {j.custom_id: j.id for j in jobs}

    def sent() -> set[str]:
        return {j.custom_id for j in batch_jobs(db_sessionmaker, batch["id"]) if j.sent_at}

    wait_for(lambda: len(sent()) == 2, 10, "two jobs sent")
    assert sent() == {"r1", "r3"}       # priority 0 (and none, and below 0: r4) in the file's order
    first_step = priority_lists(settings, "tiny", PRIORITY_BATCH, shard=0)[0]
    assert sorted(queued_job_ids(redis_client, first_step)) == sorted([ids["r1"], ids["r3"]])
    take_batch_messages(redis_client, settings)
    wait_for(lambda: len(sent()) == 4, 10, "two more jobs sent")
    assert sent() == {"r1", "r3", "r4", "r2"}
    assert queued_job_ids(redis_client, priority_lists(settings, "tiny", PRIORITY_BATCH + 2, shard=0)[0]) == \
        [ids["r2"]]
    take_batch_messages(redis_client, settings)
    wait_for(lambda: len(sent()) == 5, 10, "the last job sent")
    assert queued_job_ids(redis_client, priority_lists(settings, "tiny", PRIORITY_BATCH + 3, shard=0)[0]) == \
        [ids["r0"]]


def test_recorded_lines_wake_the_manager_before_its_next_poll(make_client, make_key, tenant, db_sessionmaker,
                                                              redis_client, settings, tmp_path):
    """A worker that records batch lines announces them (rein.batches.wakeup): with a 30 s poll,
    the queue is topped up and the batch finished at once (0.2 s between woken ticks), which
    without the announcement wait for the next poll."""
    from rein.batches.wakeup import announce_batch_progress
    from rein.jobs.claim import claim_job
    from rein.store.redis_keys import RedisKeys
    from rein.worker.recorder import GroupRecorder, JobRecord

    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=2, batch_poll_seconds=30)
    manager = client.app.state.batch_manager
    wait_for(manager._events.subscribed.is_set, 10, "the manager's batch event subscription")
    ticks = count_ticks(manager)
    key = make_key(tenant, "batch")
    batch = create(client, key, jsonl(*(line(f"r{i}") for i in range(3))))   # woken by the create
    wait_for(lambda: sum(1 for j in batch_jobs(db_sessionmaker, batch["id"]) if j.sent_at) == 2, 10,
             "the first window sent")
    wait_for(lambda: manager_settled(manager, ticks), 15, "the ticks woken by the create and its validation")
    announced = []
    recorder = GroupRecorder(db_sessionmaker, on_batch_lines=lambda: (
        announced.append(1), announce_batch_progress(redis_client, RedisKeys.from_settings(settings))))
    plain = GroupRecorder(db_sessionmaker)   # no announcement: the manager waits for its poll
    done = JobRecord(status="succeeded", text="ok", token_ids=[1], finish_reason="stop", prompt_tokens=2,
                     completion_tokens=1)

    def run_sent(with_recorder: GroupRecorder) -> None:
        for job in batch_jobs(db_sessionmaker, batch["id"]):
            if job.sent_at and job.status == "queued":
                lease = claim_job(db_sessionmaker, job.id, "w1", 600).lease
                assert lease is not None and lease.batch_id == batch["id"]
                assert with_recorder.record(lease, done)

    take_batch_messages(redis_client, settings)   # a worker took both messages
    run_sent(plain)
    time.sleep(1.0)
    assert sum(1 for j in batch_jobs(db_sessionmaker, batch["id"]) if j.sent_at) == 2   # still waiting for the poll
    manager.wake()                                    # as the poll would
    wait_for(lambda: all(j.sent_at for j in batch_jobs(db_sessionmaker, batch["id"])), 5, "the last line sent")
    started = time.monotonic()
    run_sent(recorder)
    assert announced == [1]
    wait_status(client, key, batch["id"], "completed", timeout=25)   # (a lost wake would wait for the 30 s poll)
    assert time.monotonic() - started < 15      # well before the 30 s poll, even on a loaded machine


def count_ticks(manager) -> list[int]:
    """Count the manager's ticks from now on: [started, finished]."""
    ticks = [0, 0]
    tick = manager.tick

    def counted_tick() -> None:
        ticks[0] += 1
        try:
            tick()
        finally:
            ticks[1] += 1
    manager.tick = counted_tick                  # _run calls self.tick()
    return ticks


def manager_settled(manager, ticks: list[int], quiet_seconds: float = 0.6) -> bool:
    """No tick of the manager ran, started or was asked for over `quiet_seconds`. The create
    and the end of its validation each wake the manager, so a woken tick can still be due after
    the first window is sent: it would send the next line as soon as the queue is emptied."""
    before = list(ticks)
    time.sleep(quiet_seconds)
    return ticks == before and before[0] == before[1] and not manager._wake.is_set()


@pytest.mark.parametrize("order", ["prefix", "file"])
def test_lines_sharing_a_prompt_prefix_are_sent_together(make_client, make_key, tenant, db_sessionmaker,
                                                         redis_client, settings, tmp_path, order):
    """Two system prompts, their lines interleaved in the file: in prefix order (the default)
    each window of sends holds one prompt's lines; in file order, the file's lines. (On one
    shard, affinity off: these short prompts would spread over the shards.)"""
    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=3, batch_order=order,
                         batch_affinity=False, **FAST)
    key = make_key(tenant, "batch")
    systems = ["You are a careful translator. Translate the text into French:",
               "Summarize the following paragraph in one short sentence:"]
    batch = create(client, key, jsonl(*(line(f"r{i}", f"{systems[i % 2]} item {i}") for i in range(6))))
    wait_status(client, key, batch["id"], "in_progress")
    batch_queue = priority_lists(settings, "tiny", PRIORITY_BATCH, shard=0)[0]

    def sent() -> list[str]:
        return sorted(j.custom_id for j in batch_jobs(db_sessionmaker, batch["id"]) if j.sent_at)

    wait_for(lambda: len(sent()) == 3, 10, "three jobs sent")
    first = sent()
    redis_client.delete(batch_queue)             # a worker took them
    wait_for(lambda: len(sent()) == 6, 10, "the other three sent")
    jobs = batch_jobs(db_sessionmaker, batch["id"])
    assert all(job.feed_key and len(job.feed_key) == 4 * min(job.prompt_tokens, 128) for job in jobs)
    if order == "file":
        assert first == ["r0", "r1", "r2"]
    else:
        assert first in (["r0", "r2", "r4"], ["r1", "r3", "r5"])


def test_cancel_mid_batch(batch_client, make_key, tenant, db_sessionmaker, fake_worker, redis_client, settings):
    from rein.store.redis_keys import RedisKeys

    key = make_key(tenant, "batch")
    batch = create(batch_client, key, jsonl(*(line(f"r{i}") for i in range(4))))
    wait_status(batch_client, key, batch["id"], "in_progress")
    jobs = batch_jobs(db_sessionmaker, batch["id"])
    fake_worker.record(jobs[0].id, "kept", [1, 2])
    with db_sessionmaker.begin() as session:      # a worker has claimed r1
        session.execute(update(Job).where(Job.id == jobs[1].id).values(status="running", attempt=1))

    response = batch_client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(key))
    assert response.status_code == 200
    cancelling = response.json()
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] is not None
    statuses = {j.custom_id: (j.status, j.cancel_requested_at is not None)
                for j in batch_jobs(db_sessionmaker, batch["id"])}
    assert statuses == {"r0": ("succeeded", False), "r1": ("running", True), "r2": ("cancelled", True),
                        "r3": ("cancelled", True)}
    assert redis_client.exists(RedisKeys.from_settings(settings).job_cancel(jobs[1].id))
    # It stays cancelling while r1 runs; the worker aborts it and records it cancelled.
    assert get(batch_client, key, batch["id"])["status"] == "cancelling"
    fake_worker.record(jobs[1].id, "par", [3], finish_reason="abort", status="cancelled")
    done = wait_status(batch_client, key, batch["id"], "cancelled")
    assert done["cancelled_at"] is not None and done["completed_at"] is None
    assert done["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    output = jsonl_lines(batch_client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key)))
    assert [x["custom_id"] for x in output] == ["r0"]
    errors = jsonl_lines(batch_client.get(f"/v1/files/{done['error_file_id']}/content", headers=auth(key)))
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [
        ("r1", "batch_cancelled"), ("r2", "batch_cancelled"), ("r3", "batch_cancelled")]
    # Cancelling again changes nothing.
    again = batch_client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(key)).json()
    assert again["status"] == "cancelled"


def test_cancel_while_validating(batch_client, make_key, tenant, db_sessionmaker):
    key = make_key(tenant, "batch")
    batch = create(batch_client, key, jsonl(*(line(f"r{i}") for i in range(3))))
    cancelled = batch_client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(key)).json()
    assert cancelled["status"] in ("cancelling", "cancelled")
    done = wait_status(batch_client, key, batch["id"], "cancelled")
    assert all(j.status == "cancelled" for j in batch_jobs(db_sessionmaker, batch["id"]))
    assert done["output_file_id"] is None


def test_expiry(make_client, make_key, tenant, db_sessionmaker, fake_worker, tmp_path):
    client = make_client(files_dir=str(tmp_path / "files"), batch_completion_window_seconds=2.0, **FAST)
    key = make_key(tenant, "batch")
    batch = create(client, key, jsonl(*(line(f"r{i}") for i in range(3))))
    assert batch["expires_at"] - batch["created_at"] in (1, 2, 3)
    wait_status(client, key, batch["id"], "in_progress")
    jobs = batch_jobs(db_sessionmaker, batch["id"])
    fake_worker.record(jobs[2].id, "in time", [9])
    done = wait_status(client, key, batch["id"], "expired")
    assert done["expired_at"] is not None and done["completed_at"] is None
    assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    assert done["usage"]["output_tokens"] == 1
    output = jsonl_lines(client.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key)))
    assert [x["custom_id"] for x in output] == ["r2"]
    errors = jsonl_lines(client.get(f"/v1/files/{done['error_file_id']}/content", headers=auth(key)))
    assert [(x["custom_id"], x["error"]["code"], x["response"]) for x in errors] == [
        ("r0", "batch_expired", None), ("r1", "batch_expired", None)]


def test_tenant_isolation(batch_client, make_key, tenant):
    mine, theirs = make_key(tenant, "batch"), make_key(f"{tenant}-other", "batch")
    batch = create(batch_client, mine, jsonl(line("a")))
    for method, path in (("GET", ""), ("POST", "/cancel"), ("GET", "/output"), ("GET", "/errors")):
        response = batch_client.request(method, f"/v1/batches/{batch['id']}{path}", headers=auth(theirs))
        assert response.status_code == 404, (path, response.text)
    assert batch_client.get("/v1/batches", headers=auth(theirs)).json()["data"] == []
    assert batch_client.get(f"/v1/jobs?batch_id={batch['id']}",
                            headers=auth(make_key(f"{tenant}-other", "inference,batch"))).json()["data"] == []
    assert [b["id"] for b in batch_client.get("/v1/batches", headers=auth(mine)).json()["data"]] == [batch["id"]]
    # Another tenant's file cannot start a batch.
    file_id = upload(batch_client, mine, jsonl(line("a")))
    response = batch_client.post("/v1/batches", headers=auth(theirs), json={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code == 404


def test_bad_create_requests(batch_client, make_key, tenant):
    key = make_key(tenant, "batch")
    file_id = upload(batch_client, key, jsonl(line("a")))

    def post(**body):
        return batch_client.post("/v1/batches", headers=auth(key), json={
            "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"} | body)

    assert post(endpoint="/v1/rerank").json()["error"]["param"] == "endpoint"
    assert post(completion_window="1h").json()["error"]["param"] == "completion_window"
    assert post(metadata={f"k{i}": "v" for i in range(17)}).status_code == 400
    assert post(input_file_id="file-missing").status_code == 404
    # Unknown fields are refused by name, as on every other endpoint (they were once dropped).
    unknown = post(priority=1)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "priority"
    assert "Unrecognized request argument supplied: priority" in unknown.json()["error"]["message"]
    too_short = post(output_expires_after={"anchor": "created_at", "seconds": 60})
    assert too_short.status_code == 400 and too_short.json()["error"]["param"] == "output_expires_after.seconds"
    assert "3600" in too_short.json()["error"]["message"]
    too_long = post(output_expires_after={"anchor": "created_at", "seconds": 2_592_001})
    assert too_long.status_code == 400 and "2592000" in too_long.json()["error"]["message"]
    anchor = post(output_expires_after={"anchor": "completed_at", "seconds": 3600})
    assert anchor.status_code == 400 and anchor.json()["error"]["param"] == "output_expires_after.anchor"
    extra = post(output_expires_after={"anchor": "created_at", "seconds": 3600, "days": 1})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "output_expires_after.days"
    response = batch_client.post("/v1/batches", headers=auth(make_key(tenant, "inference")), json={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code == 403
    assert response.json()["error"]["message"] == "API scope is not declared: batch"


def test_output_expires_after_sets_the_result_files_expiry(make_client, make_key, tenant, db_sessionmaker,
                                                           fake_worker, tmp_path):
    """output_expires_after (through the official client) applies to the output and error files,
    counted from their creation; a batch without it gets REIN_BATCH_FILE_EXPIRY_SECONDS."""
    from openai import OpenAI

    http = make_client(files_dir=str(tmp_path / "files"), batch_file_expiry_seconds=5 * 86400, **FAST)
    key = make_key(tenant, "batch")
    client = OpenAI(api_key=key, base_url="http://testserver/v1", http_client=http, max_retries=0)

    def run(**extra) -> dict:
        file = client.files.create(file=("in.jsonl", jsonl(line("ok"), line("bad"))), purpose="batch")
        assert file.expires_at == file.created_at + 5 * 86400        # input files: the default too
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h",
                                      **extra)
        wait_status(http, key, batch.id, "in_progress")
        jobs = batch_jobs(db_sessionmaker, batch.id)
        fake_worker.record(jobs[0].id, "fine", [5])
        fail_job(db_sessionmaker, jobs[1].id)
        done = wait_status(http, key, batch.id, "completed")
        return {kind: client.files.retrieve(done[f"{kind}_file_id"]) for kind in ("output", "error")}

    asked = run(output_expires_after={"anchor": "created_at", "seconds": 7200})
    for file in asked.values():
        assert file.purpose == "batch_output" and file.expires_at == file.created_at + 7200
    for file in run().values():
        assert file.expires_at == file.created_at + 5 * 86400


def test_list_pages(batch_client, make_key, tenant):
    key = make_key(tenant, "batch")
    ids = [create(batch_client, key, jsonl(line("a")))["id"] for _ in range(3)]
    first = batch_client.get("/v1/batches", headers=auth(key), params={"limit": 2}).json()
    assert [b["id"] for b in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = batch_client.get("/v1/batches", headers=auth(key), params={"after": first["last_id"]}).json()
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]


def test_official_openai_client(batch_client, make_key, tenant):
    from openai import OpenAI

    client = OpenAI(api_key=make_key(tenant, "batch"), base_url="http://testserver/v1",
                    http_client=batch_client, max_retries=0)
    file = client.files.create(file=("in.jsonl", jsonl(line("a"), line("b"))), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h",
                                  metadata={"run": "1"})
    assert batch.status == "validating" and batch.metadata == {"run": "1"}
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", 10, "in_progress")
    assert client.batches.retrieve(batch.id).request_counts.total == 2
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    wait_for(lambda: client.batches.retrieve(batch.id).status == "cancelled", 10, "cancelled")


def test_rein_batch_list_pages_through_every_batch(batch_client, make_key, tenant):
    """`rein batch list`'s client (the official openai client's pagination): every batch, newest
    first, fetched a page at a time."""
    from rein.cli.batch import BatchClient

    key = make_key(tenant, "batch")
    ids = [create(batch_client, key, jsonl(line("a")))["id"] for _ in range(5)]
    pages = []
    batch_client.event_hooks["request"].append(lambda request: pages.append(request.url.params.get("after")))
    with BatchClient("http://testserver", key, http_client=batch_client) as client:
        listed = [batch["id"] for batch in client.batches(page_size=2)]
    assert listed == ids[::-1]
    assert pages == [None, ids[3], ids[1]]          # three pages of 2, 2 and 1, each after the last


def test_custom_ids_and_prompts_survive_the_bulk_copy(batch_client, make_key, tenant, db_sessionmaker):
    key = make_key(tenant, "batch")
    odd = ["tab\there", "new\nline", "back\\slash", "ünïcødé ✓", "quote\"s", "\\N"]
    batch = create(batch_client, key, jsonl(*(line(c, prompt=f"{c} {{json}}\t") for c in odd)))
    wait_status(batch_client, key, batch["id"], "in_progress")
    jobs = batch_jobs(db_sessionmaker, batch["id"])
    assert [j.custom_id for j in jobs] == odd
    assert [j.params["body"]["prompt"] for j in jobs] == [f"{c} {{json}}\t" for c in odd]
    assert all(j.id.startswith("job_") and j.status == "queued" and j.attempt == 0 for j in jobs)


def test_lost_messages_are_sent_again(make_client, tmp_path, make_key, tenant, db_sessionmaker, redis_client,
                                      settings):
    # The API's reaper (rein.jobs.reaper) sends batch lines whose messages were lost again,
    # as it does any job's: here within a second of the loss.
    batch_client = make_client(files_dir=str(tmp_path / "files"), reaper_interval_seconds=0.2,
                               requeue_unclaimed_seconds=0.5, **FAST)
    key = make_key(tenant, "batch")
    batch = create(batch_client, key, jsonl(*(line(f"r{i}") for i in range(3))))
    wait_status(batch_client, key, batch["id"], "in_progress")
    ids = {j.id for j in batch_jobs(db_sessionmaker, batch["id"])}

    # (The test database is shared: other tests' unrun batch lines of this model may be sent
    # again to the same lists, so count only this batch's.)
    def on_queue() -> list[str]:
        return [job_id for key in batch_lists(settings) for job_id in queued_job_ids(redis_client, key)
                if job_id in ids]

    # Messages go out before their sent_at commits: wait for both.
    wait_for(lambda: sorted(on_queue()) == sorted(ids)
             and all(j.sent_at for j in batch_jobs(db_sessionmaker, batch["id"])), 10, "three messages sent")
    first_sent = {j.id: j.sent_at for j in batch_jobs(db_sessionmaker, batch["id"])}
    take_batch_messages(redis_client, settings)   # Redis lost them; no worker took them

    def sent_again() -> dict | None:
        again = {j.id: j.sent_at for j in batch_jobs(db_sessionmaker, batch["id"])}
        resent = all(again[job_id] and again[job_id] > first_sent[job_id] for job_id in first_sent)
        return again if resent and sorted(on_queue()) == sorted(first_sent) else None

    assert wait_for(sent_again, 10, "the three messages sent again").keys() == first_sent.keys()
    time.sleep(1.5)                               # and not again while they wait on the queue
    assert sorted(on_queue()) == sorted(first_sent)


def test_a_batch_counts_as_one_request_against_rpm(batch_client, make_key, tenant, db_sessionmaker):
    key = make_key(tenant, "batch", rpm=1, tpm=10)
    # Ten lines of up to 4 + prompt tokens each: far past the TPM, yet the batch is accepted.
    batch = create(batch_client, key, jsonl(*(line(f"r{i}") for i in range(10))))
    assert wait_status(batch_client, key, batch["id"], "in_progress")["request_counts"]["total"] == 10
    response = batch_client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": batch["input_file_id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code == 429 and response.headers["Retry-After"]
    assert response.json()["error"]["code"] == "rate_limit_exceeded"


def test_a_batch_whose_validation_breaks_fails_alone(batch_client, make_key, tenant, db_sessionmaker,
                                                     monkeypatch):
    """A poisoned file (here: validation raises on its second line) fails its own batch with
    the line named; another tenant's batch goes on to in_progress meanwhile."""
    import rein.batches.manager as manager

    real = manager.validate_lines

    def breaks_on_poison(source, *args, on_valid, **kwargs):
        def store(valid):
            if valid.custom_id == "poison":
                raise RuntimeError("a bug this input triggers")
            on_valid(valid)

        return real(source, *args, on_valid=store, **kwargs)

    monkeypatch.setattr(manager, "validate_lines", breaks_on_poison)
    poisoned = create(batch_client, make_key(tenant, "batch"), jsonl(line("ok"), line("poison"), line("ok2")))
    other_key = make_key(f"{tenant}-other", "batch")
    healthy = create(batch_client, other_key, jsonl(line("a"), line("b")))
    failed = wait_status(batch_client, make_key(tenant, "batch"), poisoned["id"], "failed")
    [error] = failed["errors"]["data"]
    assert error["code"] == "validation_error" and error["line"] == 2, error
    assert batch_jobs(db_sessionmaker, poisoned["id"]) == []          # nothing half-written
    assert wait_status(batch_client, other_key, healthy["id"], "in_progress")


def test_a_batch_validating_past_its_deadline_fails(make_client, make_key, tenant, tmp_path):
    client = make_client(files_dir=str(tmp_path / "files"), batch_validation_timeout_seconds=0.001, **FAST)
    key = make_key(tenant, "batch")
    batch = create(client, key, jsonl(line("a")))
    failed = wait_status(client, key, batch["id"], "failed")
    assert failed["errors"]["data"][0]["code"] == "validation_timeout"


def test_batch_lines_are_fed_fairly_across_tenants(make_client, make_key, tenant, db_sessionmaker, tmp_path,
                                                   redis_client, settings):
    """One tenant's two large batches fill the queue window first; once workers drain it, the
    room is shared: the other tenant's small batch gets half of it, not what the large ones
    leave. (On one shard, affinity off: the split between shards comes first otherwise.)"""
    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=6, batch_affinity=False, **FAST)
    big_key, small_key = make_key(tenant, "batch"), make_key(f"{tenant}-small", "batch")
    big = [create(client, big_key, jsonl(*(line(f"r{i}") for i in range(20)))) for _ in range(2)]
    for batch in big:
        wait_status(client, big_key, batch["id"], "in_progress")

    def sent(batch) -> int:
        return sum(1 for j in batch_jobs(db_sessionmaker, batch["id"]) if j.sent_at)

    # Generous waits: the batch manager's ticks run late on a loaded machine.
    wait_for(lambda: sent(big[0]) + sent(big[1]) == 6, 60, "the window filled by the large batches")
    small = create(client, small_key, jsonl(*(line(f"s{i}") for i in range(4))))
    wait_status(client, small_key, small["id"], "in_progress")
    time.sleep(0.5)        # a tick that began before it was in_progress has ended
    before = [sent(b) for b in big]    # (stable: the full window leaves no room to feed)
    take_batch_messages(redis_client, settings)     # workers took them all
    # One tick advances the batches one after another, each in its own transaction: wait for
    # the whole window to be sent, not just the small tenant's part of it.
    wait_for(lambda: sent(small) + sum(sent(b) for b in big) - sum(before) == 6, 60, "the window refilled")
    assert sent(small) == 3                                                 # the small tenant's half
    assert [sent(b) - n for b, n in zip(big, before, strict=True)] in ([2, 1], [1, 2])   # the other half, split


def test_batch_lines_need_the_batch_scope(batch_client, make_key, tenant, db_sessionmaker):
    """A key of the same tenant with only `inference` cannot read or cancel batch lines
    through /v1/jobs (403 naming the scope), nor see them listed."""
    batch = create(batch_client, make_key(tenant, "batch"), jsonl(line("a"), line("b")))
    wait_status(batch_client, make_key(tenant, "batch"), batch["id"], "in_progress")
    [job_id, *_] = [j.id for j in batch_jobs(db_sessionmaker, batch["id"])]
    inference = make_key(tenant, "inference")
    for method, path in (("GET", f"/v1/jobs/{job_id}"), ("POST", f"/v1/jobs/{job_id}/cancel"),
                         ("GET", f"/v1/jobs/{job_id}/events"), ("GET", f"/v1/jobs?batch_id={batch['id']}")):
        response = batch_client.request(method, path, headers=auth(inference))
        assert response.status_code == 403, (path, response.text)
        assert "API scope is not declared: batch" in response.json()["error"]["message"]
    assert batch_client.get("/v1/jobs", headers=auth(inference)).json()["data"] == []
    assert batch_jobs(db_sessionmaker, batch["id"])[0].cancel_requested_at is None     # nothing was cancelled


def test_output_is_read_a_page_at_a_time_holding_no_session_between_pages(batch_client, make_key, tenant,
                                                                          db_sessionmaker, fake_worker):
    """A slow reader of a batch's output holds no database connection while it reads: the rows
    come a page at a time, each page in a session closed before its lines go out."""
    from rein.batches.repository import get_batch_for_tenant
    from rein.batches.result_files import batch_line_pages

    key = make_key(tenant, "batch,inference")
    batch = create(batch_client, key, jsonl(*(line(f"c{i}", f"p{i}") for i in range(5))))
    wait_status(batch_client, key, batch["id"], "in_progress")
    jobs = wait_for(lambda: (js := batch_jobs(db_sessionmaker, batch["id"])) and len(js) == 5 and js, 10, "jobs")
    for i, job in enumerate(jobs):
        fake_worker.record(job.id, f"done {i}", [5])

    open_sessions = []

    class CountingSessions:
        def __call__(self):
            session = db_sessionmaker()
            open_sessions.append(session)
            real_close = session.close

            def close():
                open_sessions.remove(session)
                real_close()

            session.close = close
            return session

    pages = batch_line_pages(CountingSessions(), lambda s: get_batch_for_tenant(s, tenant, batch["id"]), "output",
                             page_rows=2)
    read = []
    for text in pages:
        assert open_sessions == []          # between lines handed out: no session open
        read.append(json.loads(text)["custom_id"])
    assert read == [f"c{i}" for i in range(5)]
    streamed = jsonl_lines(batch_client.get(f"/v1/batches/{batch['id']}/output", headers=auth(key)))
    assert [x["custom_id"] for x in streamed] == read


def test_downloads_per_key_are_capped(make_client, make_key, tenant, tmp_path):
    from rein.store.keys import parse_key

    client = make_client(files_dir=str(tmp_path / "files"), max_downloads_per_key=1)
    key = make_key(tenant, "batch,inference")
    file_id = upload(client, key, jsonl(line("a")))
    slots = client.app.state.download_slots
    assert slots.acquire(parse_key(key)[0])          # a download in progress elsewhere
    refused = client.get(f"/v1/files/{file_id}/content", headers=auth(key))
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "5"
    assert refused.json()["error"]["code"] == "too_many_downloads"
    slots.release(parse_key(key)[0])
    assert client.get(f"/v1/files/{file_id}/content", headers=auth(key)).status_code == 200
    assert slots.held(parse_key(key)[0]) == 0       # released when the download ended


def test_validation_holds_no_transaction_open(batch_client, make_key, tenant, db_sessionmaker, monkeypatch):
    """While a file's lines are checked, no transaction of the run's database stays open and
    no job row exists; the batch's advisory lock is held (so another manager
    skips it); the jobs appear in one short transaction once every line passed."""
    import threading

    from sqlalchemy import text

    import rein.batches.locks as locks
    import rein.batches.manager as manager

    real = manager.validate_lines
    reached, release = threading.Event(), threading.Event()

    def slow(source, *args, before_line, **kwargs):
        def check(number):
            before_line(number)
            if number == 3:
                reached.set()
                assert release.wait(30)

        return real(source, *args, before_line=check, **kwargs)

    monkeypatch.setattr(manager, "validate_lines", slow)
    key = make_key(tenant, "batch")
    batch = create(batch_client, key, jsonl(*(line(f"r{i}") for i in range(5))))
    assert reached.wait(30)
    time.sleep(1.5)
    try:
        with db_sessionmaker() as session:
            open_transactions = session.scalar(text(   # (the app's other transactions are short)
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND now() - xact_start > interval '1 second' AND pid <> pg_backend_pid()"))
            held = session.scalar(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = :ns "
                "AND objid = hashtext(:id)::oid AND granted"), {"ns": locks.LOCK_NAMESPACE, "id": batch["id"]})
            assert locks.try_lock_batch(session, batch["id"]) is False   # another manager would skip it
        assert open_transactions == 0
        assert held == 1
        assert batch_jobs(db_sessionmaker, batch["id"]) == []
        assert get(batch_client, key, batch["id"])["status"] == "validating"
    finally:
        release.set()
    assert wait_status(batch_client, key, batch["id"], "in_progress")
    assert [j.custom_id for j in batch_jobs(db_sessionmaker, batch["id"])] == [f"r{i}" for i in range(5)]


def test_a_cancel_stops_a_validation_between_lines(batch_client, make_key, tenant, db_sessionmaker, monkeypatch):
    import threading

    import rein.batches.manager as manager

    monkeypatch.setattr(manager, "STATUS_CHECK_SECONDS", 0.0)
    real = manager.validate_lines
    reached, release = threading.Event(), threading.Event()
    lines_seen = []

    def slow(source, *args, before_line, **kwargs):
        def check(number):
            lines_seen.append(number)
            if number == 2:
                reached.set()
                assert release.wait(30)
            before_line(number)

        return real(source, *args, before_line=check, **kwargs)

    monkeypatch.setattr(manager, "validate_lines", slow)
    key = make_key(tenant, "batch")
    batch = create(batch_client, key, jsonl(*(line(f"r{i}") for i in range(50))))
    assert reached.wait(30)
    assert batch_client.post(f"/v1/batches/{batch['id']}/cancel", headers=auth(key)).json()["status"] == "cancelling"
    release.set()
    assert wait_status(batch_client, key, batch["id"], "cancelled")
    assert max(lines_seen) == 2            # the line after the cancel was not checked
    assert batch_jobs(db_sessionmaker, batch["id"]) == []


def test_lines_about_one_document_wait_on_one_shard(make_client, make_key, tenant, db_sessionmaker, redis_client,
                                                    settings, tmp_path):
    """Affinity (rein.jobs.affinity): each document's questions get one batch queue shard, found
    past the system prompt every line shares, and their messages wait on that shard's list;
    the documents spread over several shards."""
    import random

    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=64, **FAST)
    key = make_key(tenant, "batch")
    words = random.Random(7).choices(["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"], k=600)
    system = "Answer the question about the document below in one word. " * 6
    documents = [" ".join(words[i * 100:(i + 1) * 100]) for i in range(6)]
    questions = ["Who?", "What is it about?", "When?", "Where does it happen?"]
    lines = [line(f"d{d}q{q}", f"{system}\n{document}\nQuestion: {question}")
             for q, question in enumerate(questions) for d, document in enumerate(documents)]
    batch = create(client, key, jsonl(*lines))
    wait_status(client, key, batch["id"], "in_progress")
    wait_for(lambda: all(j.sent_at for j in batch_jobs(db_sessionmaker, batch["id"])), 10, "every line sent")
    jobs = batch_jobs(db_sessionmaker, batch["id"])
    shards = {}
    for job in jobs:
        shards.setdefault(job.custom_id.split("q")[0], set()).add(job.shard)
    assert all(len(s) == 1 for s in shards.values()), shards
    assert len({s for (s,) in shards.values()}) >= 2, shards
    assert all(0 <= job.shard < BATCH_SHARDS for job in jobs)
    for job in jobs:
        (waiting_on,) = priority_lists(settings, "tiny", PRIORITY_BATCH, shard=job.shard)
        assert job.id in queued_job_ids(redis_client, waiting_on)
