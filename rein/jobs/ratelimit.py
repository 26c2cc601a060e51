"""Admission in one Redis round trip: the model's queue depth (backpressure) and the key's
rate limits (requests per minute and tokens per minute), for one request or many at once.

Tokens are charged as what a request may cost, known before it runs, as OpenAI counts:
prompt tokens + max_tokens when the request gives max_tokens, else prompt tokens +
REIN_TPM_COMPLETION_ESTIMATE (capped by what the context leaves; rein.api.intake). The
charge is settled against the job's real usage when it ends (`settle_tokens`, called by the
worker when it records the job, and by the API for a job cancelled while queued).

TPM is a token bucket kept as one number per key, GCRA-style: the time its bucket is full
again (`tat`, "theoretical arrival time"). It holds REIN_TPM_BURST_SECONDS of the limit
(TPM x burst / 60 tokens) and refills at TPM / 60 tokens a second. A request is admitted when
the bucket holds its charge (a charge larger than the whole bucket, up to the TPM, waits for
a full bucket); the charge is taken, and settlement takes the overrun or gives back the
unused part to the same bucket. An overrun may push the bucket below empty: that debt is
repaid at the refill rate before anything else is admitted, so an underestimated request
slows the key's later ones instead of vanishing with a window, and tokens consumed stay near
the TPM over any stretch of time (within the burst and what jobs still running have not yet
reported). A refund never fills the bucket past full. The small burst is what holds the limit
within every minute too: a bucket holding a whole minute would allow twice the TPM in a
minute (a full bucket, then a minute of refill), as fixed windows did across their boundary;
OpenAI likewise enforces its per-minute limits over shorter periods.

RPM stays a fixed one-minute window (`RedisKeys.rate_limit(key_id, "rpm", window)`): a
request's cost (1) is known at intake, so there is no overrun to carry, and its counters
count down exactly; its boundary can let 2 x RPM through in a minute, bounded and harmless
next to tokens.

Counters live in Redis, so every API replica shares them. One Lua script takes the requests
in order: for each it first sums its model's queue lengths (refusing with QueueFull at the
limit, before anything is counted), checks its tenant's share of that queue (TenantQueueFull:
a tenant may hold at most REIN_TENANT_QUEUE_SHARE of REIN_MAX_QUEUE_DEPTH, so one key cannot
fill the queue for everyone; the tenant's queued count comes from Postgres, see
rein.api.intake), then checks both limits and, only if both admit the request, counts it in
both and notes the job's charge (`tpm_charge_key`) for its settlement. Atomic, so a burst of
concurrent requests admits exactly the limit and a refused request costs nothing. A refusal
says when to retry (Retry-After: the RPM window's end, or when the bucket holds the request).
Each verdict carries the key's counters after it (RateLimitState: OpenAI's x-ratelimit-*
headers). Intake is on every request's path, so this is one round trip, however many requests
the API admits together (see rein.api.intake: concurrent requests are committed as a group).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from redis import Redis
from redis.commands.core import Script

from rein.core.settings import Settings
from rein.store.keys import KeyInfo
from rein.store.redis_keys import RedisKeys

WINDOW_SECONDS = 60
MICROS = 1_000_000

# KEYS: for request i (1-based) its rpm counter (3i-2), tpm bucket (3i-1) and charge record
# (3i); after the 3n, the queues' lists, `steps` per queue. ARGV: ttl, max depth (0: no queue
# check), n, steps, charge ttl, now (microseconds), then per request: rpm, tpm, tokens, queue
# number (0: none), tenant slot (0: no tenant share check), the tenant's cap, record the
# charge (0/1), the bucket's microseconds per token and its burst in microseconds; then each
# tenant slot's queued count. A bucket key holds its tat (microseconds). Returns for each
# request {admitted, refused kind, used or depth, requests used, tokens remaining, microseconds
# until the bucket is full, microseconds until the request would fit (refused for tokens)},
# flattened. A queue's depth (and a tenant's count) includes the requests admitted earlier in
# the same call: they are about to be enqueued.
_ADMIT = """
local ttl, max_depth, n, steps, charge_ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local depths, tenants, out = {}, {}, {}
local per = 9
local tail = 6 + n * per
for i = 1, n do
  local a = 6 + (i - 1) * per
  local rpm, tpm, tokens, q = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4])
  local ts, tcap, charge = tonumber(ARGV[a + 5]), tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  local interval, burst = tonumber(ARGV[a + 8]), tonumber(ARGV[a + 9])
  local rkey, tkey, ckey = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local kind, used, wait = '', 0, 0
  if q > 0 and max_depth > 0 then
    if depths[q] == nil then
      local depth, first = 0, 3 * n + (q - 1) * steps
      for j = first + 1, first + steps do depth = depth + redis.call('LLEN', KEYS[j]) end
      depths[q] = depth
    end
    if depths[q] >= max_depth then kind, used = 'queue', depths[q] end
  end
  if kind == '' and ts > 0 then
    if tenants[ts] == nil then tenants[ts] = tonumber(ARGV[tail + ts]) end
    if tenants[ts] >= tcap then kind, used = 'tenant_queue', tenants[ts] end
  end
  local requests_used, tat = 0, now
  if rpm > 0 then requests_used = tonumber(redis.call('GET', rkey) or '0') end
  if tpm > 0 then tat = math.max(tonumber(redis.call('GET', tkey) or '0'), now) end
  if kind == '' then
    if rpm > 0 and requests_used + 1 > rpm then kind, used = 'requests', requests_used
    elseif tpm > 0 then
      -- the bucket holds (burst - (tat - now)) / interval tokens; a charge larger than the
      -- whole bucket needs a full one
      local need = math.min(tokens * interval, burst)
      local short = need - (burst - (tat - now))
      if tokens > tpm or short > 0 then
        kind, used, wait = 'tokens', math.ceil((tat - now) / interval), math.max(short, 0)
      end
    end
  end
  if kind == '' then
    if rpm > 0 then requests_used = redis.call('INCR', rkey); redis.call('EXPIRE', rkey, ttl) end
    if tpm > 0 then
      tat = tat + tokens * interval
      redis.call('SET', tkey, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
      if charge > 0 then
        redis.call('SET', ckey, tokens .. '|' .. tkey .. '|' .. interval .. '|' .. burst, 'EX', charge_ttl)
      end
    end
    if q > 0 and depths[q] ~= nil then depths[q] = depths[q] + 1 end
    if ts > 0 then tenants[ts] = tenants[ts] + 1 end
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
  out[#out + 1] = kind
  out[#out + 1] = used
  out[#out + 1] = requests_used
  local remaining = 0
  if tpm > 0 then remaining = math.max(math.floor((burst - (tat - now)) / interval + 1e-6), 0) end
  out[#out + 1] = remaining
  out[#out + 1] = math.ceil(tat - now)
  out[#out + 1] = math.ceil(wait)
end
return out
"""

# KEYS: the job's charge record. ARGV: the tokens the job really used, now (microseconds).
# Reads and deletes the record (so a job is settled at most once), then moves the bucket it
# names by the difference: an overrun takes tokens (into debt if need be), an unused part is
# given back, never past a full bucket. Returns the adjustment made in tokens (negative:
# given back), or false without a record.
_SETTLE = """
local record = redis.call('GET', KEYS[1])
if not record then return false end
redis.call('DEL', KEYS[1])
local fields = {}
for field in string.gmatch(record, '[^|]+') do fields[#fields + 1] = field end
local charged, bucket, interval = tonumber(fields[1]), fields[2], tonumber(fields[3])
if interval == nil then return 0 end   -- a fixed window's charge (before the bucket): its window ends soon
local now = tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', bucket) or '0'), now)
local moved = math.max(tat + (tonumber(ARGV[1]) - charged) * interval, now)
if moved > now then
  redis.call('SET', bucket, string.format('%.0f', moved), 'PX', math.ceil((moved - now) / 1000) + 1000)
else
  redis.call('DEL', bucket)
end
local tokens = (moved - tat) / interval
if tokens < 0 then return -math.floor(-tokens + 0.5) end
return math.floor(tokens + 0.5)
"""
_SETTLE_BYTES = _SETTLE.encode()


@dataclass(frozen=True)
class Admission:
    """One request to admit: whose, how many tokens, and its model's queue lists (or none)."""

    key: KeyInfo
    tokens: int
    queue: tuple[str, ...] = ()
    tenant_queued: int | None = None
    """The key's tenant's jobs queued for this model now (its queue share is checked when
    set): requests of one tenant and one queue share the count."""
    job_id: str | None = None
    """The job this request becomes: its token charge is recorded for `settle_tokens`."""


@dataclass(frozen=True)
class RateLimitState:
    """A key's counters after a verdict, as OpenAI's x-ratelimit-* headers report them."""

    rpm: int | None               # None: no request limit (its headers are left out)
    tpm: int | None               # None: no token limit
    requests_used: int            # in the current RPM window
    tokens_remaining: int         # what the TPM bucket holds now (0 in debt)
    reset_seconds: float          # until the RPM window ends (its counter starts again then)
    tokens_reset_seconds: float = 0.0
    """Until the TPM bucket is full again (its debt repaid and refilled)."""

    def headers(self) -> dict[str, str]:
        headers: dict[str, str] = {}
        if self.rpm is not None:
            headers |= {"x-ratelimit-limit-requests": str(self.rpm),
                        "x-ratelimit-remaining-requests": str(max(self.rpm - self.requests_used, 0)),
                        "x-ratelimit-reset-requests": reset_duration(self.reset_seconds)}
        if self.tpm is not None:
            headers |= {"x-ratelimit-limit-tokens": str(self.tpm),
                        "x-ratelimit-remaining-tokens": str(max(self.tokens_remaining, 0)),
                        "x-ratelimit-reset-tokens": reset_duration(self.tokens_reset_seconds)}
        return headers


def reset_duration(seconds: float) -> str:
    """OpenAI's reset format (Go durations): '250ms', '12s', '1m0s'."""
    if seconds < 1:
        return f"{max(int(seconds * 1000), 1)}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


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
    used: int              # requests in the window, or tokens taken from the bucket and not yet refilled
    requested: int
    retry_after: int       # seconds until the request fits: the RPM window's end, or the bucket's refill
    state: RateLimitState | None = None

    @property
    def too_large(self) -> bool:
        """The request alone is over the limit: it can never be admitted (no retry helps)."""
        return self.requested > self.limit

    @property
    def message(self) -> str:
        unit = "requests per min (RPM)" if self.kind == "requests" else "tokens per min (TPM)"
        if self.too_large:
            return (f"Request too large: it needs {self.requested} tokens (prompt + max_tokens, or prompt + "
                    f"the completion estimate REIN_TPM_COMPLETION_ESTIMATE without max_tokens) but this "
                    f"key's limit is {self.limit} {unit}. Reduce the prompt or max_tokens.")
        if self.kind == "tokens":
            return (f"Rate limit reached on {unit}: Limit {self.limit}, Used {self.used} (tokens charged "
                    f"and not yet refilled, overruns of earlier requests included; the limit refills at "
                    f"{self.limit / 60:g} tokens/s), Requested {self.requested}. Please try again in "
                    f"{self.retry_after}s, or lower max_tokens.")
        return (f"Rate limit reached on {unit}: Limit {self.limit}, Used {self.used}, Requested "
                f"{self.requested}. Please try again in {self.retry_after}s.")

    def headers(self) -> dict[str, str]:
        """Retry-After, x-should-retry (false when the request can never fit) and the counters."""
        return {"Retry-After": str(self.retry_after), "x-should-retry": "false" if self.too_large else "true",
                **(self.state.headers() if self.state is not None else {})}


Refusal = QueueFull | TenantQueueFull | RateLimitExceeded


@dataclass(frozen=True)
class Verdict:
    """One request's admission: refused (and why) or not, and the key's counters after it
    (None when the key has no limits)."""

    refusal: Refusal | None
    state: RateLimitState | None


def tpm_charge_key(keys: RedisKeys, job_id: str) -> str:
    """The record of a job's token charge: '<tokens>|<bucket>|<us per token>|<burst us>'."""
    return f"{keys.prefix}:job:{job_id}:tpm"


def tpm_bucket_key(keys: RedisKeys, key_id: str) -> str:
    """A key's TPM bucket: its tat, in microseconds (absent: full)."""
    return f"{keys.prefix}:ratelimit:{key_id}:tpm-bucket"


def bucket_shape(tpm: int, burst_seconds: float) -> tuple[float, float]:
    """(microseconds per token, the burst in microseconds) of a TPM bucket."""
    return WINDOW_SECONDS * MICROS / tpm, burst_seconds * MICROS


def charge_ttl(settings: Settings) -> int:
    """How long a charge waits for its settlement: the longest job, and a window of queueing
    beyond it (the cancel flag's lifetime, rein.worker.cancel). A later settlement finds no
    record and changes nothing."""
    return settings.job_timeout_seconds + settings.stream_ttl_seconds


def settle_tokens(redis: Redis, keys: RedisKeys, job_id: str, key_id: str, actual_tokens: int,
                  now: float | None = None) -> int | None:
    """Settle a job's token charge against what it really used (prompt + completion tokens;
    0 for a job that never ran): the tokens taken from (positive) or given back to (negative)
    the key's TPM bucket, or None when the job has no charge to settle (a key without a TPM
    limit, a batch line, settled already). An overrun is taken even past empty (debt); a
    refund stops at a full bucket. Idempotent: the record is deleted as it is read. `key_id`
    is the job's key (the record names its bucket)."""
    now = time.time() if now is None else now
    # EVALSHA (the script sent once per connection pool's server), one round trip per job.
    result = Script(redis, _SETTLE_BYTES)(keys=[tpm_charge_key(keys, job_id)],
                                          args=[max(int(actual_tokens), 0), int(now * MICROS)])
    return None if result is None else int(result)


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
              now: float | None = None) -> RateLimitState | None:
        """Admit one request of `tokens` tokens, counting it against the key's limits; the
        key's counters after it (None: the key has no limits).

        With `queue` (the model's Redis lists) and `max_depth`, first refuse with QueueFull
        when the lists hold `max_depth` messages or more. Raises QueueFull or
        RateLimitExceeded with nothing counted.
        """
        verdict = self.admit([Admission(key, tokens, tuple(queue))], max_depth=max_depth, now=now)[0]
        if verdict.refusal is not None:
            raise verdict.refusal
        return verdict.state

    def admit_many(self, requests: Sequence[Admission], *, max_depth: int = 0,
                   now: float | None = None) -> list[Refusal | None]:
        """Admit requests in order, in one round trip: for each, None (admitted and counted)
        or the QueueFull / TenantQueueFull / RateLimitExceeded that refused it (nothing counted
        for it)."""
        return [verdict.refusal for verdict in self.admit(requests, max_depth=max_depth, now=now)]

    def admit(self, requests: Sequence[Admission], *, max_depth: int = 0,
              now: float | None = None) -> list[Verdict]:
        """`admit_many`, with each request's counters after it (for the x-ratelimit-* headers)."""
        now = time.time() if now is None else now
        window = int(now // WINDOW_SECONDS)
        counters: list[str] = []
        args: list[int | str] = []
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
            charge = request.job_id is not None and tpm is not None
            interval, burst = bucket_shape(tpm, self.settings.tpm_burst_seconds) if tpm else (0.0, 0.0)
            counters += (self.keys.rate_limit(request.key.key_id, "rpm", window),
                         tpm_bucket_key(self.keys, request.key.key_id),
                         tpm_charge_key(self.keys, request.job_id) if charge else counters_placeholder(self.keys))
            args += (rpm or 0, tpm or 0, request.tokens, number, slot, tenant_cap or 0, int(charge),
                     repr(interval), repr(burst))
        if not queues and not tenant_slots and all(rpm is None and tpm is None for rpm, tpm in limits):
            return [Verdict(None, None)] * len(requests)      # nothing to check: no round trip
        steps = len(next(iter(queues))) if queues else 0
        if any(len(queue) != steps for queue in queues):
            raise ValueError("every queue passed to one admit_many call must have as many lists")
        lists = [name for queue in queues for name in queue]
        flat = self._script(keys=[*counters, *lists],
                            args=[WINDOW_SECONDS * 2, max_depth if queues else 0, len(requests), steps,
                                  charge_ttl(self.settings), int(now * MICROS), *args, *tenant_counts])
        reset = (window + 1) * WINDOW_SECONDS - now
        verdicts: list[Verdict] = []
        for i, request in enumerate(requests):
            allowed, kind, used, requests_used, tokens_remaining, full_in, fits_in = flat[7 * i: 7 * i + 7]
            rpm, tpm = limits[i]
            state = None if rpm is None and tpm is None else RateLimitState(
                rpm, tpm, int(requests_used), int(tokens_remaining), reset, int(full_in) / MICROS)
            if int(allowed):
                verdicts.append(Verdict(None, state))
                continue
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            if kind == "queue":
                verdicts.append(Verdict(QueueFull(int(used), max_depth), state))
                continue
            if kind == "tenant_queue":
                verdicts.append(Verdict(TenantQueueFull(int(used), tenant_cap or 0), state))
                continue
            limit = rpm if kind == "requests" else tpm
            wait = reset if kind == "requests" else int(fits_in) / MICROS
            verdicts.append(Verdict(RateLimitExceeded(kind, int(limit or 0), int(used),
                                                      1 if kind == "requests" else request.tokens,
                                                      max(1, math.ceil(wait - 1e-6)), state), state))
        return verdicts


def counters_placeholder(keys: RedisKeys) -> str:
    """The key passed for a request without a charge record (the script never touches it)."""
    return f"{keys.prefix}:job:-:tpm"
