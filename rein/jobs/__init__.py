"""The job lifecycle that the API, the batch manager and the worker share.

Queues and the Celery app (`queues`), preparing a request for a served model (`registry`,
`prepare`), the errors they raise (`errors`), claiming leases (`claim`), writing many callers'
small writes together (`group_commit`: the intake's and the worker's), cancelling (`cancel`),
the reaper, rate-limit admission and settlement (`ratelimit`), and a finished job's response
body (`results`). The API and the worker never
import each other, and the batch manager imports neither: what they share lives here, on
top of rein.core (tests/unit/test_layers.py keeps it so).
"""
