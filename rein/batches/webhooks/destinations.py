"""Which URLs rein may POST webhooks to.

A tenant names the URL, and rein's API processes send to it from inside the deployment's network,
so a URL that reaches a private address would let a tenant make rein call its database, its cloud's
metadata service (169.254.169.254) or anything else on that network. So a destination is refused
when any address its host resolves to is private, loopback, link-local, multicast, reserved or
unspecified, IPv4 and IPv6 alike (an IPv4-mapped or 6to4/Teredo-wrapped IPv6 address is judged
by the IPv4 address inside it), unless the operator allows it: REIN_WEBHOOK_ALLOW_PRIVATE=true for
all of them, or REIN_WEBHOOK_ALLOWED_CIDRS for the networks named. Only https:// is accepted unless
REIN_WEBHOOK_ALLOW_HTTP=true.

The check runs when the URL is set and again before every delivery, since what a name resolves
to can change after it was checked (DNS rebinding); the delivery then connects to the very
addresses it checked (`Destination.addresses`), not to a second lookup's answer.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from rein.core.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Sequence[str]]
MAX_URL_LENGTH = 2048


class DestinationRefused(ValueError):
    """A webhook URL rein will not send to; the message says why and what the operator may change."""


@dataclass(frozen=True)
class Destination:
    url: str
    scheme: str
    host: str
    port: int
    addresses: tuple[str, ...]
    """What the host resolved to, every one of them checked."""


def resolve(host: str, port: int) -> list[str]:
    """Every address the host resolves to (getaddrinfo, as a connection would)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (IPv4-mapped, 6to4, Teredo's client), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    return None


def forbidden_reason(address: IPAddress) -> str | None:
    """Why the address is not a public destination (e.g. 'private'), or None when it is."""
    inner = embedded_ipv4(address)
    if inner is not None:
        reason = forbidden_reason(inner)
        return f"{reason} (inside {address})" if reason else None
    for reason, flag in (("unspecified", address.is_unspecified), ("loopback", address.is_loopback),
                         ("link-local", address.is_link_local), ("multicast", address.is_multicast),
                         ("private", address.is_private), ("reserved", address.is_reserved),
                         ("not globally routable", not address.is_global)):
        if flag:
            return reason
    return None


def check_destination(url: str, settings: Settings, resolver: Resolver = resolve) -> Destination:
    """The URL's destination, checked and resolved; DestinationRefused saying why it may not be used."""
    if len(url) > MAX_URL_LENGTH:
        raise DestinationRefused(f"the webhook URL is {len(url)} characters long; the limit is {MAX_URL_LENGTH}")
    if any(ord(char) < 0x21 or ord(char) == 0x7f for char in url):
        raise DestinationRefused(f"the webhook URL {url!r} has a space or a control character; percent-encode it")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise DestinationRefused(f"the webhook URL {url!r} is not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("https", "http"):
        raise DestinationRefused(f"the webhook URL must start with https:// (got {url!r})")
    if scheme == "http" and not settings.webhook_allow_http:
        raise DestinationRefused(f"the webhook URL {url!r} uses plain http; use https:// (an operator may allow "
                                 f"http with REIN_WEBHOOK_ALLOW_HTTP=true)")
    host = parts.hostname
    if not host:
        raise DestinationRefused(f"the webhook URL {url!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise DestinationRefused("the webhook URL must not carry a user name or password; authenticate "
                                 "deliveries by their signature instead")
    if parts.fragment:
        raise DestinationRefused(f"the webhook URL {url!r} has a #fragment, which is never sent; remove it")
    port = port or (443 if scheme == "https" else 80)
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        addresses = [str(literal)]
    else:
        try:
            addresses = list(resolver(host, port))
        except (OSError, UnicodeError, ValueError) as exc:
            raise DestinationRefused(f"the webhook URL's host {host!r} does not resolve ({exc})") from None
        if not addresses:
            raise DestinationRefused(f"the webhook URL's host {host!r} resolves to no address")
    allowed = [ipaddress.ip_network(cidr, strict=False) for cidr in settings.webhook_allowed_cidrs]
    for text in addresses:
        address = ipaddress.ip_address(text.split("%", 1)[0])    # an IPv6 zone (fe80::1%eth0) is no part of it
        reason = forbidden_reason(address)
        if reason is None or settings.webhook_allow_private:
            continue
        if any(_contains(network, address) for network in allowed):
            continue
        where = str(address) if literal is not None else f"{host} resolves to {address}"
        raise DestinationRefused(
            f"the webhook URL {url!r} points into a network rein does not send to: {where} ({reason}). Use a public https URL (an operator may allow such addresses with "
            f"REIN_WEBHOOK_ALLOW_PRIVATE=true or REIN_WEBHOOK_ALLOWED_CIDRS)")
    return Destination(url=url, scheme=scheme, host=host, port=port, addresses=tuple(addresses))


def _contains(network: ipaddress.IPv4Network | ipaddress.IPv6Network, address: IPAddress) -> bool:
    inner = embedded_ipv4(address)
    return address in network or (inner is not None and inner in network)
