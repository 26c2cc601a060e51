"""The worker's Celery app: rein.jobs.queues' app with the job task registered on it.

The API sends jobs by task name and needs no task code; a worker process builds its app here,
so that importing rein.worker.tasks (which registers the shared task) is the worker's doing,
and with the fix that makes each consumer channel's prefetch limit hold
(rein.worker.channel_delivery): what a consumer needs, a sender does not.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

import rein.worker.tasks  # noqa: F401  (registers the job task: a shared task, on every app)
from rein.jobs.queues import make_celery
from rein.worker.channel_delivery import deliver_to_the_popping_channel


def make_worker_celery(settings: Any) -> Celery:
    """The Celery app for these settings, with the job task (rein.worker.tasks) on it."""
    deliver_to_the_popping_channel()
    return make_celery(settings)
