"""The intake API (FastAPI): authenticate, validate and tokenize, rate-limit, queue, stream.

`create_app(settings)` (rein.api.app) builds the application; `rein api` serves it with
uvicorn. Routes live in rein.api.routes, one module per area; what they share is here:
dependencies (deps), errors in OpenAI's shape (errors), the rate limiter (ratelimit), the
tokenizer registry (tokenizers), the job repository (jobs), SSE (streams), and the
request/response schemas (schemas).
"""
