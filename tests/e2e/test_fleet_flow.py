"""Flow control across a fleet: a worker holds at most what its engine runs plus its slots,
and every other message stays on the broker, where a worker added under load takes its share.

One worker (max_num_seqs 2: two running, one queued slot, one interactive slot, so at most 4
messages held) is given 48 async jobs; a second later it is paused (the tiny model would run
the backlog down while a second worker starts) and a second worker starts, then both run.
Checked on Redis itself, sampled all along: kombu's `unacked` hash (the messages workers hold)
never exceeds the slots of the workers running, and the model's queue lists keep the backlog,
which the API's `rein:queue_depth` reports. At the end the second worker has run a fair share
of the jobs that had not started when it was added.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from chaos_support import body, hostname_of
from e2e_support import MODEL, STARTUP_TIMEOUT, run_service
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url
from support import connect_postgres, wait_for

from rein.jobs.queues import queue_keys
from rein.store.redis_keys import RedisKeys

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 2
HELD = MAX_NUM_SEQS + 1 + 1     # + queued slot (max(1, 2 // 8)) + interactive slot (max(1, 2 // 4))
JOBS = 48
MAX_TOKENS = 512
# The first worker is paused while the second starts: neither its leases nor the messages it
# holds unclaimed may be taken back meanwhile (the reaper's business, not this test's).
PAUSE_TOLERANT = {"REIN_LEASE_SECONDS": "600", "REIN_LEASE_RENEW_SECONDS": "10",
                  "REIN_REQUEUE_UNCLAIMED_SECONDS": "600"}


class BrokerSampler:
    """Samples, every 20 ms, the messages held by workers (kombu's unacked hash) and waiting
    (the model's queue lists), with the number of workers up at the time."""

    def __init__(self, redis, prefix: str, lists: list[str]) -> None:
        self.redis, self.unacked, self.lists = redis, f"{prefix}unacked", lists
        self.workers_up = 1
        self.samples: list[tuple[int, int, int]] = []    # (workers up, held, waiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="broker-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            up = self.workers_up
            with self.redis.pipeline(transaction=True) as pipe:
                pipe.hlen(self.unacked)
                for key in self.lists:
                    pipe.llen(key)
                held, *waiting = pipe.execute()
            self.samples.append((up, held, sum(waiting)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def most_held(self, workers_up: int) -> int:
        return max((held for up, held, _ in self.samples if up == workers_up), default=0)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator:
    root = tmp_path_factory.mktemp("fleet")
    env = PAUSE_TOLERANT | {"REIN_MAX_NUM_SEQS": str(MAX_NUM_SEQS)}
    with run_service(root, tiny_models("llama"), scopes="inference,usage,admin", extra_env=env) as svc:
        yield svc


def job_rows(service, ids: list[str]) -> list[tuple[str, str, str | None]]:
    url = make_url(service.database_url)
    with connect_postgres(url, url.database) as conn:
        return conn.execute("SELECT id, status, worker FROM jobs WHERE id = ANY(%s)", (ids,)).fetchall()


def queue_depth_metric(service) -> float:
    """The API's `rein:queue_depth` for the model, both priorities (GET /metrics, admin scope)."""
    with service.client("a") as client:
        text = client.get("/metrics").raise_for_status().text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "rein:queue_depth" and sample.labels.get("model_name") == MODEL)


def test_a_worker_added_under_load_takes_its_share_of_what_waits(service) -> None:
    prefix = service.env["REIN_REDIS_KEY_PREFIX"]
    lists = queue_keys(SimpleNamespace(redis_key_prefix=prefix), MODEL)
    sampler = BrokerSampler(service.redis, prefix, lists)
    try:
        with service.client("a") as client:
            ids = []
            for i in range(JOBS):
                response = client.post("/v1/jobs", json={"endpoint": "/v1/completions",
                                                         "body": body(i, MAX_TOKENS)})
                assert response.status_code == 202, response.text
                ids.append(response.json()["id"])
        wait_for(lambda: any(status == "running" for _, status, _ in job_rows(service, ids)), 60,
                 "the first worker to start a job")
        time.sleep(1)
        # The first worker is paused while the second starts (its start takes longer than the
        # whole backlog would on the tiny model): what it holds stays held, nothing else moves.
        service.worker.send_signal(signal.SIGSTOP)
        try:
            time.sleep(0.1)
            waiting_then = sum(status == "queued" for _, status, _ in job_rows(service, ids))
            on_broker_then = sampler.samples[-1][2]
            depth_then = queue_depth_metric(service)
            sampler.workers_up = 2
            second = f"second-{hostname_of(service.worker)}"
            proc = service.spawn("worker-second", "worker", "--model", MODEL, "--hostname", second,
                                 "--loglevel", "info")
            service.workers.append(proc)
            beat = RedisKeys(prefix.rstrip(":")).worker_heartbeat(second)
            wait_for(lambda: service.redis.exists(beat) or proc.poll() is not None, STARTUP_TIMEOUT,
                     "the second worker to beat")
            assert proc.poll() is None, service.diagnostics()
        finally:
            service.worker.send_signal(signal.SIGCONT)
        wait_for(lambda: all(status == "succeeded" for _, status, _ in job_rows(service, ids)), 300,
                 f"{JOBS} jobs to succeed")
    finally:
        sampler.stop()
    rows = job_rows(service, ids)
    ran_second = sum(worker == second for _, _, worker in rows)
    alone, both = sampler.most_held(1), sampler.most_held(2)
    print(f"\nheld by one worker at most {alone} (slots {HELD}), by two {both}; when the second started "
          f"{waiting_then} jobs had not started ({on_broker_then} messages on the broker, "
          f"rein:queue_depth {depth_then:g}); "
          f"the second ran {ran_second} of {JOBS}")
    assert waiting_then >= 8, "the first worker ran the backlog down before the second started: lengthen the jobs"
    # The broker's own count: what workers hold never exceeds their slots.
    assert alone <= HELD, f"one worker held {alone} messages, beyond its {HELD} slots"
    assert both <= 2 * HELD, f"two workers held {both} messages, beyond their {2 * HELD} slots"
    # What had not started waited on the broker, where `rein:queue_depth` counts it, and the
    # second worker took its share of it.
    assert on_broker_then >= waiting_then - HELD
    assert depth_then == on_broker_then
    assert ran_second >= waiting_then // 4, (
        f"the second worker ran {ran_second} of the {waiting_then} jobs waiting when it started")
