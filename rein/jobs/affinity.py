"""Prefix affinity across workers: batch work whose prompts share a prefix meets on one worker.

A model's batch queue is BATCH_SHARDS queues (`RedisKeys.batch_queue(model, shard)`; shard 0
is the queue's old name, so a deployment with affinity off runs exactly as before). A job's
shard is a hash of a prefix of its prompt, so jobs sharing that prefix wait on the same shard.
Every worker consumes every shard, in an order of its own (`shard_order`): the shards it owns
first, then the others', last-owned first. Ownership is a split of the shards between the
workers of the model that are beating (rein.worker.heartbeat): shard s belongs to the worker
whose place among them, by name, is s modulo their number. So each worker computes the prefixes
of its own shards, keeping them in its prefix cache, and a worker whose shards run dry takes
work from the shard its owner would reach last (work stealing): nobody idles while work waits.
Interactive jobs have a queue of their own, taken before any batch shard (lower priority
step), and are never sharded.

Which prefix: a batch line's is found across its whole batch (`PrefixGroups`): the shortest
prefix, among lengths doubling from MIN_PREFIX_TOKENS, that few enough lines share that they
do not crowd one shard (at most a shard's even part of the batch, and never fewer than
MIN_GROUP lines). So a system prompt every line shares is passed over, and the document after
it, asked 8 questions, is the group; a prompt nobody shares is spread by its own hash. A job
sent on its own at batch priority hashes its first FEED_KEY_TOKENS (what the batch order
looks at: a system prompt's worth).

The kombu side: `AffinityCycle` is the Redis transport's queue order (its
`queue_order_strategy`): kombu lists a channel's queues, for each priority step, in the order
the cycle gives when it starts a BRPOP, and Redis pops the first non-empty list. The order is a
process-wide preference a worker sets (`prefer_queues`); the API never consumes.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

BATCH_SHARDS = 8
MIN_PREFIX_TOKENS = 32
MAX_PREFIX_TOKENS = 32768
MIN_GROUP = 8
FEED_KEY_TOKENS = 128     # prompt tokens the batch prefix order looks at (rein.batches.batch_jobs.feed_key)


def prefix_lengths(prompt_length: int) -> list[int]:
    """The prefix lengths a prompt of this many tokens is grouped by: 32, 64, 128, ... shorter
    than the prompt (a prefix as long as the prompt is the prompt itself, no group)."""
    lengths, length = [], MIN_PREFIX_TOKENS
    while length < prompt_length and length <= MAX_PREFIX_TOKENS:
        lengths.append(length)
        length *= 2
    return lengths


def _prefix_hashes(prompt_token_ids: Sequence[int], lengths: Iterable[int]) -> list[int]:
    raw = array("I", prompt_token_ids).tobytes()
    return [_hash(raw[:4 * length]) for length in lengths]


def _hash(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def shard_of_prefix(prompt_token_ids: Sequence[int], tokens: int = FEED_KEY_TOKENS) -> int:
    """The shard of a job sent on its own: a hash of its first `tokens` token ids."""
    return _hash(array("I", prompt_token_ids[:tokens]).tobytes()) % BATCH_SHARDS


class PrefixGroups:
    """The shards of one batch's lines, in two passes: `add` every line's prompt (while the
    file is checked), then `shard` of each (when the lines are stored).

    Only the prefixes' 8-byte hashes are kept, in one array (a 50,000-line batch of 1,000-token
    prompts: 250,000 hashes, 2 MB), counted by sorting them once."""

    def __init__(self) -> None:
        self._hashes = array("Q")
        self._lines = 0
        self._sorted: array | None = None

    def add(self, prompt_token_ids: Sequence[int]) -> None:
        self._hashes.extend(_prefix_hashes(prompt_token_ids, prefix_lengths(len(prompt_token_ids))))
        self._lines += 1

    def shard(self, prompt_token_ids: Sequence[int]) -> int:
        """The shard of a line `add`ed before: the hash of its shortest prefix that at most
        `group_limit` lines share; a line with none (every prefix shared by too many, or a
        prompt shorter than MIN_PREFIX_TOKENS): the hash of its whole prompt."""
        if self._sorted is None:
            self._sorted = array("Q", sorted(self._hashes))
            self._hashes = array("Q")
        limit = self.group_limit
        lengths = prefix_lengths(len(prompt_token_ids))
        for value in _prefix_hashes(prompt_token_ids, lengths):
            if self._count(value) <= limit:
                return value % BATCH_SHARDS
        return shard_of_prefix(prompt_token_ids, len(prompt_token_ids))

    @property
    def group_limit(self) -> int:
        """The most lines a group may hold: a shard's even part of the batch, at least MIN_GROUP."""
        return max(MIN_GROUP, math.ceil(self._lines / BATCH_SHARDS))

    def _count(self, value: int) -> int:
        assert self._sorted is not None
        return bisect_right(self._sorted, value) - bisect_left(self._sorted, value)


def shard_owners(workers: Sequence[str]) -> dict[int, str]:
    """Shard -> the worker owning it, of these live workers (a worker's name): shard s goes to
    the worker whose place in name order is s modulo their number."""
    ordered = sorted(set(workers))
    if not ordered:
        return {}
    return {shard: ordered[shard % len(ordered)] for shard in range(BATCH_SHARDS)}


def shard_order(worker: str, workers: Sequence[str]) -> list[int]:
    """The order `worker` takes the batch shards in, given the live workers of its model (itself
    among them or not): its own shards, then the others' in reverse, so that when its own run
    dry it takes first what their owners would reach last."""
    owners = shard_owners([*workers, worker])
    own = [shard for shard in range(BATCH_SHARDS) if owners[shard] == worker]
    others = [shard for shard in reversed(range(BATCH_SHARDS)) if owners[shard] != worker]
    return own + others


# Queue name -> place in this process's BRPOP order (see the module docstring); replaced whole.
_preference: dict[str, int] = {}


def prefer_queues(queues: Sequence[str]) -> None:
    """Make this process's broker channels list these queues first, in this order (the others
    after them, as they were)."""
    global _preference
    _preference = {queue: place for place, queue in enumerate(queues)}


class AffinityCycle:
    """kombu's queue cycle (`queue_order_strategy`) ordering a channel's queues by the
    preference `prefer_queues` set, without rotating (as kombu's `priority` strategy)."""

    def __init__(self, it: list[str] | None = None) -> None:
        self.items = it if it is not None else []

    def update(self, it: Iterable[str]) -> None:
        self.items[:] = it

    def consume(self, n: int) -> list[str]:
        preference = _preference
        last = len(preference)
        return sorted(self.items, key=lambda queue: preference.get(queue, last))[:n]

    def rotate(self, last_used: str) -> None:
        """Unused: the order is the preference's."""
