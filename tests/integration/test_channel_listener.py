"""rein.core.channel_listener against a Redis of the test's own, killed and started again: the
listener says when it is subscribed, subscribes again when Redis is back (calling
`on_subscribed` each time), and a message whose handler fails does not end it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from redis import Redis
from support import free_port, wait_for

from rein.core.channel_listener import ChannelListener

CHANNEL = "rein-test:channel-listener"


class OwnRedis:
    """A redis-server on a free port, nothing on disk; never the machine's own."""

    def __init__(self, directory) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            message = "redis-server is not installed: this test starts its own"
            if os.environ.get("CI") == "true":
                pytest.fail(message)
            pytest.skip(message)
        self.directory = directory
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.directory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(self._answers, 20, f"redis-server on port {self.port}")

    def _answers(self) -> bool:
        try:
            return bool(Redis(port=self.port, socket_connect_timeout=1).ping())
        except Exception:   # noqa: BLE001 - not up yet
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


def test_listener_subscribes_again_after_redis_comes_back(tmp_path):
    server = OwnRedis(tmp_path)
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
