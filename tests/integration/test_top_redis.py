"""`rein top --once` against real Redis: queue lists and worker heartbeats written under the
run's key prefix, then the command's printed output; and a real worker context's heartbeat
(tiny model, no Celery) seen UP, then STOPPED after its warm stop."""

from __future__ import annotations

import json
import time

import pytest
from support import wait_for

from rein.cli.main import main
from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.core.settings import get_settings
from rein.jobs.queues import queue_keys
from rein.store.redis_keys import RedisKeys
from rein.worker.app import make_worker_celery


@pytest.fixture
def top_env(settings_env, monkeypatch):
    """The run's settings in the environment, serving `tiny` (the path is never loaded by top)."""
    monkeypatch.setenv("REIN_MODELS", "tiny=/models/tiny,idle=/models/idle")
    get_settings.cache_clear()
    return settings_env


def top(capsys, *args: str) -> tuple[int, list[str], str]:
    code = main(["top", "--once", *args])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err


def row(lines: list[str], first: str) -> list[str]:
    [found] = [line.split() for line in lines if line.split()[:1] == [first]]
    return found


def put_beat(redis, keys: RedisKeys, name: str, model: str, *, age: float, alive: bool, **fields) -> None:
    beat = {"worker": name, "model": model, "time": time.time() - age, "state": "up", "interval": 5.0,
            "running": 2, "waiting": 1, "max_num_seqs": 4, "kv_usage": 0.25, "preemptions": 3,
            "tokens_per_second": 120.0, "step_ms": 8.0} | fields
    redis.hset(keys.workers(), name, json.dumps(beat))
    if alive:
        redis.set(keys.worker_heartbeat(name), json.dumps(beat), ex=15)


def test_top_once_shows_queues_by_priority_and_workers_by_state(top_env, redis_client, capsys):
    keys = RedisKeys.from_settings(top_env)
    redis_client.delete(keys.workers())     # workers and queued messages earlier tests of this run left
    for model in ("tiny", "idle", "extra"):
        redis_client.delete(*queue_keys(top_env, model))
    tiny_lists = queue_keys(top_env, "tiny")
    redis_client.rpush(tiny_lists[PRIORITY_INTERACTIVE], "m1", "m2")
    redis_client.rpush(tiny_lists[PRIORITY_BATCH], "m3", "m4", "m5")
    redis_client.rpush(queue_keys(top_env, "extra")[PRIORITY_BATCH], "m6")
    put_beat(redis_client, keys, "tiny@a", "tiny", age=0, alive=True)
    put_beat(redis_client, keys, "tiny@b", "tiny", age=40, alive=False)          # died 40 s ago
    put_beat(redis_client, keys, "extra@c", "extra", age=0, alive=True, running=0)
    put_beat(redis_client, keys, "tiny@old", "tiny", age=3600, alive=False)      # long gone

    code, lines, err = top(capsys)
    assert code == 0, err
    assert top_env.redis_key_prefix in lines[0]
    assert row(lines, "MODEL") == ["MODEL", "QUEUED", "INTERACTIVE", "BATCH", "WORKERS", "RUN", "WAIT"]
    assert row(lines, "tiny") == ["tiny", "5", "2", "3", "1/2", "2", "1"]    # the LOST worker is not counted
    assert row(lines, "idle") == ["idle", "0", "0", "0", "0/0", "0", "0"]     # served, nothing reported
    assert row(lines, "extra") == ["extra", "1", "0", "1", "1/1", "0", "1"]   # only a worker names it
    assert row(lines, "tiny@a")[:3] == ["tiny@a", "tiny", "UP"]
    assert row(lines, "tiny@a")[3:9] == ["2/4", "1", "25.0", "120.0", "3", "8.0"]
    assert row(lines, "tiny@b")[2::7] == ["LOST", "40s"]
    assert not any("tiny@old" in line for line in lines)
    assert redis_client.hkeys(keys.workers()) and not redis_client.hexists(keys.workers(), "tiny@old")

    code, lines, _ = top(capsys, "--json")
    snapshot = json.loads(lines[0])
    assert code == 0 and len(lines) == 1
    assert {m["name"]: (m["interactive"], m["batch"]) for m in snapshot["models"]} == \
        {"tiny": (2, 3), "idle": (0, 0), "extra": (0, 1)}
    assert {w["name"]: w["state"] for w in snapshot["workers"]} == {"tiny@a": "UP", "tiny@b": "LOST",
                                                                     "extra@c": "UP"}


def test_top_says_when_redis_is_unreachable(top_env, monkeypatch, capsys):
    monkeypatch.setenv("REIN_REDIS_URL", "redis://127.0.0.1:1/0")
    get_settings.cache_clear()
    code, lines, err = top(capsys)
    assert code == 1 and lines == []
    assert "cannot read from Redis at 127.0.0.1:1/0" in err and "REIN_REDIS_URL" in err


def test_a_real_workers_heartbeat_shows_up_then_stopped(top_env, make_settings, tiny_models, capsys):
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.context import WorkerSpec, build_context

    settings = make_settings(max_num_seqs=2)
    config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="8MiB", max_model_len=256,
                          max_num_seqs=2)
    context = build_context(make_worker_celery(settings), WorkerSpec(settings=settings, model_name="tiny",
                                                              engine_factory=lambda: LLMEngine(config)),
                            "tiny@top-test")
    try:
        def shown_up() -> list[str] | None:
            _, lines, _ = top(capsys)
            found = [line.split() for line in lines if line.startswith("tiny@top-test")]
            return found[0] if found and found[0][2] == "UP" else None

        worker = wait_for(shown_up, 30, "the worker to show UP in rein top")
        assert worker[1] == "tiny" and worker[3] == "0/2" and worker[4] == "0"     # RUN, WAIT
        assert worker[5] == "0.0" and worker[7] == "0" and worker[8] == "-"       # KV%, PREEMPT, STEP ms
    finally:
        context.stop()
    _, lines, _ = top(capsys)
    assert row(lines, "tiny@top-test")[2] == "STOPPED"
