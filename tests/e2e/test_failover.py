"""Redis failover under load, with real processes: the service runs on a Redis Sentinel URL
(`redis+sentinel://`, rein.store.redis_client) over a primary, a replica and three sentinels of
the test's own (tests/own_servers.py: RedisSentinelGroup). The primary is SIGKILLed while jobs
run and more are being submitted; the sentinels promote the replica; every accepted job (a
202) still ends `succeeded`, with one result row and one usage row (billed once), the full
length, and the text a run without the fault gives (greedy requests); a submission the API
refused meanwhile was a 503, never a 500; and jobs submitted after the failover succeed.

The API, two workers, the broker, the token streams and the rate limiter all reach Redis
through the sentinels; Postgres is the shared test server (a fresh database), named by a
multi-host URL whose first host is dead (REIN_DATABASE_URL's failover form).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from chaos_support import (
    FAST_RECOVERY,
    Stack,
    body,
    running,
    statuses,
    submit_all,
    texts,
    wait_all_ended,
    wait_ready,
)
from e2e_support import POSTGRES_URL, run_service
from own_servers import RedisSentinelGroup
from sqlalchemy.engine import make_url
from support import wait_for

pytestmark = pytest.mark.slow

JOBS = 16
MAX_TOKENS = 96
RECOVERY_BOUND = 60.0    # seconds from the kill to the last job's end


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinelGroup]:
    group = RedisSentinelGroup(tmp_path_factory.mktemp("sentinel"))
    try:
        group.start()
        yield group
    finally:
        group.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_models, group: RedisSentinelGroup) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("failover")
    # Postgres with a dead first host, in libpq's form: every process skips it (rein.store.db).
    server = make_url(POSTGRES_URL)
    postgres_url = (f"postgresql+psycopg://{server.username}@127.0.0.1:1,{server.host}:{server.port or 5432}"
                    f"/{server.database}?target_session_attrs=read-write")
    with run_service(root, tiny_models("llama"), postgres_url=postgres_url, redis_url=group.url, workers=2,
                     extra_env=FAST_RECOVERY | {"REIN_MAX_NUM_SEQS": "8"}) as service:
        yield Stack(service, None, None)   # type: ignore[arg-type] (the Redis here is the group)


def check_billed_once(stack: Stack, ids: list[str]) -> int:
    """Every job succeeded once: one result, one usage row, all its tokens. The number of jobs
    that took more than one attempt."""
    with stack.db() as conn:
        rows = conn.execute("""
            SELECT j.id, j.status, j.attempt,
                   (SELECT count(*) FROM results WHERE job_id = j.id),
                   (SELECT count(*) FROM usage WHERE job_id = j.id),
                   u.completion_tokens
              FROM jobs j LEFT JOIN results r ON r.job_id = j.id LEFT JOIN usage u ON u.job_id = j.id
             WHERE j.id = ANY(%s)""", (ids,)).fetchall()
    assert len(rows) == len(ids)
    for job_id, status, attempt, results, usages, completion in rows:
        assert status == "succeeded", (job_id, status, attempt)
        assert (results, usages) == (1, 1), f"{job_id}: {results} results, {usages} usage rows"
        assert completion == MAX_TOKENS, (job_id, completion)
    return sum(attempt > 1 for _, _, attempt, _, _, _ in rows)


def test_the_primary_dies_the_replica_is_promoted_and_every_accepted_job_succeeds_once(
        stack: Stack, group: RedisSentinelGroup) -> None:
    service = stack.service
    prompts: dict[str, int] = {}      # job id -> its prompt's number (the text depends on it)
    refused: list[int] = []
    with service.client("a", timeout=30) as client:
        ids = submit_all(client, JOBS, MAX_TOKENS)
        prompts.update({job_id: i for i, job_id in enumerate(ids)})
        stop = threading.Event()

        def keep_submitting() -> None:      # load through the failover: accepted or 503
            i = JOBS
            while not stop.is_set():
                try:
                    response = client.post("/v1/jobs", json={"endpoint": "/v1/completions",
                                                             "body": body(i % JOBS, MAX_TOKENS)})
                except httpx.TimeoutException:
                    refused.append(0)
                    continue
                if response.status_code == 202:
                    prompts[response.json()["id"]] = i % JOBS
                else:
                    refused.append(response.status_code)
                i += 1
                time.sleep(0.3)

        wait_for(lambda: running(stack, ids) >= 4, 60, "jobs to run")
        submitter = threading.Thread(target=keep_submitting)
        submitter.start()
        try:
            time.sleep(0.5)
            old_primary = group.primary.port
            group.primary.proc.send_signal(signal.SIGKILL)
            group.primary.proc.wait(10)
            killed = time.monotonic()
            wait_for(lambda: group.master_port() == group.replica.port, 30, "the sentinels to promote the replica",
                     interval=0.1)
            promoted = time.monotonic() - killed
            time.sleep(3)                   # submissions go on against the new primary
        finally:
            stop.set()
            submitter.join(60)
        accepted = list(prompts)
        recovered = wait_all_ended(stack, accepted, killed, RECOVERY_BOUND + 30)
        wait_ready(service)
        after = submit_all(client, 4, MAX_TOKENS)       # new jobs on the promoted replica
        wait_all_ended(stack, after, time.monotonic(), 60)
    retried = check_billed_once(stack, accepted)
    print(f"\nRedis primary (port {old_primary}) SIGKILLed: replica promoted {promoted:.1f} s later; "
          f"{len(accepted)} accepted jobs ({len(accepted) - JOBS} during the failover) ended {recovered:.1f} s "
          f"after the kill, {retried} of them on a second attempt; refused meanwhile: {sorted(set(refused))}")
    assert set(statuses(stack, after).values()) == {"succeeded"}
    # Greedy: every job of prompt i has the text of the job of prompt i run after the failover
    # (submit_all numbers its prompts 0..3), and all jobs of one prompt agree.
    reference = texts(stack, after)
    by_prompt: dict[int, set[str]] = {}
    for n, text in texts(stack, accepted).items():
        by_prompt.setdefault(prompts[accepted[n]], set()).add(text)
    assert all(len(found) == 1 for found in by_prompt.values()), "jobs of one prompt differ"
    assert all(by_prompt[i] == {reference[i]} for i in reference if i in by_prompt)
    assert all(code == 503 for code in refused), f"refused with {sorted(set(refused))} (0: a timeout)"
    assert recovered < RECOVERY_BOUND
