"""What the fault tests (test_chaos.py), bench/chaos.py and bench/soak.py share: the stack on
servers of its own (tests/own_servers.py: killing them touches nothing else), the load (greedy
completions of a fixed length) and the checks that every accepted job ended exactly once.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from e2e_support import MODEL, Service
from own_servers import PostgresCluster, RedisServer
from sqlalchemy.engine import make_url
from support import connect_postgres, wait_for


@dataclass
class Stack:
    service: Service
    redis: RedisServer
    postgres: PostgresCluster

    def db(self):
        url = make_url(self.service.database_url)
        return connect_postgres(url, url.database)


# Leases, the reaper and requeueing shortened so the fault tests recover in seconds.
FAST_RECOVERY = {"REIN_LEASE_SECONDS": "12", "REIN_LEASE_RENEW_SECONDS": "4",
                 "REIN_REAPER_INTERVAL_SECONDS": "1", "REIN_REQUEUE_UNCLAIMED_SECONDS": "6"}
JOBS = 24                # per fault: more than the two workers' 2 x 8 slots, so some wait queued
MAX_TOKENS = 160


def body(i: int, max_tokens: int = MAX_TOKENS) -> dict:
    return {"model": MODEL, "prompt": f"Request {i}: the story of a worker that died", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}


def submit_all(client: httpx.Client, n: int = JOBS, max_tokens: int = MAX_TOKENS) -> list[str]:
    def one(i: int) -> str:
        response = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": body(i, max_tokens)})
        assert response.status_code == 202, response.text
        return response.json()["id"]

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, range(n)))


def statuses(stack: Stack, ids: list[str]) -> dict[str, str]:
    with stack.db() as conn:
        return dict(conn.execute("SELECT id, status FROM jobs WHERE id = ANY(%s)", (ids,)).fetchall())


def wait_all_ended(stack: Stack, ids: list[str], since: float, timeout: float) -> float:
    """Seconds from `since` (time.monotonic()) until every job has ended."""
    def ended() -> bool:
        return all(s in ("succeeded", "failed", "cancelled") for s in statuses(stack, ids).values())

    try:
        wait_for(ended, timeout, f"{len(ids)} jobs to end", interval=0.25)
    except AssertionError as exc:
        left = {s for s in statuses(stack, ids).values()}
        raise AssertionError(f"{exc}; statuses left: {left}{stack.service.diagnostics()}") from None
    return time.monotonic() - since


def check_exactly_once(stack: Stack, ids: list[str], expected: dict[int, str]) -> None:
    """Every job succeeded once: one result, one usage row, the fault-free text."""
    with stack.db() as conn:
        rows = conn.execute("""
            SELECT j.id, j.status, j.attempt, r.text, r.token_ids,
                   (SELECT count(*) FROM results WHERE job_id = j.id),
                   (SELECT count(*) FROM usage WHERE job_id = j.id),
                   u.completion_tokens
              FROM jobs j LEFT JOIN results r ON r.job_id = j.id LEFT JOIN usage u ON u.job_id = j.id
             WHERE j.id = ANY(%s)""", (ids,)).fetchall()
    by_id = {row[0]: row for row in rows}
    assert len(by_id) == len(ids)
    for i, job_id in enumerate(ids):
        _, status, attempt, text, token_ids, results, usages, completion = by_id[job_id]
        assert status == "succeeded", (job_id, status, attempt)
        assert (results, usages) == (1, 1), f"{job_id}: {results} results, {usages} usage rows"
        assert completion == len(token_ids) == MAX_TOKENS
        assert text == expected[i], f"job {i} (attempt {attempt}) differs from the fault-free run"


def tally(stack: Stack, ids: list[str]) -> dict[str, int]:
    """Counts for a report: accepted, ended, succeeded, lost (not succeeded), billed twice, and
    jobs whose result and usage rows are not exactly one each."""
    with stack.db() as conn:
        rows = conn.execute("""
            SELECT j.status, (SELECT count(*) FROM results WHERE job_id = j.id),
                   (SELECT count(*) FROM usage WHERE job_id = j.id)
              FROM jobs j WHERE j.id = ANY(%s)""", (ids,)).fetchall()
    return {"accepted": len(ids),
            "ended": sum(status in ("succeeded", "failed", "cancelled") for status, _, _ in rows),
            "succeeded": sum(status == "succeeded" for status, _, _ in rows),
            "lost": len(ids) - sum(status == "succeeded" for status, _, _ in rows),
            "billed_twice": sum(usages > 1 for _, _, usages in rows),
            "not_exactly_once": sum((results, usages) != (1, 1) for _, results, usages in rows)}


def running(stack: Stack, ids: list[str]) -> int:
    return sum(status == "running" for status in statuses(stack, ids).values())


def running_on(stack: Stack, ids: list[str], worker: str) -> int:
    with stack.db() as conn:
        return conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status = 'running' AND worker = %s",
                            (ids, worker)).fetchone()[0]


def texts(stack: Stack, ids: list[str]) -> dict[int, str]:
    with stack.db() as conn:
        found = dict(conn.execute("SELECT job_id, text FROM results WHERE job_id = ANY(%s)", (ids,)).fetchall())
    return {i: found[job_id] for i, job_id in enumerate(ids)}


def hostname_of(proc) -> str:
    """The --hostname a `rein worker` process was started with."""
    return proc.args[proc.args.index("--hostname") + 1]


def wait_ready(service: Service, timeout: float = 180.0) -> None:
    """Until the API's /readyz answers 200 (after a restart of the API, Redis or Postgres)."""
    def ready() -> bool:
        try:
            return httpx.get(f"{service.base_url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, timeout, "/readyz", interval=0.25)
