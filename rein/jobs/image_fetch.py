"""Fetching an image from an http(s) URL for a request, without becoming a way into the network
the API runs in (server-side request forgery). docs/images.md states the rules for operators.

* Off unless the operator turns it on (REIN_IMAGE_FETCH: `on`, or an allowlist of hosts).
* The host name is resolved here, every address it resolves to is checked, and the connection
  goes to a checked address (`PinnedBackend`): the name is never resolved a second time by
  someone else, so a DNS answer that changes between check and connect (rebinding) cannot send
  the request elsewhere. TLS still verifies the certificate against the URL's host name (SNI
  and the Host header are the name's; only the TCP connect uses the address).
* Refused addresses: anything not globally routable (private 10/8, 172.16/12, 192.168/16,
  loopback 127/8 and ::1, link-local 169.254/16 with the cloud metadata service at
  169.254.169.254, and fe80::/10, unique-local fc00::/7, carrier-grade NAT 100.64/10,
  unspecified 0.0.0.0 and ::, reserved and documentation ranges), multicast, and IPv6 addresses
  that embed a refused IPv4 address (IPv4-mapped ::ffff:a.b.c.d, NAT64 64:ff9b::/96, 6to4
  2002::/16). REIN_IMAGE_FETCH_ALLOW_PRIVATE lifts this (tests; an image server on the
  deployment's own network), never the allowlist.
* Redirects are followed by hand, at most REIN_IMAGE_FETCH_MAX_REDIRECTS, each target checked
  as the first URL was (scheme, allowlist, addresses).
* The body is streamed and the download stops at REIN_MAX_IMAGE_BYTES (a Content-Length over
  it is refused before reading); the whole fetch has REIN_IMAGE_FETCH_TIMEOUT_SECONDS, checked
  after every chunk with each wait bounded by what was left when the request went out (so a
  server dripping bytes is stopped within twice the limit at worst).
* The name lookup has the fetch's timeout too (a resolver that never answers costs the request
  its timeout, not an API thread); international host names are looked up, and matched against
  the allowlist, as their IDNA (xn--) names.
* No proxy from the environment, no cookies, no credentials sent.

Every refusal is an ImageError (a 400 naming the image part) that says which rule and setting.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urljoin

import httpcore
import httpx

from rein.core.image_limits import FetchPolicy
from rein.core.images import ImageError

USER_AGENT = b"rein-image-fetch/1"
_REDIRECTS = (301, 302, 303, 307, 308)
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SIXTOFOUR = ipaddress.ip_network("2002::/16")


class FetchRefused(ImageError):
    """A URL rein will not fetch (its address, scheme or host); nothing was sent to it."""


def address_refusal(address: str) -> str | None:
    """Why rein refuses to connect to `address` (an IP literal), or None when it is public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])   # a scope id (fe80::1%eth0) is link-local anyway
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is None and ip in _SIXTOFOUR:
            embedded = ip.sixtofour
        if embedded is not None:
            inner = address_refusal(str(embedded))
            return f"it embeds the IPv4 address {embedded}, and {inner}" if inner else None
    if ip.is_multicast:
        return f"{ip} is a multicast address"
    if ip.is_loopback:
        return f"{ip} is a loopback address"
    if ip.is_link_local:
        return f"{ip} is a link-local address (the cloud metadata service lives there)"
    if ip.is_unspecified:
        return f"{ip} is the unspecified address"
    if not ip.is_global:
        return f"{ip} is a private or reserved address"
    return None


# Name lookups run here, so that a resolver that never answers costs the fetch its timeout, not a
# thread of the API for ever (getaddrinfo itself takes no timeout).
_RESOLVER = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rein-image-dns")


def resolve(host: str, port: int, timeout: float | None = None) -> list[str]:
    """Every address `host` resolves to (IP literals stand for themselves); httpcore.ConnectTimeout
    past `timeout`."""
    lookup = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout)
    except FutureTimeout:
        raise httpcore.ConnectTimeout(f"resolving {host} took longer than {timeout} s") from None
    except (socket.gaierror, UnicodeError) as exc:
        raise ImageError(f"the image URL's host {host!r} does not resolve ({exc})") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


class PinnedBackend(httpcore.SyncBackend):
    """httpcore's network backend, connecting only to an address it checked itself (see the
    module docstring); the host name stays the URL's for TLS and the Host header."""

    def __init__(self, allow_private: bool = False) -> None:
        self.allow_private = allow_private

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Any = None) -> httpcore.NetworkStream:
        addresses = resolve(host, port, timeout)
        refusals = [] if self.allow_private else [address_refusal(a) for a in addresses]
        allowed = [a for a, why in zip(addresses, refusals or [None] * len(addresses), strict=True) if why is None]
        if not allowed:
            raise FetchRefused(f"rein does not fetch images from {host}: {refusals[0]}; image URLs must name a "
                               "public host (REIN_IMAGE_FETCH_ALLOW_PRIVATE lifts this for trusted networks)")
        return super().connect_tcp(allowed[0], port, timeout=timeout, local_address=local_address,
                                   socket_options=socket_options)


def _check_url(url: str, policy: FetchPolicy) -> tuple[str, str]:
    """(the URL as sent: IDNA host, percent-encoded path; its host) of a URL rein may fetch
    (FetchRefused otherwise)."""
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise FetchRefused(f"the image URL is malformed ({exc})") from None
    scheme = parsed.scheme.lower()
    if scheme not in ("http", "https"):
        raise FetchRefused(f"rein fetches images over http and https only, not {scheme or 'a relative URL'}")
    host = parsed.raw_host.decode("ascii").lower()   # IDNA: what the allowlist and DNS see
    if not host:
        raise FetchRefused("the image URL names no host")
    if parsed.userinfo:
        raise FetchRefused("image URLs may not carry credentials (user:password@)")
    if not policy.enabled:
        raise FetchRefused("this deployment does not fetch image URLs (REIN_IMAGE_FETCH=off): send the image "
                           "inline as a data URL (data:image/png;base64,...) or upload it (purpose vision) and "
                           "send its file_id")
    if not policy.allows(host):
        raise FetchRefused(f"this deployment fetches images only from {', '.join(policy.hosts)} (REIN_IMAGE_FETCH), "
                           f"not from {host}")
    return str(parsed.copy_with(fragment=None)), host


def fetch_image(url: str, policy: FetchPolicy, *, max_bytes: int, timeout: float, max_redirects: int,
                allow_private: bool = False) -> bytes:
    """The body of `url` (an image, unchecked: the caller opens it), under the rules above."""
    deadline = time.monotonic() + timeout
    pool = httpcore.ConnectionPool(network_backend=PinnedBackend(allow_private), retries=0, max_connections=2)
    try:
        for _hop in range(max_redirects + 1):
            url, host = _check_url(url, policy)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _timed_out(timeout)
            # (httpcore adds the Host header from the URL: the name, never the pinned address)
            headers = [(b"User-Agent", USER_AGENT), (b"Accept", b"image/*"), (b"Accept-Encoding", b"identity")]
            extensions = {"timeout": {"connect": remaining, "read": remaining, "write": remaining, "pool": remaining}}
            try:
                with pool.stream("GET", url, headers=headers, extensions=extensions) as response:
                    if response.status in _REDIRECTS:
                        location = _header(response, b"location")
                        if location is None:
                            raise ImageError(f"the image URL answered HTTP {response.status} without a Location")
                        url = urljoin(url, location)
                        continue
                    if response.status != 200:
                        raise ImageError(f"the image URL answered HTTP {response.status}, not 200 with an image")
                    return _read_body(response, max_bytes, deadline, timeout)
            except httpcore.TimeoutException:
                raise _timed_out(timeout) from None
            except ImageError:
                raise
            except ValueError as exc:   # a URL httpx parsed but httpcore will not send (a port out of range)
                raise FetchRefused(f"the image URL is malformed ({exc})") from None
            except (httpcore.NetworkError, httpcore.ProtocolError, httpcore.UnsupportedProtocol,
                    httpcore.LocalProtocolError) as exc:
                raise ImageError(f"the image could not be fetched from {host}: {type(exc).__name__} "
                                 f"{str(exc)[:200]}") from None
        raise FetchRefused(f"the image URL redirected more than {max_redirects} times "
                           "(REIN_IMAGE_FETCH_MAX_REDIRECTS)")
    finally:
        pool.close()


def _read_body(response: httpcore.Response, max_bytes: int, deadline: float, timeout: float) -> bytes:
    declared = _header(response, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ImageError(f"the image at the URL is {int(declared):,} bytes; the limit is {max_bytes:,} bytes "
                         "(REIN_MAX_IMAGE_BYTES): link a smaller image")
    body = bytearray()
    for chunk in response.iter_stream():
        body += chunk
        if len(body) > max_bytes:
            raise ImageError(f"the image at the URL is larger than the limit of {max_bytes:,} bytes "
                             "(REIN_MAX_IMAGE_BYTES); the download was stopped there: link a smaller image")
        if time.monotonic() > deadline:
            raise _timed_out(timeout)
    return bytes(body)


def _header(response: httpcore.Response, name: bytes) -> str | None:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _timed_out(timeout: float) -> ImageError:
    return ImageError(f"fetching the image took longer than {timeout:g} s (REIN_IMAGE_FETCH_TIMEOUT_SECONDS): "
                      "link a faster or smaller image, or send it inline as a data URL")
