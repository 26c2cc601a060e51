"""The two priorities of rein's work, shared by the queue (Celery priorities on Redis: a lower
value is served first, in kombu's priority steps) and the engine's scheduler (interactive
requests, below PRIORITY_BATCH, get the interactive step budget)."""

PRIORITY_INTERACTIVE = 0
PRIORITY_BATCH = 6
