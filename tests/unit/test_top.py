"""`rein top` without Redis: worker states from heartbeats and key TTLs, and the text it
prints for a snapshot (the Redis side is tests/integration/test_top.py)."""

from __future__ import annotations

from rein.cli.top import (
    LOST,
    MODEL_COLUMNS,
    STALE,
    STOPPED,
    UP,
    WORKER_COLUMNS,
    ModelView,
    Snapshot,
    redis_location,
    render,
    worker_view,
)

NOW = 1_800_000_000.0


def beat(worker: str = "tiny@gpu1", **fields) -> dict:
    """A heartbeat as rein.worker.heartbeat.Heartbeat.beat writes it."""
    return {"worker": worker, "model": "tiny", "time": NOW - 1, "state": "up", "started": NOW - 600,
            "interval": 5.0, "running": 12, "waiting": 3, "max_num_seqs": 16, "kv_blocks": 1000,
            "kv_blocks_free": 125, "kv_usage": 0.875, "steps": 5000, "generation_tokens": 90000,
            "preemptions": 7, "tokens_per_second": 431.25, "step_ms": 27.5} | fields


def test_state_comes_from_the_heartbeat_keys_ttl():
    # The key is set with a 15 s TTL at each beat: 14 s left = beat 1 s ago.
    up = worker_view(beat(), ttl_ms=14_000, now=NOW)
    assert (up.state, round(up.age_seconds, 3)) == (UP, 1.0)
    # A missed beat: the key lives on, but the last beat is 12 s old.
    stale = worker_view(beat(), ttl_ms=3_000, now=NOW)
    assert (stale.state, round(stale.age_seconds, 3)) == (STALE, 12.0)
    # The key expired: a worker that did not stop cleanly is LOST; age from its last beat time.
    lost = worker_view(beat(time=NOW - 40), ttl_ms=-2, now=NOW)
    assert (lost.state, round(lost.age_seconds)) == (LOST, 40)
    stopped = worker_view({"worker": "w", "model": "tiny", "time": NOW - 3, "state": "stopped",
                           "interval": 5.0}, ttl_ms=-2, now=NOW)
    assert stopped.state == STOPPED and stopped.running is None


def test_state_does_not_trust_the_workers_clock_while_its_key_lives():
    skewed = worker_view(beat(time=NOW - 3600), ttl_ms=13_000, now=NOW)    # clock an hour behind
    assert skewed.state == UP and round(skewed.age_seconds) == 2


def test_render_shows_models_and_workers_in_named_columns():
    workers = [worker_view(beat(), 14_000, NOW),
               worker_view(beat("tiny@gpu2", time=NOW - 95, running=4), -2, NOW),
               worker_view({"worker": "tiny@gpu3", "model": "tiny", "time": NOW - 30, "state": "stopped"},
                           -2, NOW)]
    models = [ModelView(name="tiny", queued=9, interactive=2, batch=7, workers_up=1, workers_known=3,
                        running=12, waiting=3),
              ModelView(name="big", queued=0, interactive=0, batch=0, workers_up=0, workers_known=0,
                        running=0, waiting=0)]
    text = render(Snapshot(taken_at=NOW, models=models, workers=workers), "redis 127.0.0.1:6379/0")
    lines = text.splitlines()
    assert lines[0] == "rein top  2027-01-15 08:00:00 UTC  redis 127.0.0.1:6379/0"
    header = lines[2].split()
    assert header == [c for column in MODEL_COLUMNS for c in column.split()]
    assert lines[3].split() == ["tiny", "9", "2", "7", "1/3", "12", "3"]
    assert lines[4].split() == ["big", "0", "0", "0", "0/0", "0", "0"]
    assert lines[6].split() == [c for column in WORKER_COLUMNS for c in column.split()]
    assert lines[7].split() == ["tiny@gpu1", "tiny", "UP", "12/16", "3", "87.5", "431.2", "7", "27.5", "1s"]
    assert lines[8].split() == ["tiny@gpu2", "tiny", "LOST", "4/16", "3", "87.5", "431.2", "7", "27.5",
                                "1m35s"]
    assert lines[9].split() == ["tiny@gpu3", "tiny", "STOPPED", "-", "-", "-", "-", "-", "-", "30s"]
    # Columns line up: each worker's STATE starts where the header's does.
    assert len({line.index(state) for line, state in zip(lines[6:10], ("STATE", "UP", "LOST", "STOPPED"),
                                                          strict=True)}) == 1


def test_render_says_when_nothing_reported():
    text = render(Snapshot(taken_at=NOW, models=[], workers=[]))
    assert "REIN_MODELS is empty" in text and "no workers have reported" in text


def test_an_idle_worker_shows_no_step_time():
    [line] = render(Snapshot(NOW, [], [worker_view(beat(step_ms=None, tokens_per_second=0.0), 14_000, NOW)])
                    ).splitlines()[-1:]
    assert line.split()[-4:] == ["0.0", "7", "-", "1s"]


def test_redis_location_hides_credentials():
    assert redis_location("redis://user:hunter2@cache.internal:6380/3") == "cache.internal:6380/3"
    assert redis_location("unix:///run/redis.sock?db=2") == "/run/redis.sock/2"
