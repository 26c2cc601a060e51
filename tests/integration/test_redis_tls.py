"""rein's Redis clients over TLS (`rediss://`), against a redis-server of the test's own started
with --tls-port and a certificate made here with openssl (a CA of the test's, and a server
certificate it signs for 127.0.0.1), with a password (requirepass):

- redis-py, sync and asyncio, as the API, the worker and the batch manager make them
  (`Redis.from_url`, `redis.asyncio.BlockingConnectionPool.from_url`);
- the Celery app's broker connection (rein.jobs.queues.make_celery): a job enqueued by
  `enqueue_job` lands on its model's list, and kombu takes it off again;
- all of them verify the server's certificate: with no `ssl_ca_certs` the URL's server is
  refused (a certificate nothing trusts), and with the wrong password too.

Needs redis-server built with TLS (Debian's is) and openssl; skipped without them (failed under
CI). The whole API and worker over TLS: run the integration suite with REIN_TEST_REDIS_URL set
to a rediss:// URL (docs/deployment.md, "Redis over TLS").
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from support import free_port, wait_for

from rein.core.priorities import PRIORITY_INTERACTIVE
from rein.core.settings import Settings
from rein.jobs.queues import enqueue_job, make_celery, queue_keys
from rein.store.messages import JobMessage

PASSWORD = "tls-test-password"


def _need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{tool} is not installed")
        pytest.skip(f"{tool} is not installed")
    return path


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run([_need("openssl"), *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def make_certificates(folder: Path) -> None:
    """ca.pem (a CA of this test's) and server.pem/server.key, which it signs, for 127.0.0.1."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=rein test CA",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
             "-out", "server.csr", cwd=folder)
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "1", "-extfile", "san.ext", "-out", "server.pem", cwd=folder)


class TLSRedis:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, query: str = "") -> str:
        return f"rediss://:{quote(PASSWORD)}@127.0.0.1:{self.port}/0" + (f"?{query}" if query else "")

    @property
    def verified_url(self) -> str:
        return self.url(f"ssl_cert_reqs=required&ssl_ca_certs={self.folder / 'ca.pem'}")

    def start(self) -> None:
        log = open(self.folder / "redis.log", "ab")  # noqa: SIM115 (the server keeps it)
        self.proc = subprocess.Popen(
            [_need("redis-server"), "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", str(self.folder / "server.pem"), "--tls-key-file", str(self.folder / "server.key"),
             "--tls-ca-cert-file", str(self.folder / "ca.pem"), "--tls-auth-clients", "no",
             "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(self.folder)],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(self._answers, 20, f"redis-server with TLS on port {self.port}", interval=0.1)
        except BaseException:
            self.stop()
            text = (self.folder / "redis.log").read_text(errors="replace")
            if "tls" in text.lower() and os.environ.get("CI") != "true":
                pytest.skip(f"this redis-server has no TLS: {text.strip().splitlines()[-1:]}")
            raise

    def _answers(self) -> bool:
        import redis

        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited {self.proc.returncode}")
        try:
            return bool(redis.Redis.from_url(self.verified_url, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSRedis]:
    folder = tmp_path_factory.mktemp("redis-tls")
    make_certificates(folder)
    redis = TLSRedis(folder)
    redis.start()
    yield redis
    redis.stop()


def test_the_sync_client_connects_and_verifies(server: TLSRedis) -> None:
    from redis import Redis
    from redis.exceptions import AuthenticationError, ConnectionError

    client = Redis.from_url(server.verified_url)
    try:
        assert client.ping()
        assert client.connection_pool.connection_class.__name__ == "SSLConnection"
        client.set("rein-tls", "ok")
        assert client.get("rein-tls") == b"ok"
    finally:
        client.close()
    # No CA named: redis-py requires a certificate the system trusts, which the test's is not.
    with pytest.raises(ConnectionError, match="certificate verify failed"):
        Redis.from_url(server.url(), socket_connect_timeout=3).ping()
    with pytest.raises(AuthenticationError):
        Redis.from_url(server.verified_url.replace(quote(PASSWORD), "wrong")).ping()


def test_the_asyncio_pool_connects(server: TLSRedis) -> None:
    """As the API makes it for its event streams (rein.api.app)."""
    from redis.asyncio import BlockingConnectionPool, Redis

    async def ping() -> bool:
        client = Redis(connection_pool=BlockingConnectionPool.from_url(server.verified_url, max_connections=4,
                                                                       timeout=5))
        try:
            return await client.ping()
        finally:
            await client.aclose()

    assert asyncio.run(ping())


def test_the_broker_enqueues_and_consumes_over_tls(server: TLSRedis) -> None:
    from redis import Redis

    settings = Settings(redis_url=server.verified_url, redis_key_prefix="rein_tls:")
    app = make_celery(settings)
    message = JobMessage(job_id="job-tls", model="m", endpoint="/v1/completions", prompt_token_ids=[1, 2],
                         sampling={}, priority=PRIORITY_INTERACTIVE)
    enqueue_job(app, message)
    key = queue_keys(settings, "m")[PRIORITY_INTERACTIVE]
    client = Redis.from_url(server.verified_url)
    try:
        assert client.llen(key) == 1
    finally:
        client.close()
    queue = key.removeprefix(settings.redis_key_prefix)
    with app.connection_for_read() as connection:
        simple = connection.SimpleQueue(queue)
        try:
            received = simple.get(timeout=10)
            assert received.headers["task"] == "rein.run_job"
            assert received.payload[0][0]["job_id"] == "job-tls"
            received.ack()
        finally:
            simple.close()


def test_the_broker_refuses_an_unverified_server(server: TLSRedis) -> None:
    """A rediss:// URL with no ssl_* parameter: kombu alone would connect with CERT_NONE;
    make_celery requires the certificate, which nothing here trusts."""
    app = make_celery(Settings(redis_url=server.url(), redis_key_prefix="rein_tls:"))
    with app.connection_for_write() as connection, pytest.raises(Exception, match="certificate verify failed"):
        connection.ensure_connection(max_retries=1, timeout=5)
        connection.default_channel.client.ping()
