"""The Celery side of rein: the app and its configuration (app), the worker's engine and
the parts wired around it (context), the Celery bootsteps and pool that own them (bootstep),
the thin job task (tasks) and what it calls: the lease (claim), the token publisher
(publisher), the result writer (recorder) and cancellation (cancel).

Nothing here imports torch at module level except where an engine is built, so the API
can import `rein.jobs.queues` to enqueue jobs.
"""
