"""Admission in one Redis round trip: the model's queue depth (backpressure) and the key's
rate limits (requests per minute and tokens per minute), for one request or many at once.

Tokens are counted as prompt tokens + max_tokens (what a request may cost, known before it
runs, as OpenAI counts). Counters live in Redis, so every API replica shares them, in
fixed one-minute windows (`RedisKeys.rate_limit(key_id, kind, window)`, expiring after the
window). One Lua script takes the requests in order: for each it first sums its model's
queue lengths (refusing with QueueFull at the limit, before anything is counted), checks
its tenant's share of that queue (TenantQueueFull: a tenant may hold at most
REIN_TENANT_QUEUE_SHARE of REIN_MAX_QUEUE_DEPTH, so one key cannot fill the queue for
everyone; the tenant's queued count comes from Postgres, see rein.api.intake), then
checks both limits and, only if both admit the request, counts it in both. Atomic, so a
burst of concurrent requests admits exactly the limit and a refused request costs nothing.
A rate-limit refusal says when the window ends (Retry-After). Intake is on every request's
path, so this is one round trip, however many requests the API admits together (see
rein.api.intake: concurrent requests are committed as a group).
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

# KEYS: for request i (1-based) its rpm counter (2i-1) and tpm counter (2i); after the 2n
# counters, the queues' lists, `steps` per queue. ARGV: ttl, max depth (0: no queue check),
# n, steps, then per request: rpm, tpm, tokens, queue number (0: none), tenant slot (0: no
# tenant share check), the tenant's cap; then each tenant slot's queued count. Returns for
# each request {admitted, refused kind, used or depth}, flattened. A queue's depth (and a
# tenant's count) includes the requests admitted earlier in the same call: they are about
# to be enqueued.
_ADMIT = """
local ttl, max_depth, n, steps = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local depths, tenants, out = {}, {}, {}
local tail = 4 + n * 6
for i = 1, n do
  local a = 4 + (i - 1) * 6
  local rpm, tpm, tokens, q = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local ts, tcap = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6])
  local rkey, tkey = KEYS[2 * i - 1], KEYS[2 * i]
  local kind, used = '', 0
  if q > 0 and max_depth > 0 then
    if depths[q] == nil then
      local depth, first = 0, 2 * n + (q - 1) * steps
      for j = first + 1, first + steps do depth = depth + redis.call('LLEN', KEYS[j]) end
      depths[q] = depth
    end
    if depths[q] >= max_depth then kind, used = 'queue', depths[q] end
  end
  if kind == '' and ts > 0 then
    if tenants[ts] == nil then tenants[ts] = tonumber(ARGV[tail + ts]) end
    if tenants[ts] >= tcap then kind, used = 'tenant_queue', tenants[ts] end
  end
  if kind == '' then
    local requests_used = tonumber(redis.call('GET', rkey) or '0')
    local tokens_used = tonumber(redis.call('GET', tkey) or '0')
    if rpm > 0 and requests_used + 1 > rpm then kind, used = 'requests', requests_used
    elseif tpm > 0 and tokens_used + tokens > tpm then kind, used = 'tokens', tokens_used end
  end
  if kind == '' then
    if rpm > 0 then redis.call('INCR', rkey); redis.call('EXPIRE', rkey, ttl) end
    if tpm > 0 then redis.call('INCRBY', tkey, tokens); redis.call('EXPIRE', tkey, ttl) end
    if q > 0 and depths[q] ~= nil then depths[q] = depths[q] + 1 end
    if ts > 0 then tenants[ts] = tenants[ts] + 1 end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  out[#out + 1] = kind
  out[#out + 1] = used
end
return out
"""


@dataclass(frozen=True)
class Admission:
    """One request to admit: whose, how many tokens, and its model's queue lists (or none)."""

    key: KeyInfo
    tokens: int
    queue: tuple[str, ...] = ()
    tenant_queued: int | None = None
    """The key's tenant's jobs queued for this model now (its queue share is checked when
    set): requests of one tenant and one queue share the count."""


@dataclass(frozen=True)
class QueueFull(Exception):
    depth: int
    limit: int


@dataclass(frozen=True)
class TenantQueueFull(Exception):
    """The tenant holds its whole share of the model's queue (Settings.tenant_queue_share)."""

    queued: int
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

    def tenant_queue_cap(self, max_depth: int) -> int | None:
        """The most jobs one tenant may hold queued for a model; None: no per-tenant limit."""
        share = self.settings.tenant_queue_share
        if not max_depth or share >= 1:
            return None
        return max(1, int(max_depth * share))

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
        refusal = self.admit_many([Admission(key, tokens, tuple(queue))], max_depth=max_depth, now=now)[0]
        if refusal is not None:
            raise refusal

    def admit_many(self, requests: Sequence[Admission], *, max_depth: int = 0,
                   now: float | None = None) -> list[QueueFull | TenantQueueFull | RateLimitExceeded | None]:
        """Admit requests in order, in one round trip: for each, None (admitted and counted)
        or the QueueFull / TenantQueueFull / RateLimitExceeded that refused it (nothing counted
        for it)."""
        now = time.time() if now is None else now
        window = int(now // WINDOW_SECONDS)
        counters: list[str] = []
        args: list[int] = []
        queues: dict[tuple[str, ...], int] = {}
        tenant_slots: dict[tuple[str, tuple[str, ...]], int] = {}
        tenant_counts: list[int] = []
        tenant_cap = self.tenant_queue_cap(max_depth)
        limits = []
        for request in requests:
            rpm, tpm = self.limits(request.key)
            limits.append((rpm, tpm))
            number = slot = 0
            if request.queue and max_depth:
                number = queues.setdefault(request.queue, len(queues) + 1)
            if request.tenant_queued is not None and tenant_cap:
                slot = tenant_slots.setdefault((request.key.tenant, request.queue), len(tenant_slots) + 1)
                if slot > len(tenant_counts):
                    tenant_counts.append(request.tenant_queued)
            counters += (self.keys.rate_limit(request.key.key_id, "rpm", window),
                         self.keys.rate_limit(request.key.key_id, "tpm", window))
            args += (rpm or 0, tpm or 0, request.tokens, number, slot, tenant_cap or 0)
        if not queues and not tenant_slots and all(rpm is None and tpm is None for rpm, tpm in limits):
            return [None] * len(requests)      # nothing to check: no round trip
        steps = len(next(iter(queues))) if queues else 0
        if any(len(queue) != steps for queue in queues):
            raise ValueError("every queue passed to one admit_many call must have as many lists")
        lists = [name for queue in queues for name in queue]
        flat = self._script(keys=[*counters, *lists],
                            args=[WINDOW_SECONDS * 2, max_depth if queues else 0, len(requests), steps, *args,
                                  *tenant_counts])
        verdicts: list[QueueFull | TenantQueueFull | RateLimitExceeded | None] = []
        for i, request in enumerate(requests):
            allowed, kind, used = flat[3 * i: 3 * i + 3]
            if int(allowed):
                verdicts.append(None)
                continue
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind == "queue":
                verdicts.append(QueueFull(int(used), max_depth))
                continue
            if kind == "tenant_queue":
                verdicts.append(TenantQueueFull(int(used), tenant_cap or 0))
                continue
            rpm, tpm = limits[i]
            retry_after = max(1, math.ceil((window + 1) * WINDOW_SECONDS - now))
            limit = rpm if kind == "requests" else tpm
            verdicts.append(RateLimitExceeded(kind, int(limit or 0), int(used),
                                              1 if kind == "requests" else request.tokens, retry_after))
        return verdicts
