"""Image URLs fetched without server-side request forgery (rein.jobs.image_fetch): refused
addresses (loopback, link-local metadata, private, IPv4-mapped IPv6), a name resolving to a
private address, a redirect to one, the pinned connect address, and the size, time and redirect
limits against a local HTTP server (the private escape on only where the test needs to reach it).
"""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpcore
import pytest
from PIL import Image

from rein.core.image_limits import parse_fetch_policy
from rein.core.images import ImageError
from rein.jobs import image_fetch
from rein.jobs.image_fetch import FetchRefused, address_refusal, fetch_image

ON = parse_fetch_policy("on")


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()


class Server:
    """A local HTTP server whose paths behave as the tests need; it counts the requests it got."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.redirect_to = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests.append(self.path)
                if self.path == "/image.png":
                    body = png()
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                elif self.path == "/big-declared":
                    self.send_response(200)
                    self.send_header("Content-Length", "5000")
                    self.end_headers()
                    self.wfile.write(b"x" * 5000)
                elif self.path == "/big-chunked":     # no length: the download itself must stop
                    self.send_response(200)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for _ in range(100):
                            self.wfile.write(b"400\r\n" + b"x" * 1024 + b"\r\n")
                        self.wfile.write(b"0\r\n\r\n")
                    except OSError:
                        pass
                elif self.path == "/slow":
                    time.sleep(3)
                    self.send_response(200)
                    self.end_headers()
                elif self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", outer.redirect_to)
                    self.end_headers()
                elif self.path == "/loop":
                    self.send_response(301)
                    self.send_header("Location", "/loop")
                    self.end_headers()
                else:
                    self.send_response(404)
                    self.end_headers()

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.port = self.http.server_address[1]
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server() -> Iterator[Server]:
    server = Server()
    yield server
    server.close()


def fetch(url: str, allow_private: bool = False, max_bytes: int = 1 << 20, timeout: float = 10.0,
          max_redirects: int = 3, policy=ON) -> bytes:
    return fetch_image(url, policy, max_bytes=max_bytes, timeout=timeout, max_redirects=max_redirects,
                       allow_private=allow_private)


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.1.2.3", "::1", "169.254.169.254", "10.0.0.1", "172.16.0.1", "172.31.255.255",
    "192.168.1.1", "100.64.0.1", "0.0.0.0", "::", "fc00::1", "fd12:3456::1", "fe80::1", "224.0.0.1",
    "239.255.255.250", "ff02::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
    "64:ff9b::7f00:1", "2002:7f00:1::1", "240.0.0.1", "192.0.2.1", "198.18.0.1",
])
def test_refused_addresses(address):
    assert address_refusal(address) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                     "93.184.215.14"])
def test_public_addresses(address):
    assert address_refusal(address) is None


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "169.254.169.254", "10.1.2.3",
                                  "192.168.0.10", "[::ffff:127.0.0.1]", "[fc00::1]", "0.0.0.0"])
def test_private_hosts_are_never_contacted(server, host):
    with pytest.raises(FetchRefused, match="public host"):
        fetch(server.url("/image.png", host))
    assert server.requests == []


def test_a_name_resolving_to_a_private_address_is_refused(server, monkeypatch):
    real = socket.getaddrinfo

    def resolver(host, port, *args, **kwargs):   # DNS answering a private address for a public-looking name
        if host == "images.example.com":
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with pytest.raises(FetchRefused, match="127.0.0.1 is a loopback address"):
        fetch(f"http://images.example.com:{server.port}/image.png")
    assert server.requests == []


def test_the_connection_goes_to_the_checked_address(monkeypatch):
    # The name resolves once, here; the socket connects to that address (no second lookup a
    # rebinding DNS could answer differently), while TLS and Host keep the name.
    calls: list[str] = []
    answers = iter(["93.184.215.14", "127.0.0.1"])   # a rebinding DNS: public first, private after

    def resolver(host, port, *args, **kwargs):
        calls.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    connected: list[str] = []

    def connect(self, host, port, timeout=None, local_address=None, socket_options=None):
        connected.append(host)
        raise httpcore.ConnectError("test: not connecting")

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", connect)
    with pytest.raises(ImageError, match="could not be fetched"):
        fetch("http://images.example.com/a.png")
    assert calls == ["images.example.com"] and connected == ["93.184.215.14"]


def test_a_redirect_to_a_private_address_is_refused(server, monkeypatch):
    # The test server itself is on loopback: let exactly its address through, nothing else.
    real = image_fetch.address_refusal
    monkeypatch.setattr(image_fetch, "address_refusal", lambda a: None if a == "127.0.0.1" else real(a))
    assert fetch(server.url("/image.png")) == png()
    for target in ("http://169.254.169.254/latest/meta-data/", f"http://[::1]:{server.port}/image.png",
                   f"http://10.0.0.1:{server.port}/image.png"):
        server.redirect_to = target
        with pytest.raises(FetchRefused, match="public host"):
            fetch(server.url("/redirect"))
    server.redirect_to = "file:///etc/passwd"
    with pytest.raises(FetchRefused, match="http and https only"):
        fetch(server.url("/redirect"))
    assert "/image.png" not in server.requests[1:]


def test_redirects_are_followed_up_to_the_limit(server):
    server.redirect_to = "/image.png"
    assert fetch(server.url("/redirect"), allow_private=True) == png()
    with pytest.raises(FetchRefused, match="more than 3 times"):
        fetch(server.url("/loop"), allow_private=True)
    assert server.requests.count("/loop") == 4


def test_a_fetch_that_takes_too_long(server):
    with pytest.raises(ImageError, match=r"longer than 0.3 s \(REIN_IMAGE_FETCH_TIMEOUT_SECONDS\)"):
        fetch(server.url("/slow"), allow_private=True, timeout=0.3)


def test_a_body_too_large(server):
    with pytest.raises(ImageError, match=r"5,000 bytes; the limit is 1,000 bytes \(REIN_MAX_IMAGE_BYTES\)"):
        fetch(server.url("/big-declared"), allow_private=True, max_bytes=1000)
    with pytest.raises(ImageError, match="download was stopped"):
        fetch(server.url("/big-chunked"), allow_private=True, max_bytes=10_000)


def test_status_and_policy_refusals(server):
    with pytest.raises(ImageError, match="HTTP 404"):
        fetch(server.url("/missing"), allow_private=True)
    with pytest.raises(FetchRefused, match="REIN_IMAGE_FETCH=off"):
        fetch(server.url("/image.png"), allow_private=True, policy=parse_fetch_policy("off"))
    with pytest.raises(FetchRefused, match="only from images.example.com"):
        fetch(server.url("/image.png"), allow_private=True, policy=parse_fetch_policy("images.example.com"))
    with pytest.raises(FetchRefused, match="credentials"):
        fetch(f"http://user:pw@127.0.0.1:{server.port}/image.png", allow_private=True)
    assert server.requests == ["/missing"]


@pytest.mark.parametrize("url, words", [
    ("http://[::1/a", "malformed"), ("http://example.invalid:99999/a", "malformed"),
    ("ftp://example.com/a.png", "http and https only"), ("http:///a.png", "no host"),
])
def test_malformed_urls(url, words):
    with pytest.raises(FetchRefused, match=words):
        fetch(url)


def test_an_international_host_is_resolved_as_its_idna_name(monkeypatch):
    asked: list[str] = []

    def resolver(host, port, *args, **kwargs):
        asked.append(host)
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with pytest.raises(ImageError, match="does not resolve"):
        fetch("http://ëxample.com/ä.png")
    assert asked == ["xn--xample-ova.com"]
    assert parse_fetch_policy("xn--xample-ova.com").allows("xn--xample-ova.com")


def test_a_resolver_that_never_answers_costs_the_timeout(monkeypatch):
    release = threading.Event()

    def hanging(host, port, *args, **kwargs):
        release.wait(30)
        raise socket.gaierror(-3, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    try:
        with pytest.raises(ImageError, match="took longer than 0.2 s"):
            fetch("http://slow-dns.example/a.png", timeout=0.2)
    finally:
        release.set()
