"""Admission in one Redis round trip: the model's queue depth (backpressure) and the key's
rate limits (requests per minute and tokens per minute).

Tokens are counted as prompt tokens + max_tokens (what a request may cost, known before it
runs, as OpenAI counts). Counters live in Redis, so every API replica shares them, in
fixed one-minute windows (`RedisKeys.rate_limit(key_id, kind, window)`, expiring after the
window). One Lua script first sums the queue's lengths (refusing with QueueFull at the
limit, before anything is counted), then checks both limits and, only if both admit the
request, counts it in both: atomic, so a burst of concurrent requests admits exactly the
limit and a refused request costs nothing. A rate-limit refusal says when the window ends
(Retry-After). Intake is on every request's path, so this is one round trip, not three.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis import Redis

from rein.core.keys import KeyInfo
from rein.core.redis_keys import RedisKeys
from rein.core.settings import Settings

WINDOW_SECONDS = 60

# KEYS: rpm counter, tpm counter, then the queue's lists. ARGV: rpm, tpm, tokens, ttl, max depth
# (0: no queue check). Returns {admitted, refused kind, used or depth}.
_ADMIT = """
local rpm, tpm, tokens, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local max_depth = tonumber(ARGV[5])
if max_depth > 0 then
  local depth = 0
  for i = 3, #KEYS do depth = depth + redis.call('LLEN', KEYS[i]) end
  if depth >= max_depth then return {0, 'queue', depth} end
end
local requests_used = tonumber(redis.call('GET', KEYS[1]) or '0')
local tokens_used = tonumber(redis.call('GET', KEYS[2]) or '0')
if rpm > 0 and requests_used + 1 > rpm then return {0, 'requests', requests_used} end
if tpm > 0 and tokens_used + tokens > tpm then return {0, 'tokens', tokens_used} end
if rpm > 0 then redis.call('INCR', KEYS[1]); redis.call('EXPIRE', KEYS[1], ttl) end
if tpm > 0 then redis.call('INCRBY', KEYS[2], tokens); redis.call('EXPIRE', KEYS[2], ttl) end
return {1, '', 0}
"""


@dataclass(frozen=True)
class QueueFull(Exception):
    depth: int
    limit: int


@dataclass(frozen=True)
class RateLimitExceeded(Exception):
    kind: str              # "requests" or "tokens"
    limit: int
    used: int
    requested: int
    retry_after: int       # seconds until the window ends

    @property
    def message(self) -> str:
        unit = "requests per min (RPM)" if self.kind == "requests" else "tokens per min (TPM)"
        if self.requested > self.limit:
            return (f"Request too large: it needs {self.requested} tokens (prompt + max_tokens) but this "
                    f"key's limit is {self.limit} {unit}. Reduce the prompt or max_tokens.")
        return (f"Rate limit reached on {unit}: Limit {self.limit}, Used {self.used}, Requested "
                f"{self.requested}. Please try again in {self.retry_after}s.")


class RateLimiter:
    def __init__(self, redis: Redis, keys: RedisKeys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._script = redis.register_script(_ADMIT)

    def limits(self, key: KeyInfo) -> tuple[int | None, int | None]:
        """(rpm, tpm) for this key: its own limits, else the settings' defaults; None: unlimited."""
        return (key.rpm_limit or self.settings.default_rpm, key.tpm_limit or self.settings.default_tpm)

    def check(self, key: KeyInfo, tokens: int, *, queue: Sequence[str] = (), max_depth: int = 0,
              now: float | None = None) -> None:
        """Admit one request of `tokens` tokens, counting it against the key's limits.

        With `queue` (the model's Redis lists) and `max_depth`, first refuse with QueueFull
        when the lists hold `max_depth` messages or more. Raises QueueFull or
        RateLimitExceeded with nothing counted.
        """
        rpm, tpm = self.limits(key)
        if rpm is None and tpm is None and not (queue and max_depth):
            return
        now = time.time() if now is None else now
        window = int(now // WINDOW_SECONDS)
        allowed, kind, used = self._script(
            keys=[self.keys.rate_limit(key.key_id, "rpm", window),
                  self.keys.rate_limit(key.key_id, "tpm", window), *queue],
            args=[rpm or 0, tpm or 0, tokens, WINDOW_SECONDS * 2, max_depth if queue else 0],
        )
        if int(allowed):
            return
        kind = kind.decode() if isinstance(kind, bytes) else str(kind)
        if kind == "queue":
            raise QueueFull(int(used), max_depth)
        retry_after = max(1, math.ceil((window + 1) * WINDOW_SECONDS - now))
        limit = rpm if kind == "requests" else tpm
        raise RateLimitExceeded(kind, int(limit or 0), int(used), 1 if kind == "requests" else tokens,
                                retry_after)
