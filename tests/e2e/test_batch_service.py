"""End to end for the Batches API: `rein api` (with its batch manager) and `rein worker` as
subprocesses on the tiny model (see e2e_support), everything through HTTP.

Covers: a batch runs to completion with every custom_id answered once and billed once;
interactive jobs overtake a large running batch (their queue time stays small) and a cancel
mid-batch keeps completed results; the API killed and the worker restarted mid-batch lose
nothing and bill nothing twice; a short completion window expires a batch. The window is
REIN_BATCH_COMPLETION_WINDOW_SECONDS = WINDOW for the whole module, so every other batch here
is sized to finish well within it; the expiry test runs last.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from e2e_support import MODEL, STARTUP_TIMEOUT, Service, run_service, submit
from support import wait_for

pytestmark = pytest.mark.slow

WINDOW = 90
QUEUE_WINDOW = 64
BATCH_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    with run_service(tmp_path_factory.mktemp("e2e-batch"), tiny_models("llama"),
                     scopes="inference,batch,usage",
                     extra_env={"REIN_FILES_DIR": str(tmp_path_factory.mktemp("files")),
                                "REIN_BATCH_COMPLETION_WINDOW_SECONDS": str(WINDOW),
                                "REIN_BATCH_QUEUE_WINDOW": str(QUEUE_WINDOW),
                                "REIN_BATCH_POLL_SECONDS": "0.2"}) as svc:
        yield svc


# -- helpers ----------------------------------------------------------------------------------


def lines(n: int, max_tokens: int, prefix: str = "req", **sampling) -> bytes:
    return "".join(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": max_tokens,
                                        "temperature": 0.0, **sampling}}) + "\n"
                   for i in range(n)).encode()


def start_batch(client: httpx.Client, content: bytes) -> dict:
    upload = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
    assert upload.status_code == 200, upload.text
    response = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                 "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code == 200, response.text
    return response.json()


def get_batch(client: httpx.Client, batch_id: str) -> dict:
    return client.get(f"/v1/batches/{batch_id}").raise_for_status().json()


def wait_batch(service: Service, client: httpx.Client, batch_id: str, *statuses: str,
               timeout: float = BATCH_TIMEOUT) -> dict:
    def reached() -> dict | None:
        batch = get_batch(client, batch_id)
        return batch if batch["status"] in statuses else None

    try:
        return wait_for(reached, timeout, f"batch {batch_id} to reach {statuses}", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {get_batch(client, batch_id)}{service.diagnostics()}") from None


def file_lines(client: httpx.Client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    response = client.get(f"/v1/files/{file_id}/content")
    assert response.status_code == 200, response.text
    return [json.loads(x) for x in response.text.splitlines()]


def usage_totals(client: httpx.Client) -> tuple[int, int]:
    """(requests, completion tokens) billed to the client's tenant so far."""
    data = client.get("/v1/usage").raise_for_status().json()["data"]
    return sum(b["requests"] for b in data), sum(b["completion_tokens"] for b in data)


def completion_tokens(output: list[dict]) -> int:
    return sum(x["response"]["body"]["usage"]["completion_tokens"] for x in output)


# -- tests ------------------------------------------------------------------------------------


def test_small_batch_completes(service: Service) -> None:
    with service.client("a") as client:
        before = usage_totals(client)
        batch = start_batch(client, lines(12, 8))
        done = wait_batch(service, client, batch["id"], "completed", "failed")
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
        output = file_lines(client, done["output_file_id"])
        assert done["error_file_id"] is None
        assert sorted(x["custom_id"] for x in output) == sorted(f"req-{i}" for i in range(12))
        for entry in output:
            body = entry["response"]["body"]
            assert entry["error"] is None and entry["response"]["status_code"] == 200
            assert body["object"] == "text_completion" and body["model"] == MODEL
            assert 1 <= body["usage"]["completion_tokens"] <= 8
        after = usage_totals(client)
        assert after[0] - before[0] == 12
        assert after[1] - before[1] == completion_tokens(output) == done["usage"]["output_tokens"]


def test_interactive_jobs_overtake_a_running_batch_then_cancel(service: Service) -> None:
    with service.client("a") as a, service.client("b") as b:
        batch = start_batch(b, lines(300, 200, ignore_eos=True))   # long enough to outlast the checks
        wait_for(lambda: get_batch(b, batch["id"])["request_counts"]["completed"] >= 4, BATCH_TIMEOUT,
                 "the batch to be under way", interval=0.2)
        queue_seconds = []
        for i in range(3):
            job = service.wait_job(a, submit(a, {"prompt": f"interactive {i}", "max_tokens": 4,
                                                 "temperature": 0.0}))
            assert job["status"] == "succeeded", job
            queue_seconds.append(job["timings"]["queue_seconds"])
        running = get_batch(b, batch["id"])
        left = running["request_counts"]["total"] - running["request_counts"]["completed"]
        print(f"\ninteractive queue seconds while the batch ran: {queue_seconds}; "
              f"batch requests still to run: {left} of 300")
        assert running["status"] == "in_progress" and left >= 100, running
        # Behind QUEUE_WINDOW waiting batch messages each would wait for several batch jobs to
        # finish; at priority 0 a job waits only for one of the worker's slots to free up.
        assert max(queue_seconds) < 5.0, queue_seconds

        cancelled = b.post(f"/v1/batches/{batch['id']}/cancel").raise_for_status().json()
        assert cancelled["status"] in ("cancelling", "cancelled")
        done = wait_batch(service, b, batch["id"], "cancelled")
        counts = done["request_counts"]
        assert counts["completed"] + counts["failed"] == counts["total"] == 300
        assert counts["completed"] >= 4 and counts["failed"] > 0
        output = file_lines(b, done["output_file_id"])
        errors = file_lines(b, done["error_file_id"])
        assert len(output) == counts["completed"] and len(errors) == counts["failed"]
        assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
        assert sorted(x["custom_id"] for x in output + errors) == sorted(f"req-{i}" for i in range(300))
        for entry in output:     # completed results are whole (no aborted answer in the output)
            assert entry["response"]["body"]["usage"]["completion_tokens"] == 200


def test_api_killed_and_worker_restarted_mid_batch(service: Service) -> None:
    with service.client("b") as client:
        before = usage_totals(client)
        batch = start_batch(client, lines(150, 16, prefix="restart", ignore_eos=True))
        wait_for(lambda: get_batch(client, batch["id"])["request_counts"]["completed"] >= 1, BATCH_TIMEOUT,
                 "the batch to be under way", interval=0.1)
        service.api.send_signal(signal.SIGKILL)           # a crash: no shutdown at all
        service.api.wait(10)
        service.worker.send_signal(signal.SIGTERM)        # warm shutdown hands running jobs back
        service.worker.wait(60)
        hostname = f"e2e-restart-{secrets.token_hex(3)}@localhost"
        service.spawn("worker2", "worker", "--model", MODEL, "--hostname", hostname, "--loglevel", "info")
        service.spawn("api2", "api")
        heartbeat = f"{service.env['REIN_REDIS_KEY_PREFIX'].rstrip(':')}:worker:{hostname}"

        def ready() -> bool:
            try:
                api_ok = httpx.get(f"{service.base_url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                api_ok = False
            return api_ok and service.redis.get(heartbeat) is not None

        wait_for(ready, STARTUP_TIMEOUT, "the restarted api and worker", interval=0.25)
        done = wait_batch(service, client, batch["id"], "completed", "failed", "expired")
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": 150, "completed": 150, "failed": 0}
        output = file_lines(client, done["output_file_id"])
        ids = [x["custom_id"] for x in output]
        assert len(ids) == len(set(ids)) == 150
        after = usage_totals(client)
        # Billed once each: one usage row per request, and exactly the output's tokens.
        assert after[0] - before[0] == 150
        assert after[1] - before[1] == completion_tokens(output) == 150 * 16


def test_short_window_expires_the_batch(service: Service) -> None:
    with service.client("a") as client:
        # Far more work than the window allows on any machine (5,000 x 500 tokens), so some
        # requests finish and the rest expire whatever the speed.
        batch = start_batch(client, lines(5000, 500, prefix="slow", ignore_eos=True))
        assert batch["expires_at"] - batch["created_at"] in (WINDOW - 1, WINDOW, WINDOW + 1)
        started = time.monotonic()
        done = wait_batch(service, client, batch["id"], "expired", "completed", timeout=WINDOW + 90)
        assert done["status"] == "expired", done
        assert time.monotonic() - started >= WINDOW - 5
        counts = done["request_counts"]
        assert counts["total"] == 5000 and counts["completed"] + counts["failed"] == 5000
        assert 0 < counts["completed"] < 5000
        output = file_lines(client, done["output_file_id"])
        errors = file_lines(client, done["error_file_id"])
        assert len(output) == counts["completed"]
        assert [x["error"]["code"] for x in errors] == ["batch_expired"] * counts["failed"]
        assert done["usage"]["output_tokens"] >= completion_tokens(output)
