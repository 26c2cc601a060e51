"""The worker's pieces that need no services: the Celery configuration, routing, the
queue message and token event round trips, and the engine runner's per-step hook."""

from __future__ import annotations

import json
import threading

import pytest

from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.core.settings import Settings
from rein.jobs.affinity import BATCH_SHARDS
from rein.jobs.queues import PRIORITY_STEPS, TASK_NAME, JobRouter, make_celery, queue_keys
from rein.openai.response import usage_body
from rein.store.messages import (
    STREAM_FIELD,
    JobMessage,
    TokenEvent,
    event_id,
)
from rein.store.redis_keys import RedisKeys
from rein.worker.recorder import JobRecord


@pytest.fixture(scope="module")
def settings() -> Settings:
    return Settings(redis_url="redis://127.0.0.1:6379/9", redis_key_prefix="unit:", job_timeout_seconds=600,
                    max_num_seqs=12)


@pytest.fixture(scope="module")
def app(settings):
    return make_celery(settings)


def test_message_round_trip_is_json_safe():
    message = JobMessage(job_id="job_1", model="llama", endpoint="/v1/chat/completions",
                         prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 4, "temperature": 0.0},
                         priority=PRIORITY_BATCH, logprobs_mode=2, tenant="t", key_id="k")
    again = JobMessage.from_dict(json.loads(json.dumps(message.to_dict())))
    assert again == message


def test_token_event_round_trip_and_stream_ids():
    middle = TokenEvent(seq=3, text="héllo ", token_ids=[5, 6])
    final = TokenEvent(seq=4, text="", finish_reason="stop", usage=usage_body(7, 3))
    assert TokenEvent.from_json(middle.to_json()) == middle
    assert not middle.final and final.final
    assert TokenEvent.from_json(final.to_json().encode()) == final
    assert json.loads(final.to_json())["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                                                    "prompt_tokens_details": {"cached_tokens": 0}}
    assert "finish_reason" not in json.loads(middle.to_json())
    assert event_id(4) == "4-0" and STREAM_FIELD == "data"


def test_redis_keys_follow_the_settings_prefix(settings):
    keys = RedisKeys.from_settings(settings)
    assert keys.job_stream("job_1") == "unit:job:job_1:events"
    assert keys.queue("llama") == "unit.model.llama"
    assert RedisKeys.from_settings(Settings()).cancel_channel() == "rein:cancel"


def test_flow_control_settings(app, settings):
    conf = app.conf
    assert conf.task_acks_late is True
    assert conf.task_reject_on_worker_lost is True
    assert conf.worker_prefetch_multiplier == 1
    assert conf.worker_concurrency == settings.max_num_seqs + max(1, settings.max_num_seqs // 8)   # queued_slots
    assert conf.worker_cancel_long_running_tasks_on_connection_loss is True
    assert conf.result_backend is None and conf.task_ignore_result is True
    assert conf.broker_url == settings.redis_url


def test_visibility_timeout_outlasts_the_job_and_leases_are_short(app, settings):
    # The broker redelivers only after the longest job could have ended; a dead worker's jobs
    # come back long before through their short leases (the reaper).
    visibility = app.conf.broker_transport_options["visibility_timeout"]
    assert visibility > settings.job_timeout_seconds
    assert settings.lease_renew_seconds * 2 <= settings.lease_seconds < 60


def test_interactive_outranks_batch_on_redis(app):
    options = app.conf.broker_transport_options
    # kombu's queue order: the worker's preference, never rotated (tests/unit/test_affinity.py).
    assert options["queue_order_strategy"] == "rein.jobs.affinity:AffinityCycle"
    steps = options["priority_steps"]
    assert steps == PRIORITY_STEPS
    # Redis transport: lower is served first; both priorities must land on distinct steps.
    assert PRIORITY_INTERACTIVE < PRIORITY_BATCH
    assert PRIORITY_INTERACTIVE in steps and PRIORITY_BATCH in steps
    assert options["global_keyprefix"] == "unit:"


def test_jobs_route_to_their_model_queue(app, settings):
    message = JobMessage("job_1", "qwen", "/v1/completions", [1], {}).to_dict()
    route = app.amqp.router.route({}, TASK_NAME, args=(message,), kwargs={})
    assert route["queue"].name == "unit.model.qwen"
    assert JobRouter(RedisKeys("x"))("other.task", (), {}, {}) is None
    with pytest.raises(ValueError, match="model"):
        JobRouter(RedisKeys("x"))(TASK_NAME, ({"job_id": "j"},), {}, {})
    assert queue_keys(settings, "qwen")[:2] == ["unit:unit.model.qwen", "unit:unit.model.qwen:1"]
    # Every priority step of the interactive queue, then the batch steps of each batch shard.
    interactive, batch = PRIORITY_BATCH, len(PRIORITY_STEPS) - PRIORITY_BATCH
    assert len(queue_keys(settings, "qwen")) == interactive + batch * BATCH_SHARDS
    # A batch job goes to its shard's queue (rein.jobs.affinity); shard 0 keeps the plain name.
    for shard, name in [(0, "unit.model.qwen.batch"), (3, "unit.model.qwen.batch.3")]:
        message = JobMessage("job_2", "qwen", "/v1/completions", [1], {}, priority=PRIORITY_BATCH,
                             shard=shard).to_dict()
        assert app.amqp.router.route({}, TASK_NAME, args=(message,), kwargs={})["queue"].name == name


def test_job_task_is_registered_late_acked(app):
    import rein.worker.tasks  # noqa: F401  (a shared task: registered when its module is imported)

    task = app.tasks[TASK_NAME]
    assert task.acks_late is True and task.reject_on_worker_lost is True and task.ignore_result is True


def test_job_record_refuses_unknown_status():
    with pytest.raises(ValueError, match="succeeded, failed or cancelled"):
        JobRecord(status="running")


def test_importing_the_app_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from rein.jobs.queues import make_celery; from rein.core.settings import Settings; "
            "make_celery(Settings()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.fixture(scope="module")
def engine(tiny_models):
    from rein.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="4MiB", max_model_len=256))


def test_runner_on_step_sees_every_step_before_the_streams(engine):
    from rein.engine import EngineClient, SamplingParams

    steps: list[list[tuple[str, list[int], bool]]] = []
    seen_first: dict[str, bool] = {}
    lock = threading.Lock()

    def on_step(outputs):
        assert threading.current_thread().name == "rein-engine"
        with lock:
            steps.append([(o.request_id, list(o.new_token_ids), o.finished) for o in outputs])
            for o in outputs:
                seen_first.setdefault(o.request_id, True)

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    with EngineClient(engine, on_step=on_step) as runner:
        streams = [runner.submit(f"r{i}", [3 + i, 4, 5], params) for i in range(3)]
        results = {s.request_id: [t for o in s for t in o.new_token_ids] for s in streams}
    hooked: dict[str, list[int]] = {}
    for step in steps:
        assert len({rid for rid, _, _ in step}) == len(step)   # one output per request per step
        for rid, tokens, _ in step:
            hooked.setdefault(rid, []).extend(tokens)
    assert hooked == results
    assert any(len(step) > 1 for step in steps)                 # batched: several jobs per call


def test_runner_survives_a_failing_hook(engine):
    from rein.engine import EngineClient, SamplingParams

    def on_step(outputs):
        raise RuntimeError("hook broke")

    with EngineClient(engine, on_step=on_step) as runner:
        outputs = list(runner.submit("x", [5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)))
    assert outputs[-1].finished and sum(len(o.new_token_ids) for o in outputs) == 3


def test_closing_a_channel_whose_transport_is_gone_does_not_crash_the_worker():
    """Celery 5.7 collects a dropped broker connection, then closes it; a channel left open by
    a failed first close must not raise AttributeError the second time (rein.jobs.queues)."""
    from kombu import Connection

    from rein.jobs.queues import _tolerate_channels_of_collected_connections

    class ChannelOfCollectedConnection:
        def close(self) -> None:
            raise AttributeError("'NoneType' object has no attribute 'hostname'")

    _tolerate_channels_of_collected_connections()
    _tolerate_channels_of_collected_connections()   # applied once
    Connection("memory://").maybe_close_channel(ChannelOfCollectedConnection())
