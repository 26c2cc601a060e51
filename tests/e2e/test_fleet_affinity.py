"""Prefix affinity across workers (rein.jobs.affinity): a batch of questions about long
documents is prefilled about once per document across two workers, not once per worker.

One `rein api` and one worker run a batch of DOCUMENTS documents of DOC_TOKENS tokens x
QUESTIONS questions each (prompts as token ids, so every document is exactly that long; the
lines shuffled in the file); then a second worker joins and a batch of the same shape (other
documents, so nothing is cached from the first) runs on both. The prompt tokens the workers
computed (each line's prompt less what its worker found in its prefix cache, from the usage
rows) for the two-worker batch stay within 1.25x the one-worker batch's, and each worker runs
at least a quarter of the lines. Without affinity, each document's questions go to whichever
worker is free and most documents are prefilled on both (1.80x, measured before affinity:
bench/scale.py --affinity compares the two on demand).

The wall times are printed, not asserted: on this 2-core machine the API and two workers share
the cores (bench/scale.py gives each worker a core of its own where the machine has them).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator

import httpx
import pytest
from e2e_support import MODEL, STARTUP_TIMEOUT, run_service
from sqlalchemy.engine import make_url
from support import connect_postgres, wait_for

from rein.store.redis_keys import RedisKeys
from rein.worker.heartbeat import HEARTBEAT_SECONDS

pytestmark = pytest.mark.slow

DOCUMENTS, QUESTIONS, DOC_TOKENS = 40, 8, 1000
VOCAB = range(10, 2000)                  # the tiny model's tokens, specials aside


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator:
    env = {"REIN_BATCH_POLL_SECONDS": "0.2", "REIN_MAX_NUM_SEQS": "8", "REIN_KV_CACHE_MEMORY": "64MiB"}
    with run_service(tmp_path_factory.mktemp("affinity"), tiny_models("llama"), scopes="inference,batch,usage",
                     extra_env=env, max_model_len=2048) as svc:
        yield svc


def batch_file(seed: int) -> bytes:
    rng = random.Random(seed)
    lines = []
    for d in range(DOCUMENTS):
        document = [rng.choice(VOCAB) for _ in range(DOC_TOKENS)]
        for q in range(QUESTIONS):
            question = [rng.choice(VOCAB) for _ in range(rng.randrange(8, 24))]
            lines.append(json.dumps({"custom_id": f"d{d}-q{q}", "method": "POST", "url": "/v1/completions",
                                     "body": {"model": MODEL, "prompt": document + question, "max_tokens": 2,
                                              "temperature": 0.0}}))
    rng.shuffle(lines)
    return ("\n".join(lines) + "\n").encode()


def run_batch(client: httpx.Client, content: bytes) -> tuple[str, float]:
    """Run a batch to completion: its id and wall time from creation."""
    upload = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
    assert upload.status_code == 200, upload.text
    started = time.monotonic()
    batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                              "completion_window": "24h"}).raise_for_status().json()

    def done() -> dict | None:
        current = client.get(f"/v1/batches/{batch['id']}").raise_for_status().json()
        assert current["status"] not in ("failed", "expired", "cancelled"), current
        return current if current["status"] == "completed" else None

    finished = wait_for(done, 600, "the batch to complete", interval=0.5)
    assert finished["request_counts"] == {"total": DOCUMENTS * QUESTIONS, "completed": DOCUMENTS * QUESTIONS,
                                          "failed": 0}
    return batch["id"], time.monotonic() - started


def computed_by_worker(service, batch_id: str) -> dict[str, tuple[int, int]]:
    """Worker -> (lines it ran, prompt tokens it computed) for one batch."""
    url = make_url(service.database_url)
    with connect_postgres(url, url.database) as conn:
        rows = conn.execute("SELECT j.worker, count(*), sum(u.prompt_tokens - u.cached_tokens) FROM jobs j "
                            "JOIN usage u ON u.job_id = j.id WHERE j.batch_id = %s GROUP BY j.worker",
                            (batch_id,)).fetchall()
    return {worker: (int(lines), int(computed)) for worker, lines, computed in rows}


def test_two_workers_prefill_each_document_about_once(service) -> None:
    with service.client("a", timeout=60) as client:
        alone_id, alone_seconds = run_batch(client, batch_file(seed=1))
        alone = computed_by_worker(service, alone_id)

        prefix = service.env["REIN_REDIS_KEY_PREFIX"]
        second = "affinity-second@localhost"
        proc = service.spawn("worker-second", "worker", "--model", MODEL, "--hostname", second)
        service.workers.append(proc)
        beat = RedisKeys(prefix.rstrip(":")).worker_heartbeat(second)
        wait_for(lambda: service.redis.exists(beat) or proc.poll() is not None, STARTUP_TIMEOUT,
                 "the second worker to beat")
        assert proc.poll() is None, service.diagnostics()
        time.sleep(HEARTBEAT_SECONDS + 1)      # the first worker has seen it: the shards are split
        both_id, both_seconds = run_batch(client, batch_file(seed=2))
        both = computed_by_worker(service, both_id)

    one_computed = sum(computed for _, computed in alone.values())
    two_computed = sum(computed for _, computed in both.values())
    lines = DOCUMENTS * QUESTIONS
    print(f"\none worker: {one_computed} prompt tokens computed of {lines * DOC_TOKENS}+ in {alone_seconds:.1f} s; "
          f"two workers: {two_computed} ({two_computed / one_computed:.2f}x) in {both_seconds:.1f} s "
          f"({alone_seconds / both_seconds:.2f}x faster); lines and tokens by worker: {both}")
    assert len(alone) == 1
    assert two_computed <= 1.25 * one_computed, (
        f"two workers computed {two_computed} prompt tokens, {two_computed / one_computed:.2f}x one worker's "
        f"{one_computed}: documents were prefilled on both")
    assert len(both) == 2 and all(count >= lines // 4 for count, _ in both.values()), (
        f"each worker should run at least a quarter of the {lines} lines: {both}")
