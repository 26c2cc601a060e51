"""The priorities of rein's work, shared by the queue (Celery priorities on Redis: a lower
value is served first, in kombu's ten priority steps) and the engine's scheduler (a lower
value ranks first; interactive requests, below PRIORITY_BATCH, get the interactive step
budget).

A job's priority is one integer: its class's base plus the request's own `priority` field
(vLLM's meaning: lower runs first, default 0), kept inside the class's band:

* interactive class (the synchronous endpoints and POST /v1/jobs): PRIORITY_INTERACTIVE +
  priority, held to [PRIORITY_INTERACTIVE, PRIORITY_BATCH - 1] (0-5);
* batch class (batch lines, and `service_tier: "flex"` requests): PRIORITY_BATCH + priority,
  held to [PRIORITY_BATCH, PRIORITY_BATCH + MAX_PRIORITY_OFFSET].

A negative `priority` counts as 0: a class's default is the best a request may ask for, so a
tenant orders its own requests but cannot rank them above every other tenant's defaults, and a
batch line never reaches the interactive class. The queue has ten steps, so `queue_step` holds
a batch job's priority to the last one (9); the engine orders by the whole value.
"""

PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 6
# kombu's priority steps on Redis (rein.jobs.queues.PRIORITY_STEPS): 0 to 9.
LAST_QUEUE_STEP = 9
# The most a batch-class request's `priority` moves it back (larger values count as this: at
# the scheduler's aging of 128 steps a level, it already ranks some 128,000 steps behind).
MAX_PRIORITY_OFFSET = 1000


def job_priority(request_priority: int = 0, *, batch: bool = False) -> int:
    """The priority a job runs at: its class's base plus the request's `priority`, kept in the
    class's band (the module docstring)."""
    offset = max(request_priority, 0)
    if batch:
        return PRIORITY_BATCH + min(offset, MAX_PRIORITY_OFFSET)
    return PRIORITY_INTERACTIVE + min(offset, PRIORITY_BATCH - 1 - PRIORITY_INTERACTIVE)


def queue_step(priority: int) -> int:
    """The kombu priority step a job of this priority waits at (0 to LAST_QUEUE_STEP)."""
    return min(max(priority, 0), LAST_QUEUE_STEP)


def is_interactive(priority: int) -> bool:
    return priority < PRIORITY_BATCH
