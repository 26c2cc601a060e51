"""rein.worker.channel_delivery on real Redis: two channels of one kombu connection consume the
same queue, as a worker's task consumer and its InteractiveConsumer do, and each holds at most
its own prefetch limit; everything else stays on the queue's list."""

from __future__ import annotations

import secrets

import pytest
import redis
from kombu import Connection, Consumer, Producer, Queue

from rein.worker.channel_delivery import deliver_to_the_popping_channel

pytestmark = pytest.mark.usefixtures("patched")


@pytest.fixture(scope="module")
def patched() -> None:
    deliver_to_the_popping_channel()


@pytest.fixture
def broker(redis_url: str):
    """A kombu connection under a key prefix of its own, the queue names, and a Redis client."""
    prefix = f"rein_test_delivery_{secrets.token_hex(4)}:"
    client = redis.Redis.from_url(redis_url)
    options = {"global_keyprefix": prefix, "queue_order_strategy": "priority",
               "priority_steps": list(range(10)), "sep": ":"}
    with Connection(redis_url, transport_options=options) as conn:
        yield conn, prefix, client
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def publish(conn: Connection, queue: str, n: int) -> None:
    producer = Producer(conn.default_channel)
    for i in range(n):
        producer.publish({"i": i}, routing_key=queue, exchange="", declare=[Queue(queue)], serializer="json")


def drain(conn: Connection, seconds: float = 1.0) -> None:
    try:
        while True:
            conn.drain_events(timeout=seconds)
    except TimeoutError:
        pass


def consume(channel, queues: list[str], prefetch: int, got: list) -> Consumer:
    consumer = Consumer(channel, [Queue(q) for q in queues], accept=["json"],
                        callbacks=[lambda body, message: got.append(message)])
    consumer.qos(prefetch_count=prefetch)
    consumer.consume()
    return consumer


def test_two_channels_on_one_queue_each_hold_only_their_prefetch(broker) -> None:
    conn, prefix, client = broker
    publish(conn, "inter", 30)
    main_channel, other_channel = conn.default_channel, conn.channel()
    main_got, other_got = [], []
    consume(main_channel, ["inter", "batch"], 4, main_got)
    consume(other_channel, ["inter"], 2, other_got)       # registered last, as InteractiveConsumer
    drain(conn)
    assert (len(main_got), len(other_got)) == (4, 2)
    assert all(message.channel is main_channel for message in main_got)
    assert all(message.channel is other_channel for message in other_got)
    assert client.llen(f"{prefix}inter") == 24 and client.hlen(f"{prefix}unacked") == 6
    # An ack gives its own channel the credit back, and nothing more is taken.
    main_got[0].ack()
    drain(conn)
    assert (len(main_got), len(other_got)) == (5, 2)
    assert client.llen(f"{prefix}inter") == 23


def test_a_channel_that_stops_consuming_leaves_the_queue_to_the_other(broker) -> None:
    conn, prefix, client = broker
    main_channel, other_channel = conn.default_channel, conn.channel()
    main_got, other_got = [], []
    consume(main_channel, ["inter"], 3, main_got)
    other = consume(other_channel, ["inter"], 1, other_got)
    other.cancel()
    publish(conn, "inter", 5)
    drain(conn)
    assert (len(main_got), len(other_got)) == (3, 0)
    assert client.llen(f"{prefix}inter") == 2


def test_a_message_popped_after_its_channel_stopped_consuming_goes_back(broker) -> None:
    conn, prefix, client = broker
    got = []
    consumer = consume(conn.default_channel, ["inter"], 1, got)
    drain(conn, 0.2)                  # a BRPOP is sent and waits on the empty queue
    consumer.cancel()                 # ... and the channel stops consuming meanwhile
    publish(conn, "inter", 1)         # the waiting BRPOP pops it
    assert client.llen(f"{prefix}inter") == 0
    drain(conn, 0.5)
    assert got == []
    assert client.llen(f"{prefix}inter") == 1 and client.hlen(f"{prefix}unacked") == 0
