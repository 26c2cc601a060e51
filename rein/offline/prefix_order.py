"""Batch lines reordered so that those sharing a prompt prefix run one after another.

A batch file's lines are read into a window of at most `window` lines, kept sorted by their
prompt token ids; lines are taken from it in one sweep up the sorted keys (from the last
line's key to the largest, then again from the smallest), so lines with a common prefix
are taken together and the prefix cache computes the prefix once for all of them, whatever
order the file has them in. The window is refilled from the file as lines are taken, so
memory stays bounded however long the file is.

No line waits forever: a line still in the window `2 * window` takes after it entered it is
taken next (and the sweep goes on from its key), so a file whose new lines keep sorting
ahead of an old one cannot hold that one back.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

Item = TypeVar("Item")

ORDERS = ("prefix", "file")   # how `rein run-batch` and the batch manager take a batch's lines
DEFAULT_WINDOW = 2048         # lines read ahead to order (their tokenized prompts are held)


def prefix_ordered(items: Iterable[Item], key: Callable[[Item], Sequence[int]], window: int = DEFAULT_WINDOW
                   ) -> Iterator[Item]:
    """Yield every item of `items` once, reordered within a window of `window` items so that
    items whose keys (token ids) share a prefix come out together. A window of 1 keeps the
    order."""
    window = max(1, window)
    source = iter(items)
    # (key, arrival, item), sorted; arrivals are unique, so items are never compared
    pool: list[tuple[list[int], int, Item]] = []
    entered: dict[int, int] = {}                    # arrival -> takes when it entered the pool
    arrivals: deque[int] = deque()                  # arrival order, taken ones dropped lazily
    cursor: tuple[list[int], int, Item] | None = None
    taken = 0
    next_arrival = 0
    exhausted = False

    while True:
        while not exhausted and len(pool) < window:
            item = next(source, _END)
            if item is _END:
                exhausted = True
                break
            tokens = key(item)
            bisect.insort(pool, (tokens if isinstance(tokens, list) else list(tokens), next_arrival, item))
            entered[next_arrival] = taken
            arrivals.append(next_arrival)
            next_arrival += 1
        if not pool:
            return
        while arrivals[0] not in entered:
            arrivals.popleft()
        oldest = arrivals[0]
        if taken - entered[oldest] >= 2 * window:
            index = next(i for i, entry in enumerate(pool) if entry[1] == oldest)
        else:
            index = 0 if cursor is None else bisect.bisect_left(pool, cursor)
            if index == len(pool):
                index = 0
        cursor = pool.pop(index)
        del entered[cursor[1]]
        taken += 1
        yield cursor[2]


_END = object()
