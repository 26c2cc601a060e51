"""The Celery app: broker, flow control, queues and priorities, and how a job is enqueued.

One module holds the whole Celery configuration, so the API (which only sends) and the
worker (which consumes) cannot disagree about it. Importing it costs no torch.

Why each setting:

* Flow control (docs/architecture.md): the threads pool with one thread per engine sequence,
  prefetch 1 and late acks, so a worker reserves only as many jobs as its engine batches,
  and a message is acknowledged only once its job is recorded. Plus `queued_slots` (an
  eighth of max_num_seqs by default): a few jobs waiting in the engine, so that when a job
  ends the engine starts the next at its next step, rather than leaving the sequence empty
  while the finished job is recorded and acknowledged and the next message is taken and
  claimed (on the tiny bench model that gap cost ~13% more engine steps for the same work).
* `task_reject_on_worker_lost` and a visibility timeout longer than the longest job
  (`Settings.visibility_timeout_seconds`): a message whose worker vanished comes back,
  but never while its job may still be running. The claim's lease (rein.jobs.claim)
  makes that redelivery safe.
* `worker_cancel_long_running_tasks_on_connection_loss`: a message whose broker
  connection was lost cannot be acknowledged any more and will be redelivered, so its
  running job is interrupted and handed back rather than run on (the threads pool cannot
  kill a thread: rein's pool turns the cancel into an engine abort, see
  rein.worker.bootstep.EngineThreadPool).
* Two queues per served model, chosen by a router from the message's `model` and
  `priority`: interactive jobs (priority below PRIORITY_BATCH) on `RedisKeys.queue`, batch
  jobs on `RedisKeys.batch_queue`, itself BATCH_SHARDS queues by the message's `shard`, a
  hash of its prompt's prefix (rein.jobs.affinity: a worker takes its own shards first, so
  batch lines sharing a document meet on one worker). Redis priorities with ten steps, where
  lower is taken first (kombu pops the step-0 lists of every queue a channel consumes before
  any step-6 one), so interactive jobs (PRIORITY_INTERACTIVE = 0) overtake waiting batch jobs
  (PRIORITY_BATCH = 6). A request's own `priority` moves its job back within its class
  (rein.core.priorities: interactive 0-5, batch 6 and worse, queued at step min(priority, 9)).
  A worker consumes both with its max_num_seqs slots and the
  interactive queue alone with `interactive_slots` more (rein.worker.bootstep.
  InteractiveConsumer): batch jobs can never hold every slot, so an interactive job is
  always taken, and the engine's priority preemption starts it within a step or two.
* No result backend: results, status and usage go to Postgres.
* Every broker key lives under `settings.redis_key_prefix` (kombu's `global_keyprefix`),
  like every other key rein names, so deployments and test runs can share one Redis.
* A `rediss://` URL (TLS) verifies the server's certificate, as redis-py does for the API's
  and the worker's own clients; a Sentinel URL becomes kombu's `sentinel://` transport
  (rein.store.redis_client.broker_connection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from celery import Celery
from kombu.utils.uuid import uuid

from rein.core.priorities import PRIORITY_BATCH, queue_step
from rein.jobs.affinity import BATCH_SHARDS
from rein.store.messages import JobMessage
from rein.store.redis_client import broker_connection, broker_ssl  # noqa: F401 (broker_ssl: its home before)
from rein.store.redis_keys import RedisKeys

TASK_NAME = "rein.run_job"
PRIORITY_STEPS = list(range(10))
PRIORITY_SEP = ":"


def _tolerate_channels_of_collected_connections() -> None:
    """Let closing a channel whose transport is already gone be a no-op, not a crash.

    When the broker connection drops, Celery 5.7's consumer first `collect()`s the
    connection (which closes its default channel and detaches the transport) and then closes
    it. If the first channel close failed half-way (Redis refusing connections), the second
    one finds the transport's client gone and raises AttributeError inside kombu, which
    Celery treats as unrecoverable: the worker exited instead of reconnecting (seen in
    tests/e2e/test_chaos.py, Redis killed and restarted). There is nothing left to close on
    such a channel, so the AttributeError is ignored as kombu ignores connection errors there.
    Other uses of such a channel (a task's ack after the drop) get a Redis connection error
    instead, which Celery recovers from by reconnecting.
    """
    from kombu.connection import Connection

    if getattr(Connection.maybe_close_channel, "_rein_tolerant", False):
        return
    original = Connection.maybe_close_channel

    def maybe_close_channel(self: Connection, channel: Any) -> None:
        try:
            original(self, channel)
        except AttributeError:
            pass

    maybe_close_channel._rein_tolerant = True  # type: ignore[attr-defined]
    Connection.maybe_close_channel = maybe_close_channel  # type: ignore[method-assign]

    # The same collected connection reached by other paths (a task's ack after the drop): a
    # connection error, which Celery recovers from by reconnecting, instead of AttributeError.
    from kombu.transport import redis as kombu_redis
    from redis.exceptions import ConnectionError as RedisConnectionError

    original_params = kombu_redis.Channel._connparams

    def _connparams(self: Any, asynchronous: bool = False) -> Any:
        if self.connection.client is None:
            raise RedisConnectionError("the broker connection was dropped (collected)")
        return original_params(self, asynchronous=asynchronous)

    kombu_redis.Channel._connparams = _connparams


def make_celery(settings: Any) -> Celery:
    """The Celery app for these settings (broker = settings.redis_url)."""
    _tolerate_channels_of_collected_connections()
    keys = RedisKeys.from_settings(settings)
    broker = broker_connection(settings.redis_url)   # a Sentinel URL: kombu's sentinel:// transport
    app = Celery("rein", broker=broker.url, set_as_current=False)
    app.conf.update(
        broker_connection_retry_on_startup=True,
        broker_use_ssl=broker.use_ssl,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_seconds,
            # A channel's queues in the order its worker prefers (rein.jobs.affinity), not rotated.
            "queue_order_strategy": "rein.jobs.affinity:AffinityCycle",
            "priority_steps": PRIORITY_STEPS,
            "sep": PRIORITY_SEP,
            # Every broker key (queues, unacked, bindings) under the deployment's prefix.
            "global_keyprefix": settings.redis_key_prefix,
        } | broker.transport_options,
        result_backend=None,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_default_priority=PRIORITY_BATCH,
        task_routes=(JobRouter(keys),),
        task_default_queue=f"{keys.prefix}.default",
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.max_num_seqs + queued_slots(settings),
        worker_cancel_long_running_tasks_on_connection_loss=True,
        worker_send_task_events=False,
        worker_enable_remote_control=True,
    )
    app.rein_settings = settings
    return app


class JobRouter:
    """Celery router: the job task goes to its model's queue."""

    def __init__(self, keys: RedisKeys) -> None:
        self.keys = keys

    def __call__(self, name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                 **kw: Any) -> dict[str, str] | None:
        if name != TASK_NAME:
            return None
        message = args[0] if args else (kwargs or {}).get("message")
        if not isinstance(message, dict) or "model" not in message:
            raise ValueError(f"{TASK_NAME} needs a JobMessage dict with a 'model', got {message!r:.200}")
        return {"queue": queue_for(self.keys, message["model"], message.get("priority", PRIORITY_BATCH),
                                   message.get("shard", 0))}


def queue_for(keys: RedisKeys, model: str, priority: int, shard: int = 0) -> str:
    """The queue a job of this priority goes to: its model's interactive queue, or the shard of
    its batch queue (rein.jobs.affinity)."""
    return keys.batch_queue(model, shard % BATCH_SHARDS) if priority >= PRIORITY_BATCH else keys.queue(model)


def worker_queues(settings: Any, model: str) -> list[str]:
    """The queues a worker of `model` consumes with its max_num_seqs slots: the interactive
    queue and every shard of the batch queue."""
    keys = RedisKeys.from_settings(settings)
    return [keys.queue(model), *(keys.batch_queue(model, shard) for shard in range(BATCH_SHARDS))]


def queued_slots(settings: Any) -> int:
    """Jobs a worker takes beyond max_num_seqs from both its queues (see the module docstring)."""
    slots = getattr(settings, "worker_queued_slots", None)
    return slots if slots is not None else max(1, settings.max_num_seqs // 8)


def interactive_slots(settings: Any) -> int:
    """Jobs a worker takes from its interactive queue beyond max_num_seqs (see the module docstring)."""
    slots = getattr(settings, "worker_interactive_slots", None)
    return slots if slots is not None else max(1, settings.max_num_seqs // 4)


def enqueue_job(app: Celery, message: JobMessage) -> None:
    """Put a job on its model's queue at its priority (after its job row exists), with
    Celery's publish retries (several at once: `enqueue_jobs`)."""
    # argsrepr: what Celery shows of the arguments in its logs and events. Its default, a
    # repr of the whole message, would put every prompt token id there (and costs time).
    # declare=[]: the message goes to the anonymous exchange straight into the queue's list,
    # so declaring the queue from here would only re-check kombu's declaration cache per
    # message; the worker declares the queues it consumes.
    app.send_task(TASK_NAME, args=[message.to_dict()], priority=queue_step(message.priority),
                  argsrepr=f"[{message.job_id}]", kwargsrepr="{}", declare=[])


def enqueue_jobs(app: Celery, messages: Sequence[JobMessage]) -> None:
    """Enqueue several jobs in one Redis round trip (kombu's publish batch: one pipeline).

    The messages are the ones `enqueue_job` sends — built by Celery's own protocol code
    (`app.amqp.create_task_message`), routed to the same queue at the same priority — but
    published straight through kombu's producer rather than `send_task`, whose per-message
    bookkeeping (routing, options, signals, the result object) was half the cost of a
    batched send. All or nothing as far as kombu knows: it raises when the pipeline fails,
    and then some messages may have gone out; callers mark those jobs failed so no worker
    runs them.
    """
    if not messages:
        return
    keys = RedisKeys.from_settings(app.rein_settings)
    create = app.amqp.create_task_message
    with app.producer_or_acquire() as producer, producer.batch():
        for message in messages:
            # As send_task fills them in (reply_to, ignore_result None), so a worker cannot
            # tell the two kinds of message apart (a test compares them).
            headers, properties, body, _ = create(uuid(), TASK_NAME, [message.to_dict()], {},
                                                  reply_to=app.thread_oid, ignore_result=None,
                                                  argsrepr=f"[{message.job_id}]", kwargsrepr="{}")
            # exchange "": kombu puts the message straight into the queue's list (what
            # send_task does for a direct queue). No retry: the batch is sent once, at its end.
            producer.publish(body, exchange="",
                             routing_key=queue_for(keys, message.model, message.priority, message.shard),
                             serializer="json",
                             headers=headers, priority=queue_step(message.priority), retry=False, declare=[],
                             **properties)


def priority_lists(settings: Any, model: str, step: int, shard: int | None = None) -> list[str]:
    """The Redis lists where a model's messages of priority `step` wait: its interactive queue's
    list of that step, or that step's list of each batch shard (of `shard` alone when given).

    Kombu keeps one list per queue and priority step, `<queue>` for step 0 and
    `<queue>:<step>` for the others, every key under settings.redis_key_prefix (its
    `global_keyprefix`)."""
    keys = RedisKeys.from_settings(settings)
    shards = range(BATCH_SHARDS) if shard is None else [shard]
    queues = [queue_for(keys, model, step, s) for s in shards] if step >= PRIORITY_BATCH else [keys.queue(model)]
    return [settings.redis_key_prefix + (queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}") for queue in queues]


def queue_keys(settings: Any, model: str) -> list[str]:
    """Every Redis list holding a model's queued messages (each priority step's, `priority_lists`):
    the sum of their LLEN is the queue depth (for backpressure and `rein top`)."""
    return [key for step in PRIORITY_STEPS for key in priority_lists(settings, model, step)]
