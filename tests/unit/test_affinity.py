"""Prefix affinity's rules (rein.jobs.affinity): which lines share a batch queue shard, which
worker owns which shard and the order each takes them in, and that kombu's Redis channel lists
its queues in the order a worker prefers when it sends BRPOP."""

from __future__ import annotations

import random

import pytest

from rein.jobs import affinity
from rein.jobs.affinity import (
    BATCH_SHARDS,
    PrefixGroups,
    shard_of_prefix,
    shard_order,
    shard_owners,
)


def documents_with_questions(documents: int, questions: int, system: int = 0, doc_tokens: int = 1000,
                             seed: int = 0) -> list[tuple[int, list[int]]]:
    """(document, prompt) pairs: an optional system prompt every line shares, a document of
    random tokens, then a short question of its own."""
    rng = random.Random(seed)
    shared = [rng.randrange(50_000) for _ in range(system)]
    lines = []
    for d in range(documents):
        document = [rng.randrange(50_000) for _ in range(doc_tokens)]
        for _ in range(questions):
            lines.append((d, shared + document + [rng.randrange(50_000) for _ in range(rng.randrange(5, 30))]))
    rng.shuffle(lines)
    return lines


def grouped(lines: list[tuple[int, list[int]]]) -> dict[int, set[int]]:
    groups = PrefixGroups()
    for _, prompt in lines:
        groups.add(prompt)
    shards: dict[int, set[int]] = {}
    for document, prompt in lines:
        shards.setdefault(document, set()).add(groups.shard(prompt))
    return shards


@pytest.mark.parametrize("system", [0, 40, 700])
def test_a_documents_questions_share_a_shard_past_a_shared_system_prompt(system: int) -> None:
    shards = grouped(documents_with_questions(40, 8, system=system))
    assert all(len(s) == 1 for s in shards.values())
    # 40 documents spread over the shards: every shard gets some (the chance any is empty: ~0.5%
    # for random hashes; these token ids are fixed, so the test is deterministic).
    assert len({next(iter(s)) for s in shards.values()}) == BATCH_SHARDS


def test_a_document_shorter_than_its_question_tail_still_groups() -> None:
    """Questions of varied lengths after a 300-token document: the shortest prefix few enough
    lines share is inside the document, whatever the question's length."""
    shards = grouped(documents_with_questions(30, 6, doc_tokens=300, seed=3))
    assert all(len(s) == 1 for s in shards.values())


def test_prompts_sharing_nothing_spread_evenly() -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(1, 200))] for _ in range(4000)]
    groups = PrefixGroups()
    for prompt in prompts:
        groups.add(prompt)
    counts = [0] * BATCH_SHARDS
    for prompt in prompts:
        counts[groups.shard(prompt)] += 1
    assert min(counts) > 0.8 * len(prompts) / BATCH_SHARDS


def test_one_prefix_every_line_shares_is_not_one_shard() -> None:
    """1,000 lines of one 2,000-token document and a question each: no group is small enough,
    so the lines spread by their whole prompts (each worker then computes the document once)."""
    rng = random.Random(2)
    document = [rng.randrange(50_000) for _ in range(2000)]
    prompts = [document + [rng.randrange(50_000) for _ in range(10)] for _ in range(1000)]
    groups = PrefixGroups()
    for prompt in prompts:
        groups.add(prompt)
    assert len({groups.shard(prompt) for prompt in prompts}) == BATCH_SHARDS


def test_a_single_job_hashes_its_first_tokens() -> None:
    head = list(range(128))
    assert shard_of_prefix(head + [1, 2, 3]) == shard_of_prefix(head + [9])
    assert 0 <= shard_of_prefix([]) < BATCH_SHARDS


@pytest.mark.parametrize("workers", [1, 2, 3, 4, 8, 11])
def test_shards_are_split_evenly_and_each_worker_steals_last_owned_first(workers: int) -> None:
    names = [f"w{i}@host" for i in range(workers)]
    owners = shard_owners(names)
    owned = [sum(1 for owner in owners.values() if owner == name) for name in names]
    assert sum(owned) == BATCH_SHARDS and max(owned) - min(owned) <= 1
    for name in names:
        order = shard_order(name, names)
        assert sorted(order) == list(range(BATCH_SHARDS))
        mine = [shard for shard in order if owners[shard] == name]
        assert order[:len(mine)] == mine                     # its own first
        assert order[len(mine):] == sorted(order[len(mine):], reverse=True)


def test_every_worker_computes_the_same_split() -> None:
    names = ["b@h", "a@h", "c@h"]
    assert shard_owners(names) == shard_owners(list(reversed(names)))
    # A worker not yet in the registry counts itself in.
    assert shard_order("d@h", names) == shard_order("d@h", [*names, "d@h"])


def test_kombu_lists_the_preferred_queues_first_in_brpop() -> None:
    """The Redis channel's BRPOP names, for each priority step, the queues in the preferred
    order (kombu's `queue_order_strategy`: rein.jobs.affinity.AffinityCycle)."""
    from kombu.transport.redis import Channel

    cycle = affinity.AffinityCycle()
    cycle.update(["q.batch.2", "q", "q.batch", "q.batch.1"])
    previous = dict(affinity._preference)
    try:
        affinity.prefer_queues(["q", "q.batch.1", "q.batch.2"])
        assert cycle.consume(4) == ["q", "q.batch.1", "q.batch.2", "q.batch"]
        cycle.rotate("q")
        assert cycle.consume(4) == ["q", "q.batch.1", "q.batch.2", "q.batch"]

        sent = []

        class Connection:
            def send_command(self, *args):
                sent.append(args)

        channel = Channel.__new__(Channel)     # only what _brpop_start reads
        channel.__dict__.update(_queue_cycle=cycle, _active_queues=["q.batch.2", "q", "q.batch", "q.batch.1"],
                                priority_steps=[0, 6], sep=":", brpop_timeout=1, global_keyprefix="",
                                active_fanout_queues=set(), client=type("C", (), {"connection": Connection()})())
        channel._brpop_start()
        assert sent[0][1:-1] == ("q", "q.batch.1", "q.batch.2", "q.batch",
                                 "q:6", "q.batch.1:6", "q.batch.2:6", "q.batch:6")
    finally:
        affinity._preference = previous


def test_the_live_workers_of_a_model_are_those_beating_now() -> None:
    import json

    from rein.worker.heartbeat import HEARTBEAT_SECONDS, live_workers

    now = 1000.0
    registry = {
        b"a@h": json.dumps({"model": "m", "state": "up", "time": now - 1}),
        b"b@h": json.dumps({"model": "m", "state": "down", "time": now - 2}),      # restarting its engine
        b"c@h": json.dumps({"model": "m", "state": "stopped", "time": now - 1}),
        b"d@h": json.dumps({"model": "m", "state": "up", "time": now - 3 * HEARTBEAT_SECONDS - 1}),   # lost
        b"e@h": json.dumps({"model": "other", "state": "up", "time": now}),
        b"f@h": b"not json",
    }
    assert sorted(live_workers(registry, "m", now)) == ["a@h", "b@h"]
