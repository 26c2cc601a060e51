"""Webhooks for batches: a tenant's endpoint is POSTed `batch.completed`, `batch.failed`,
`batch.cancelled` and `batch.expired` events in OpenAI's shapes, signed with the Standard Webhooks
scheme (the `standardwebhooks` package), from a Postgres outbox with retries for a day.

* `events`: the event types, the outbox row written with the batch's final status, the body.
* `endpoints`: setting, reading and removing a tenant's endpoint, and its signing secret.
* `destinations`: which URLs rein may POST to (https, and no private networks unless allowed).
* `delivery`: the loop that claims due events, signs and POSTs them, and records every attempt.
"""
