"""rein.store.channel_listener against a Redis of the test's own, killed and started again: the
listener says when it is subscribed, subscribes again when Redis is back (calling
`on_subscribed` each time), and a message whose handler fails does not end it."""

from __future__ import annotations

from own_servers import RedisServer
from redis import Redis
from support import wait_for

from rein.store.channel_listener import ChannelListener

CHANNEL = "rein-test:channel-listener"


def test_listener_subscribes_again_after_redis_comes_back(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    client = Redis(port=server.port, socket_timeout=2, socket_connect_timeout=1)
    heard: list[bytes] = []
    subscriptions: list[int] = []

    def on_message(data: bytes) -> None:
        if data == b"bad":
            raise ValueError("a handler that fails")
        heard.append(data)

    listener = ChannelListener(client, CHANNEL, on_message, name="test-listener",
                               on_subscribed=lambda: subscriptions.append(len(heard)), wait_seconds=0.1).start()
    try:
        wait_for(listener.subscribed.is_set, 10, "the first subscription")
        client.publish(CHANNEL, b"bad")
        client.publish(CHANNEL, b"one")
        wait_for(lambda: heard == [b"one"], 10, "the message after the failing one")

        server.kill()
        wait_for(lambda: not listener.subscribed.is_set(), 10, "the listener noticing Redis gone")
        server.start()                                   # same port, empty
        wait_for(listener.subscribed.is_set, 20, "the subscription again")
        assert subscriptions == [0, 1]                   # on_subscribed at each confirmation
        client.publish(CHANNEL, b"two")
        wait_for(lambda: heard == [b"one", b"two"], 10, "a message after the restart")
    finally:
        listener.stop()
        server.kill()
    assert not listener._thread.is_alive() and not listener.subscribed.is_set()
