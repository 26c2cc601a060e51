"""Helpers for the API tests (imported by name: pytest puts this directory on sys.path)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from sqlalchemy import select, update

from rein.store.messages import STREAM_FIELD, TokenEvent, event_id
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job, Result, Usage


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def line(custom_id: str, prompt: str = "hello", url: str = "/v1/completions", **body) -> dict[str, Any]:
    """One batch input line (a completion of 4 tokens of the tiny model unless `body` says otherwise)."""
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": 4, **body}}


def jsonl(*lines: dict | str) -> bytes:
    """A batch input file of these lines (a str is written as it is)."""
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def chat_body(content: str = "Hello there", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


class FakeWorker:
    """Plays the worker's part for one job: stream events, then record the outcome."""

    def __init__(self, redis, keys: RedisKeys, sessions) -> None:
        self.redis = redis
        self.keys = keys
        self.sessions = sessions

    def publish(self, job_id: str, events: list[TokenEvent]) -> None:
        for event in events:
            self.redis.xadd(self.keys.job_stream(job_id), {STREAM_FIELD: event.to_json()},
                            id=event_id(event.seq))

    def record(self, job_id: str, text: str, token_ids: list[int], finish_reason: str = "stop",
               status: str = "succeeded") -> None:
        with self.sessions.begin() as session:
            job = session.get(Job, job_id)
            session.execute(update(Job).where(Job.id == job_id).values(
                status=status, started_at=job.queued_at, first_token_at=job.queued_at,
                finished_at=job.queued_at, attempt=1))
            session.add(Result(job_id=job_id, text=text, finish_reason=finish_reason, token_ids=token_ids))
            session.add(Usage(job_id=job_id, tenant=job.tenant, key_id=job.key_id, model=job.model,
                              prompt_tokens=job.prompt_tokens, completion_tokens=len(token_ids)))

    def run(self, job_id: str, pieces: list[tuple[str, list[int]]], finish_reason: str = "stop") -> None:
        """Stream `pieces` as events 1..n (the last one final), then record the result."""
        with self.sessions() as session:
            prompt_tokens = session.get(Job, job_id).prompt_tokens
        token_ids = [t for _, ids in pieces for t in ids]
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(token_ids),
                 "total_tokens": prompt_tokens + len(token_ids)}
        events = [TokenEvent(seq=i + 1, text=text, token_ids=ids,
                             finish_reason=finish_reason if i == len(pieces) - 1 else None,
                             usage=usage if i == len(pieces) - 1 else None)
                  for i, (text, ids) in enumerate(pieces)]
        self.publish(job_id, events)
        self.record(job_id, "".join(text for text, _ in pieces), token_ids, finish_reason)

    def serve_next(self, tenant: str, pieces: list[tuple[str, list[int]]], timeout: float = 10.0
                   ) -> threading.Thread:
        """In a thread: wait for the tenant's next job to appear, then run it."""
        def work() -> None:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with self.sessions() as session:
                    job_id = session.scalar(select(Job.id).where(Job.tenant == tenant, Job.status == "queued"))
                if job_id:
                    time.sleep(0.05)
                    self.run(job_id, pieces)
                    return
                time.sleep(0.02)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        return thread
