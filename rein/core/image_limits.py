"""The image settings' own syntax: REIN_LIMIT_MM_PER_PROMPT (vLLM's --limit-mm-per-prompt) and
REIN_IMAGE_FETCH (whether, and from which hosts, the API fetches image URLs). Parsed here, in
core, so the settings object refuses a bad value at start-up and every reader agrees on it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The modalities rein takes; vLLM's flag also names video and audio, which rein refuses by name.
MM_MODALITIES = ("image",)
_HOST = re.compile(r"\.?[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.?")


def parse_mm_limits(text: str) -> dict[str, int]:
    """`image=4` (comma-separated `modality=N`) or JSON `{"image": 4}` -> {"image": 4}
    (ValueError saying what is wrong)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"REIN_LIMIT_MM_PER_PROMPT is not valid JSON ({exc}): write image=4 or "
                             '{"image": 4}') from None
        if not isinstance(raw, dict):
            raise ValueError('REIN_LIMIT_MM_PER_PROMPT must be an object such as {"image": 4}')
        pairs = list(raw.items())
    else:
        pairs = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"REIN_LIMIT_MM_PER_PROMPT: {item!r} is not modality=N (e.g. image=4)")
            pairs.append((name.strip(), value.strip()))
    limits: dict[str, int] = {}
    for name, value in pairs:
        if name not in MM_MODALITIES:
            raise ValueError(f"REIN_LIMIT_MM_PER_PROMPT: rein takes {', '.join(MM_MODALITIES)} inputs, not {name!r}")
        try:
            number = int(value) if not isinstance(value, bool) else -1
        except (TypeError, ValueError):
            number = -1
        if number < 0 or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"REIN_LIMIT_MM_PER_PROMPT: the {name} limit must be a whole number >= 0, got {value!r}")
        limits[name] = number
    return limits


@dataclass(frozen=True)
class FetchPolicy:
    """REIN_IMAGE_FETCH read: off, on (any public host), or an allowlist of hosts."""

    enabled: bool
    hosts: tuple[str, ...] = ()
    """Allowed host names (lower case); one starting with "." allows that domain and its
    subdomains. Empty with `enabled`: any host."""

    def allows(self, host: str) -> bool:
        if not self.enabled:
            return False
        if not self.hosts:
            return True
        host = host.lower().rstrip(".")
        for allowed in self.hosts:
            if allowed.startswith("."):
                if host == allowed[1:] or host.endswith(allowed):
                    return True
            elif host == allowed:
                return True
        return False


def parse_fetch_policy(text: str) -> FetchPolicy:
    """REIN_IMAGE_FETCH: `off` | `on` | `host,.domain,...` (ValueError for anything else)."""
    value = text.strip().lower()
    if value in ("", "off", "false", "0", "no"):
        return FetchPolicy(False)
    if value in ("on", "true", "1", "yes"):
        return FetchPolicy(True)
    hosts = tuple(h.strip().rstrip(".") for h in value.split(",") if h.strip())
    for host in hosts:
        if not _HOST.fullmatch(host):
            raise ValueError(f"REIN_IMAGE_FETCH: {host!r} is not a host name; give off, on, or host names "
                             "separated by commas (.example.com allows a domain and its subdomains)")
    return FetchPolicy(True, hosts)
