"""The shapes that cross process boundaries: the queue message from the API to a worker,
and the token events a worker streams back through Redis.

Both are plain JSON-able dicts built and read only through these helpers, so the API and
the worker cannot drift apart.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from rein.core.priorities import PRIORITY_INTERACTIVE

# A job's Redis Stream entries hold the event JSON (TokenEvent.to_json) under this field,
# with the explicit entry id event_id(seq), so SSE `Last-Event-ID: N` resumes at XRANGE (N-0.
STREAM_FIELD = "data"


def event_id(seq: int) -> str:
    """The stream entry id of the event numbered `seq`."""
    return f"{seq}-0"


@dataclass
class JobMessage:
    """What a worker needs to run a job: token ids (never text) and sampling params.

    `sampling` holds SamplingParams fields by name; `logprobs_mode` and `endpoint` let the
    worker build the same response body the synchronous endpoint returns.

    An embeddings job (/v1/embeddings): `sampling` holds PoolingParams fields, and
    `prompt_token_ids` all of its inputs one after the other, `input_lengths` long each
    (rein.openai.embeddings.split_inputs).
    """

    job_id: str
    model: str
    endpoint: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    priority: int = PRIORITY_INTERACTIVE
    logprobs_mode: int | None = None
    tenant: str = ""
    key_id: str = ""
    # rein.openai.response_shape.ResponseShape.to_dict(): n > 1, best_of, echo, prompt logprobs; None: plain.
    shape: dict[str, Any] | None = None
    input_lengths: list[int] | None = None
    # The batch queue shard it waits on (rein.jobs.affinity); 0 for interactive jobs.
    shard: int = 0
    # The LoRA adapter it runs under (rein.jobs.adapters.AdapterRef.to_dict()), None: the base model.
    # `model` is then the base model, whose queue it waits on; the job row's `model` the adapter.
    lora: dict[str, Any] | None = None
    # A chat job of a model with a reasoning parser (rein.openai.reasoning.Reasoning.to_dict()), so
    # the worker records its reasoning tokens; None: none.
    reasoning: dict[str, Any] | None = None
    # The batch it is a line of; None: a request through the API's intake (charged against its
    # key's TPM when admitted, which the worker settles). Not its priority: a `service_tier:
    # "flex"` request runs at batch priority and is still charged.
    batch_id: str | None = None
    # Its images, in prompt order, as [{"sha256", "detail"}]: the bytes are in the file store
    # under their sha256 (rein.jobs.image_sources), never in the message. None: no images.
    images: list[dict[str, str]] | None = None

    def to_dict(self) -> dict[str, Any]:
        # Shallow on purpose: asdict() deep-copies the token ids, a fifth of an enqueue's CPU.
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobMessage:
        return cls(**data)

    @classmethod
    def for_job(cls, job: Any) -> JobMessage:
        """The message of a stored job (a `Job` or a row with its columns), to send it again:
        the job row holds everything the API put in the first message."""
        lora = job.params.get("lora")
        return cls(job_id=job.id, model=lora["base"] if lora else job.model, endpoint=job.endpoint,
                   prompt_token_ids=list(job.prompt_token_ids), sampling=job.params["sampling"],
                   priority=job.priority, logprobs_mode=job.params.get("logprobs_mode"),
                   tenant=job.tenant, key_id=job.key_id, shape=job.params.get("shape"),
                   input_lengths=job.params.get("input_lengths"), shard=getattr(job, "shard", 0), lora=lora,
                   reasoning=job.params.get("reasoning"), batch_id=getattr(job, "batch_id", None),
                   images=job.params.get("images"))


@dataclass
class TokenEvent:
    """One step's delta of one job (a batch job's: its deltas of up to a second of steps,
    rein.worker.publisher). `seq` counts events from 1 with no gaps; the last event
    has `finish_reason` and `usage` set. Concatenated `text` equals the final text.

    `index` is the choice a delta belongs to when the request has n > 1; a choice's
    `choice_finish_reason` ends that choice only (the job ends with the event that has
    `finish_reason`)."""

    seq: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    index: int = 0
    choice_finish_reason: str | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def to_json(self) -> str:
        data = {"seq": self.seq, "text": self.text, "token_ids": self.token_ids}
        if self.finish_reason is not None:
            data["finish_reason"] = self.finish_reason
        if self.usage is not None:
            data["usage"] = self.usage
        if self.error is not None:
            data["error"] = self.error
        if self.index:
            data["index"] = self.index
        if self.choice_finish_reason is not None:
            data["choice_finish_reason"] = self.choice_finish_reason
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> TokenEvent:
        data = json.loads(raw)
        return cls(seq=data["seq"], text=data["text"], token_ids=data.get("token_ids", []),
                   finish_reason=data.get("finish_reason"), usage=data.get("usage"),
                   error=data.get("error"), index=data.get("index", 0),
                   choice_finish_reason=data.get("choice_finish_reason"))
