"""The worker's Celery app: rein.jobs.queues' app with the job task registered on it.

The API sends jobs by task name and needs no task code; a worker process builds its app here,
so that importing rein.worker.tasks (which registers the shared task) is the worker's doing.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

import rein.worker.tasks  # noqa: F401  (registers the job task: a shared task, on every app)
from rein.jobs.queues import make_celery


def make_worker_celery(settings: Any) -> Celery:
    """The Celery app for these settings, with the job task (rein.worker.tasks) on it."""
    return make_celery(settings)
