"""The one settings object shared by the API, the worker and the CLI.

Every value comes from an environment variable `REIN_<FIELD>` (e.g. `REIN_DATABASE_URL`),
read once by `get_settings()`. This is the only module in rein that reads the environment:
everything else takes a `Settings` (CLI flags override a field with `model_copy(update=...)`).
Empty variables count as unset.

`REIN_MODELS` names the served models, comma separated, the first being the default:

    REIN_MODELS="llama=/models/Llama-3.1-8B-Instruct@8192,qwen=Qwen/Qwen3-0.6B"

Each entry is `name=path_or_hub_id[@max_model_len]`: the name clients send as `model`,
a local Hugging Face model directory or a hub id, and optionally `@N` to cap the context
length at N tokens (default: the model's own). An entry whose path is a PEFT LoRA adapter
directory (it holds adapter_config.json) serves that adapter over a base model rather than a
model of its own: it is moved to `lora_modules` (REIN_LORA_MODULES, vLLM's --lora-modules).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from rein.core.cpu_pinning import parse_cpu_list
from rein.core.tool_call_parser_names import TOOL_CALL_PARSERS

MODELS_FORMAT = "name=path_or_hub_id[@max_model_len][,name=...]"
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


class SettingsError(ValueError):
    """The environment holds a value rein cannot use; the message names each variable."""


class ServedModel(BaseModel):
    """One entry of REIN_MODELS."""

    model_config = ConfigDict(frozen=True)

    name: str
    """What clients pass as `model` (and what names the model's queue)."""
    source: str
    """A model directory, a GGUF file or a Hugging Face hub id."""
    max_model_len: int | None = None
    """Context length cap in tokens; None: the model's own."""


LORA_MODULES_FORMAT = 'name=path[,name=path] or JSON: [{"name": ..., "path": ..., "base_model_name": ...}]'


class LoRAModule(BaseModel):
    """One LoRA adapter served beside a base model (REIN_LORA_MODULES, or a REIN_MODELS entry
    naming an adapter directory)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """What clients pass as `model` to run under the adapter."""
    path: str
    """The adapter: a PEFT directory (adapter_config.json + adapter_model.safetensors) or a GGUF
    LoRA file, where every worker can read it."""
    base_model_name: str | None = None
    """The served model (a REIN_MODELS name) it runs over; None: the one its
    adapter_config.json's base_model_name_or_path names, else the first served model."""


def parse_lora_modules(text: str) -> tuple[LoRAModule, ...]:
    """vLLM's --lora-modules forms: `name=path` entries (comma or space separated), or JSON, an
    object or a list of them with name, path and optionally base_model_name."""
    text = text.strip()
    if text.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"LoRA modules {text!r} are not valid JSON ({exc}): expected "
                             f"{LORA_MODULES_FORMAT}") from exc
        items = data if isinstance(data, list) else [data]
        try:
            modules = [LoRAModule.model_validate(item) for item in items]
        except ValidationError as exc:
            raise ValueError(f"LoRA modules {text!r}: each needs a name and a path ({exc.errors()[0]['msg']}): "
                             f"expected {LORA_MODULES_FORMAT}") from exc
    else:
        modules = []
        for entry in re.split(r"[,\s]+", text):
            if not entry:
                continue
            name, sep, path = (part.strip() for part in entry.partition("="))
            if not sep or not name or not path:
                raise ValueError(f"LoRA module {entry!r} is not name=path: expected {LORA_MODULES_FORMAT}")
            modules.append(LoRAModule(name=name, path=path))
    for module in modules:
        if not MODEL_NAME.fullmatch(module.name):
            raise ValueError(f"LoRA module name {module.name!r} must start with a letter or digit and use only "
                             f"letters, digits and . _ : / -")
    names = [m.name for m in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"LoRA module names must be unique, got {names}")
    return tuple(modules)


def is_adapter_directory(source: str) -> bool:
    """Whether a REIN_MODELS source is a PEFT adapter directory rather than a model."""
    return Path(source, "adapter_config.json").is_file()


def parse_models(text: str) -> tuple[ServedModel, ...]:
    """'a=/m/a@4096,b=org/b' -> ServedModels; ValueError naming the bad entry and the format."""
    models: list[ServedModel] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            if text.strip():
                raise ValueError(f"empty entry in {text!r} (a stray comma?): expected {MODELS_FORMAT}")
            continue
        name, sep, source = (part.strip() for part in entry.partition("="))
        if not sep:
            raise ValueError(f"entry {entry!r} has no '=': expected {MODELS_FORMAT}, e.g. llama=/models/llama")
        if not name:
            raise ValueError(f"entry {entry!r} has no model name before '=': expected {MODELS_FORMAT}")
        if not MODEL_NAME.fullmatch(name):
            raise ValueError(
                f"entry {entry!r}: model name {name!r} must start with a letter or digit and use only "
                f"letters, digits and . _ : / - (expected {MODELS_FORMAT})"
            )
        max_model_len = None
        # A path may contain '@'; only a final '@' followed by no '/' is the length suffix.
        head, at, tail = source.rpartition("@")
        if at and "/" not in tail:
            if not tail.isdigit() or int(tail) < 1:
                raise ValueError(
                    f"entry {entry!r}: max_model_len {tail!r} after '@' must be a positive integer "
                    f"(expected {MODELS_FORMAT}, e.g. {name}=/models/x@4096)"
                )
            source, max_model_len = head.strip(), int(tail)
        if not source:
            raise ValueError(f"entry {entry!r} has no model path or hub id after '=': expected {MODELS_FORMAT}")
        if any(m.name == name for m in models):
            raise ValueError(f"model name {name!r} appears twice in {text!r}: names must be unique")
        models.append(ServedModel(name=name, source=source, max_model_len=max_model_len))
    return tuple(models)


class Settings(BaseSettings):
    """rein's configuration; each field is read from `REIN_<FIELD NAME>`."""

    model_config = SettingsConfigDict(
        env_prefix="REIN_", env_ignore_empty=True, extra="ignore", frozen=True,
        use_attribute_docstrings=True,
    )

    # --- where things are
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/rein"
    """Postgres, as a SQLAlchemy URL (driver psycopg 3); `rein migrate` creates the database if missing."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis: Celery broker, rate-limit counters and per-job token streams."""
    redis_key_prefix: str = "rein:"
    """Prefix of every Redis key rein names, so deployments (and test runs) can share one Redis."""

    # --- what is served
    models: Annotated[tuple[ServedModel, ...], NoDecode] = ()
    """REIN_MODELS: `name=path_or_hub_id[@max_model_len],...`; the first is the default."""
    lora_modules: Annotated[tuple[LoRAModule, ...], NoDecode] = ()
    """REIN_LORA_MODULES: LoRA adapters served over the models, vLLM's --lora-modules:
    `name=path,...` or JSON `[{"name": ..., "path": ..., "base_model_name": ...}]`. Setting it
    turns REIN_ENABLE_LORA on. More can be registered at run time (POST /v1/load_lora_adapter)."""

    # --- the API
    api_host: str = "127.0.0.1"
    """Address `rein api` listens on."""
    api_port: int = Field(8000, ge=1, le=65535)
    """Port `rein api` listens on (it also serves /metrics there)."""
    api_workers: int = Field(1, ge=1, le=64)
    """Processes `rein api` runs (uvicorn workers); each holds its own pools and tokenizers."""
    api_db_pool_size: int = Field(20, ge=1, le=200)
    """Postgres connections each API process keeps open (a request holds one only briefly)."""
    prometheus_multiproc_dir: str | None = Field(None, validation_alias="PROMETHEUS_MULTIPROC_DIR")
    """prometheus_client's own variable (no REIN_ prefix): set by `rein api` for its processes
    when REIN_API_WORKERS > 1, so that a scrape of any of them reports all of them."""
    metrics_public: bool = False
    """Serve the API's GET /metrics without a key (it names key ids and queue depths); by
    default it needs a key with the `admin` scope, as Prometheus' bearer credentials."""
    auth_cache_seconds: float = Field(1.0, ge=0, le=60)
    """How long an API process trusts a key it has checked; a revoked key is refused within this.
    0: every request reads the key from Postgres."""
    max_request_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body the API reads (413 beyond, before parsing it; chunked bodies are
    counted as they arrive). File uploads are bounded by REIN_MAX_FILE_BYTES instead."""
    max_large_bodies_per_key: int = Field(2, ge=1)
    """Request bodies over 64 KiB one key may have an API process read and parse at once (429
    `too_many_large_requests` beyond): what one key's big bodies can take of its memory."""
    max_queue_depth: int = Field(1000, ge=1)
    """Backpressure: above this many queued jobs for a model, new jobs get 503 with Retry-After."""
    tenant_queue_share: float = Field(0.5, gt=0, le=1)
    """The share of REIN_MAX_QUEUE_DEPTH one tenant's queued jobs may take (429 beyond it), so
    one tenant cannot fill a model's queue for the others; 1: no per-tenant limit."""
    default_rpm: int | None = Field(None, ge=1)
    """Requests per minute for a key without its own limit; unset: unlimited."""
    default_tpm: int | None = Field(None, ge=1)
    """Tokens per minute for a key without its own limit (a request is charged prompt + max_tokens, or
    prompt + REIN_TPM_COMPLETION_ESTIMATE without max_tokens, then settled on its usage); unset: unlimited."""

    # --- HTTP conventions and token accounting of the API (rein.api.conventions, rein.jobs.ratelimit)
    allowed_origins: Annotated[tuple[str, ...], NoDecode] = ()
    """REIN_ALLOWED_ORIGINS: origins a browser page may call the API from (CORS), comma
    separated, or `*`; empty (the default): no CORS headers, so browsers refuse cross-origin calls."""
    api_root_path: str = ""
    """The path prefix a proxy serves the API under (uvicorn's root_path), e.g. /rein."""
    forwarded_allow_ips: str | None = None
    """Proxies whose X-Forwarded-For/-Proto the API trusts, comma separated or `*`; unset:
    uvicorn's default (127.0.0.1, or its FORWARDED_ALLOW_IPS)."""
    tpm_completion_estimate: int = Field(256, ge=0)
    """Completion tokens charged against a key's TPM for a request without max_tokens (capped by
    what the context leaves); the charge is settled against the real usage when the job ends."""
    tpm_burst_seconds: float = Field(10, gt=0, le=60)
    """How much of a key's TPM its token bucket holds, in seconds of the limit (TPM x this / 60
    tokens), refilled at TPM / 60 a second (rein.jobs.ratelimit). Small, so the TPM holds in every
    minute: a bucket of the whole minute would allow twice the TPM in one. A request larger than
    the bucket (up to the TPM) waits for a full bucket and leaves a debt."""

    @field_validator("allowed_origins", mode="before")
    @classmethod
    def _parse_origins(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(origin.strip() for origin in value.split(",") if origin.strip())
        return value

    # --- clients of a running rein (`rein batch`)
    api_key: SecretStr | None = None
    """The key `rein batch` sends (`--api-key` overrides); the API itself never reads it."""

    # --- jobs and streams
    idempotency_key_ttl_seconds: float = Field(86_400, gt=0)
    """How long an Idempotency-Key names its job: a retry within it gets that job back; after
    it, the key starts a new job."""
    job_timeout_seconds: int = Field(3600, ge=1)
    """Longest a job may run; its worker aborts it then (code `timeout`)."""
    lease_seconds: float = Field(30.0, gt=0)
    """A running job's lease: a worker that stops renewing it (killed, hung, cut off from
    Postgres) loses the job this long after its last renewal, and the reaper queues it again."""
    lease_renew_seconds: float = Field(10.0, gt=0)
    """How often a worker renews the leases of the jobs it runs (one statement for all of them)."""
    reaper_interval_seconds: float = Field(5.0, gt=0)
    """How often the reaper looks for expired leases and queued jobs whose message is lost."""
    requeue_unclaimed_seconds: float = Field(15.0, gt=0)
    """A queued job whose message is neither on its queue nor claimed for this long gets a new
    message (a lost Redis, a dead worker's reserved messages); at once after Redis restarts."""
    max_event_streams: int = Field(2000, ge=1)
    """Event streams (SSE followers, streamed completions) one API process serves at once: its
    Redis connection pool for them holds this many, and a stream beyond it waits for one."""
    max_streams_per_key: int = Field(200, ge=1)
    """Event streams one key may hold open on one API process (429 with Retry-After beyond)."""
    max_downloads_per_key: int = Field(8, ge=1)
    """Downloads (a file's content, a batch's output or errors) one key may have in progress on one
    API process (429 with Retry-After beyond)."""
    stream_maxlen: int = Field(10_000, ge=1)
    """Events kept per job stream (approximate cap); a longer job replays its start from Postgres."""
    stream_ttl_seconds: int = Field(3600, ge=1)
    """A job's token stream expires this long after the job ends."""

    # --- files and batches (see rein.batches)
    files_dir: str = "data/files"
    """Directory (a volume in compose) holding uploaded and generated files, one file per id
    (when REIN_FILES_URL is unset)."""
    files_url: str | None = None
    """Where uploaded and generated files live: a directory path, or `s3://bucket/prefix` for
    S3-compatible object storage (endpoint and credentials from the standard AWS_* variables),
    which every API replica on any host shares. Unset: REIN_FILES_DIR."""
    max_file_bytes: int = Field(200 * 1024 * 1024, ge=1)
    """Largest upload accepted by POST /v1/files (default 200 MiB)."""
    max_tenant_file_bytes: int = Field(10 * 1024**3, ge=1)
    """Storage quota of one tenant: the total bytes of its uploaded files, the output and error
    files its batches generated and its stored job results (rein.jobs.retention.stored_bytes).
    An upload past it gets 413 `storage_quota_exceeded`; a batch still writes its results past
    it (they count toward the next upload). Default 10 GiB: fifty uploads of the default
    REIN_MAX_FILE_BYTES, while one tenant cannot fill a shared volume."""
    # --- images in requests (vision models: rein.openai.images, rein.jobs.image_sources)
    limit_mm_per_prompt: str = "image=8"
    """vLLM's --limit-mm-per-prompt: the most images one request may hold, as `image=N` or JSON
    `{"image": N}` (400 beyond, naming the limit). Default 8: enough to compare a handful of
    pictures, while one request cannot make the API fetch, hold and decode more than 8 x
    REIN_MAX_IMAGE_BYTES, nor a worker encode more than 8 images for one prompt."""
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1)
    """Largest image file one request may send, fetch or name (OpenAI's 20 MB): a data URL's
    decoded bytes, a fetched URL's body (the download stops there), a file id's file."""
    max_image_pixels: int = Field(64_000_000, ge=1)
    """Most pixels (width x height) an image may declare, checked before its pixels are decoded,
    so a decompression bomb of a few kilobytes is refused without allocating its gigabytes."""
    image_fetch: str = "off"
    """Whether the API fetches images given as http(s) URLs: `off` (the default: a service that
    fetches any URL it is sent is a server-side request forgery tool and a bandwidth sink, so the
    operator opts in), `on` (any public host), or a comma-separated allowlist of host names
    (`images.example.com`, or `.example.com` for it and its subdomains). Private, loopback,
    link-local, multicast and reserved addresses are refused whatever this says (docs/images.md)."""
    image_fetch_allow_private: bool = False
    """Let image fetches reach private and loopback addresses (tests, or a deployment whose image
    server is on its own network). Never in a deployment that takes URLs from untrusted users."""
    image_fetch_timeout_seconds: float = Field(10.0, gt=0, le=300)
    """The most one image fetch may take, redirects and the whole body included."""
    image_fetch_max_redirects: int = Field(3, ge=0, le=10)
    """Redirects one image fetch follows (each target checked as the first URL was)."""
    image_retention_seconds: float | None = Field(7 * 86400, ge=0)
    """A stored image (the file store's `image-<sha256>`, kept for the workers) is deleted by the
    retention sweep once no request has named it for this long and no queued or running job
    names it (rein.jobs.retention). 7 days: past a batch's completion window. 0: kept."""

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _check_mm_limit(cls, value: str) -> str:
        from rein.core.image_limits import parse_mm_limits

        parse_mm_limits(value)
        return value

    @field_validator("image_fetch")
    @classmethod
    def _check_image_fetch(cls, value: str) -> str:
        from rein.core.image_limits import parse_fetch_policy

        parse_fetch_policy(value)
        return value

    result_retention_days: float | None = Field(30, ge=0)
    """Job results (the text, tokens and response a job produced) are deleted this many days
    after the job ended; the job keeps its status, timings and usage. 0: kept."""
    batch_file_expiry_seconds: int | None = Field(2_592_000, ge=0)
    """Batch files expire this long after they are created, as OpenAI's do after 30 days: an
    upload (purpose batch) sent without `expires_after`, and the output and error files of a
    batch created without `output_expires_after`. The expiry sweep (rein.jobs.retention)
    deletes them; 0: kept until deleted."""
    usage_retention_days: float | None = Field(400, ge=0)
    """Usage rows (GET /v1/usage, accounting) are deleted this many days after their job ended:
    longer than results, so a year of invoices can be checked. 0: kept."""
    retention_interval_seconds: float = Field(3600, gt=0)
    """How often each API process deletes what is past its retention (rein.jobs.retention)."""
    retention_batch: int = Field(1000, ge=1)
    """Rows one retention transaction deletes at most (a pass runs batches until none is left)."""
    batch_max_requests: int = Field(50_000, ge=1)
    """Most request lines in one batch input file."""
    batch_max_embedding_inputs: int = Field(50_000, ge=1)
    """Most embedding inputs across all the lines of one /v1/embeddings batch, as OpenAI's
    (a string input counts 1, an array counts each of its strings or token arrays)."""
    batch_completion_window_seconds: float = Field(86_400, gt=0)
    """How long a batch may run (its `completion_window` "24h"); requests unfinished then expire."""
    batch_queue_window: int = Field(256, ge=1)
    """Batch messages kept waiting on a model's queue; the batch manager tops it up as workers drain it."""
    batch_order: Literal["prefix", "file"] = "prefix"
    """The order the batch manager sends a batch's lines in. prefix: by the prompts' first 128
    tokens (then line number), so lines sharing a system prompt run while it is in the prefix
    cache, whatever order the file has them in; file: the file's order."""
    batch_affinity: bool = True
    """Prefix affinity across workers (rein.jobs.affinity): batch work waits on one of several
    shards of the model's batch queue by its prompt's prefix, and each worker takes its own
    shards first, so the lines about one document are prefilled on one worker, not on each.
    Off: all batch work on one shard, taken by whichever worker is free. Read by the API;
    every worker consumes every shard either way."""
    batch_validation_timeout_seconds: float = Field(3600, gt=0)
    """A batch still `validating` this long after its creation fails (`validation_timeout`)."""
    batch_validator_threads: int = Field(2, ge=1, le=64)
    """Threads per API process that validate batch files; one tenant's batches take at most half
    of them (at least one), so another tenant's batch starts validating beside a large file."""
    batch_poll_seconds: float = Field(1.0, gt=0)
    """How often the API's batch manager looks for batch work (validation, feeding, finalizing)."""
    max_queued_batch_tokens_per_tenant: int | None = Field(2_000_000, ge=0)
    """Batch tokens (each line's prompt + n x max_tokens) one tenant may have sent to the queues and
    not finished (waiting or running); at the cap the batch manager holds that tenant's further
    lines back and goes on feeding the others' (the lines wait, they do not fail); 0: no cap."""

    # --- webhooks (rein.batches.webhooks): batch events POSTed to each tenant's endpoint
    webhook_allow_private: bool = False
    """Allow webhook destinations that resolve to private, loopback, link-local, multicast, reserved
    or unspecified addresses (IPv4 and IPv6). Off: such a URL is refused when it is set and again
    at every delivery, so a tenant cannot make rein POST into the network it runs in."""
    webhook_allowed_cidrs: Annotated[tuple[str, ...], NoDecode] = ()
    """Comma-separated networks (e.g. 10.20.0.0/16,fd00::/8) webhook destinations may resolve into
    even though they are private: a narrower opening than REIN_WEBHOOK_ALLOW_PRIVATE."""
    webhook_allow_http: bool = False
    """Allow plain http:// webhook URLs; off, only https:// is accepted."""
    webhook_timeout_seconds: float = Field(10.0, gt=0, le=120)
    """How long one delivery may take (connect, send, answer) before it counts as failed."""
    webhook_retry_seconds: float = Field(86_400, gt=0)
    """How long a failed event is retried, counted from the event: after it, the event is marked
    failed (a day, as OpenAI and Standard Webhooks senders do)."""
    webhook_backoff_seconds: float = Field(5.0, gt=0)
    """The wait before the first retry; each further retry waits twice as long (with up to 25%
    jitter either way), up to REIN_WEBHOOK_BACKOFF_MAX_SECONDS."""
    webhook_backoff_max_seconds: float = Field(3600, gt=0)
    """The longest wait between two deliveries of one event."""
    webhook_poll_seconds: float = Field(1.0, gt=0)
    """How often each API process looks for events due for delivery."""
    webhook_event_retention_days: float | None = Field(30, ge=0)
    """Delivered and failed webhook events, with their attempts, are deleted this many days after
    the event (by each API process's deliverer, every REIN_RETENTION_INTERVAL_SECONDS). 0: kept."""

    @field_validator("webhook_allowed_cidrs", mode="before")
    @classmethod
    def _parse_cidrs(cls, value: object) -> object:
        if isinstance(value, str):
            value = tuple(item.strip() for item in value.split(",") if item.strip())
        for item in value or ():
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(f"REIN_WEBHOOK_ALLOWED_CIDRS: {item!r} is not a network such as "
                                 f"10.0.0.0/8 or fd00::/8 ({exc})") from None
        return value

    # --- the engine (see rein.engine.config.EngineConfig, which validates them; EngineSettings below)
    max_num_seqs: int = Field(64, ge=1)
    """Sequences batched at once; also the worker's Celery concurrency."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Token budget of one engine step (prefill chunks + decodes)."""
    interactive_step_budget: Annotated[int, Field(ge=0)] | Literal["auto", "off"] = "auto"
    """While interactive requests (priority below batch) are in the engine, the batch-priority tokens
    one step may hold (decodes 1 each, prefill chunks their length), so interactive token latency
    stays near idle; the batch requests left out pause for that step, and batch prefill stays
    within 256 tokens a step (rein.engine.scheduler); auto: 4 on a CPU, off on CUDA; off: no limit."""
    max_model_len: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    """Context length (prompt + completion); unset: the model's. A REIN_MODELS entry's @N wins for its model.
    auto: an engine takes the most its KV cache holds, up to the model's own (on the CPU an unset one
    does too when the model's own does not fit); the API then checks requests against the model's own
    length, and one longer than a worker holds fails there with context_length_exceeded."""
    max_num_encoder_tokens: int | None = Field(None, ge=1)
    """Vision models: image tokens the vision encoder may produce in one engine step, beside the text
    prefill (an image larger than this runs alone in a step); unset: max_num_batched_tokens."""
    encoder_cache_tokens: int = Field(16384, ge=1)
    """Vision models: image embeddings (rows) kept by image, least recently used dropped first, so
    prompt chunks, n > 1 choices, recomputes and repeated images never run the encoder again."""
    enable_lora: bool = False
    """Serve LoRA adapters beside the base model (rein.LLM's lora_request; issue 44)."""
    max_loras: int = Field(8, ge=1)
    """With enable_lora: the most adapters one engine step runs (device slots)."""
    max_cpu_loras: int | None = Field(None, ge=1)
    """With enable_lora: loaded adapters kept in host memory for later requests; unset: max_loras."""
    max_lora_rank: int = Field(16, ge=1, le=256)
    """With enable_lora: the largest adapter rank accepted (the device slots are this wide)."""
    kv_cache_memory: str | None = None
    """Bytes for the KV cache, e.g. 4GiB; unset: REIN_GPU_MEMORY_UTILIZATION on CUDA (1 GiB on CPU)."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """With no REIN_KV_CACHE_MEMORY, on CUDA: the share of the device's total memory rein fills (the KV
    cache gets what is free after the weights less (1 - this) x total)."""
    device: str = "auto"
    """auto (cuda when available), cuda, cuda:N or cpu."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Weights dtype; auto: bfloat16 on CUDA, float32 on CPU."""
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16", "int8"] = "auto"
    """KV cache element type; auto: the weights dtype."""
    block_size: int = Field(16, ge=1)
    """Tokens per KV block (a power of two)."""
    enforce_eager: bool = False
    """On CUDA, launch decode steps kernel by kernel instead of replaying CUDA graphs (for debugging)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of leading tokens other requests computed (automatic prefix caching)."""
    async_scheduling: bool = False
    """Plan the next step and finish the last while the model runs this one (the same outputs)."""
    seed: int = 0
    """Seeds the random seeds of requests that give none."""
    generation_config: str = "auto"
    """Sampling defaults: auto (the model's generation_config.json), vllm (built-in; `none` too), or a
    folder holding a generation_config.json. The API applies them when it parses a request."""
    model_impl: Literal["auto", "rein", "transformers"] = "auto"
    """Which code runs the model: rein (native only), transformers (the model's own transformers code
    with rein's attention), auto (native where rein has it, else transformers)."""
    tokenizer: str | None = None
    """A tokenizer directory or hub id to use instead of the model's own (the API and the worker both)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a model given as a hub id; unset: the default branch."""
    tokenizer_revision: str | None = None
    """Hub revision of a REIN_TOKENIZER given as a hub id; unset: its default branch."""
    chat_template: str | None = None
    """A Jinja chat template, as a file path or inline, replacing the tokenizer's (the API and the worker both)."""
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None  # type: ignore[valid-type]
    """The format tool calls are read from in auto-mode answers (vLLM's names: hermes, llama3_json,
    mistral, qwen3_coder); unset: the one the model's chat template teaches, else hermes
    (rein.openai.tool_call_parsers). The API and `rein run-batch` read it."""
    reasoning_parser: str | None = None
    """vLLM's --reasoning-parser: `deepseek_r1` or `qwen3` splits a reasoning model's thinking into
    `reasoning_content` (rein.openai.reasoning). One name applies to every served model; with several,
    `name=parser,...` sets it per model (a model left out has none). Unset: no parser."""
    trust_remote_code: bool = False
    """Let transformers run the Python code of a model or tokenizer whose config needs it (`auto_map`)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks (processes, one device each) one engine shards its model over; 1: one device."""
    quantization: str = "auto"
    """Weights: auto (the checkpoint's own: GGUF, AWQ, GPTQ kept quantized), none (all dequantized
    to the dtype), int8, int4, int4-g32/64/128/256 (float projections quantized at load)."""
    quantized_activations: Literal["float32", "int8"] = "float32"
    """CPU quantized weights: float32 multiplies the activations as they are; int8 quantizes them per row
    and block of 32 to int8 first and uses integer dot products (faster at large batch, approximate)."""
    worker_interactive_slots: int | None = Field(None, ge=0)
    """Jobs a worker takes from its model's interactive queue beyond max_num_seqs, so that an
    interactive job is taken (and, by its priority, admitted by the engine) while batch jobs
    hold every slot; unset: a quarter of max_num_seqs, at least 1; 0: none (rein.worker.bootstep)."""
    worker_engine_process: bool = True
    """Run the worker's engine in a child process of its own (rein.engine.process_client), so the
    step loop does not share the GIL with Celery, the task threads and the publisher; false: on
    a thread of the worker process."""
    worker_engine_cpus: Annotated[frozenset[int] | None, NoDecode] = None
    """Cores the worker's engine process runs on (a Linux CPU list: 3, 2-3, 0,4-7), the worker's
    own threads then keeping to the others (rein.core.cpu_pinning); unset: no pinning."""
    worker_queued_slots: int | None = Field(None, ge=0)
    """Jobs a worker takes beyond max_num_seqs from both its model's queues: they wait in the
    engine, which starts one at the step after a running job ends, instead of after that job's
    record, ack and the next message's claim; unset: an eighth of max_num_seqs, at least 1; 0: none
    (rein.jobs.queues)."""
    worker_metrics_port: int | None = Field(None, ge=0, le=65535)
    """Port the worker serves its Prometheus metrics on (/metrics, all interfaces); unset or 0: none."""

    cache_dir: str = "~/.cache/rein"
    """rein's cache: packaged models (`rein fetch-model`), the config/tokenizer read from GGUF files
    and the CPU kernels built on this machine (rein.kernels.cpu_native)."""
    structured_validators: int = Field(2, ge=0, le=64)
    """Child processes per process (API, batch validator, worker, run-batch) that check
    structured-output specs with llguidance, so a spec that crashes or stalls the native
    compiler costs only its request (rein.engine.structured.validator); 0: check in-process."""
    structured_validate_seconds: float = Field(10.0, gt=0)
    """How long a spec may take to check (waiting for a free validator included) before it
    is refused as too slow to compile."""
    cpu_fast_paths: bool = True
    """On CPU, use the fast paths this CPU can run (probed once per process, named in the load
    log: oneDNN linears per dtype, rein's C kernels, malloc thresholds; rein.kernels.cpu_paths);
    false: torch's code alone, on any CPU."""
    cuda_small_gemm: Literal["cublas", "triton"] = "cublas"
    """On CUDA, the matmuls of at most 64 rows (decode steps) in fp16/bf16/fp32: `cublas`
    (torch's F.linear) or `triton`, rein's split-K kernel (rein.kernels.triton_small_gemm),
    for devices where it measures faster."""
    cuda_prefill_attention: Literal["triton", "flash"] = "triton"
    """On CUDA, the attention of a step whose prompts have no cached prefix: `triton`, rein's
    paged prefill kernel, or `flash`, torch's flash varlen attention over the step's own K/V
    (rein.model.attention); prompts with a cached prefix always take the Triton kernel."""
    cuda_graphs_tensor_parallel: bool = False
    """On CUDA under tensor parallelism, capture the decode graphs on every rank (each rank's
    NCCL collectives inside them, replayed in lockstep: rein.engine.rank_processes); false:
    decode steps run eagerly there. Off by default until a multi-GPU run of the GPU check
    (bench/gpu_paths.py, tensor_parallel) has passed with it."""
    cpu_mallopt: bool = True
    """On CPU, raise glibc malloc's mmap and trim thresholds at engine start so large step tensors
    reuse heap memory (rein.model.cpu_allocator); false: leave malloc alone."""
    cpu_kernels: bool = True
    """On CPU, build rein's C attention kernels with the system compiler at first use (into
    cache_dir/kernels) and run decode attention on them (rein.kernels.cpu_native); false, or no
    compiler: torch's reference path."""
    cpu_fused_decode: bool = True
    """On CPU, run a decode step's layers of a quantized Llama-family or Gemma 3 model in one C
    call (rein.kernels.cpu_decode_layers) instead of layer by layer from Python; false: as
    modules. Needs the C kernels (cpu_kernels)."""

    # --- operating
    log_format: Literal["auto", "json", "text"] = "auto"
    """Log lines as JSON objects or text; auto: text on a terminal, JSON otherwise (rein.core.logging)."""

    @field_validator("models", mode="before")
    @classmethod
    def _parse_models(cls, value: object) -> object:
        return parse_models(value) if isinstance(value, str) else value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _parse_lora_modules(cls, value: object) -> object:
        return parse_lora_modules(value) if isinstance(value, str) else value

    @model_validator(mode="before")
    @classmethod
    def _adapters_from_models(cls, data: Any) -> Any:
        """REIN_MODELS entries naming an adapter directory join the LoRA modules; naming adapters
        turns LoRA on (the engines need their slots)."""
        if not isinstance(data, dict):
            return data
        if data.get("lora_modules"):
            data = {**data, "enable_lora": True}
        if not isinstance(data.get("models"), str):
            return data
        try:
            models = parse_models(data["models"])
        except ValueError:
            return data          # the field's own validator reports it, under REIN_MODELS
        adapters = [m for m in models if is_adapter_directory(m.source)]
        if not adapters:
            return data
        for adapter in adapters:
            if adapter.max_model_len is not None:
                raise ValueError(f"REIN_MODELS entry {adapter.name!r} is a LoRA adapter ({adapter.source}): its "
                                 f"context length is its base model's, drop the @{adapter.max_model_len}")
        lora = data.get("lora_modules") or ()
        if isinstance(lora, str):
            lora = parse_lora_modules(lora)
        return {**data, "models": tuple(m for m in models if m not in adapters),
                "lora_modules": (*lora, *(LoRAModule(name=m.name, path=m.source) for m in adapters)),
                "enable_lora": True}

    @field_validator("worker_engine_cpus", mode="before")
    @classmethod
    def _parse_cpu_list(cls, value: object) -> object:
        return parse_cpu_list(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        per_model = [f"REIN_{name.upper()}" for name in PER_MODEL_FIELDS if getattr(self, name) is not None]
        if per_model and len(self.models) > 1:
            # One tokenizer or template applied to several different models would silently
            # misencode all but one of them.
            raise ValueError(f"{', '.join(per_model)} name one model's files but REIN_MODELS serves "
                             f"{len(self.models)} ({', '.join(names)}): serve one model per deployment "
                             f"to set them, or leave them unset")
        taken = set(names) & {m.name for m in self.lora_modules}
        if taken:
            raise ValueError(f"{', '.join(sorted(taken))} names both a model and a LoRA adapter: give the "
                             f"adapter a name of its own")
        for module in self.lora_modules:
            if module.base_model_name is not None and module.base_model_name not in names:
                raise ValueError(f"LoRA adapter {module.name!r} runs over base_model_name "
                                 f"{module.base_model_name!r}, which REIN_MODELS does not serve (served: "
                                 f"{', '.join(names) or 'none'})")
        if self.lease_renew_seconds * 2 > self.lease_seconds:
            raise ValueError(f"REIN_LEASE_RENEW_SECONDS ({self.lease_renew_seconds:g}) must be at most half of "
                             f"REIN_LEASE_SECONDS ({self.lease_seconds:g}), so that one late renewal does not "
                             f"lose a live worker its jobs")
        if self.worker_engine_cpus is not None and not self.worker_engine_process:
            raise ValueError("REIN_WORKER_ENGINE_CPUS pins the worker's engine process, but "
                             "REIN_WORKER_ENGINE_PROCESS is false (the engine runs on a worker thread): "
                             "unset one of them")
        if os.environ.get("REIN_OUTPUT_FILE_RETENTION_DAYS") is not None:
            # Retired, not ignored: a deployment that set it would otherwise keep files 30 days unawares.
            raise ValueError("REIN_OUTPUT_FILE_RETENTION_DAYS was replaced by REIN_BATCH_FILE_EXPIRY_SECONDS "
                             "(seconds, for every batch file; 0: never): set that instead and unset it")
        return self

    @property
    def default_model(self) -> ServedModel:
        """The first served model; SettingsError when REIN_MODELS is empty."""
        if not self.models:
            raise SettingsError(f"no model is served: set REIN_MODELS, e.g. REIN_MODELS=\"{MODELS_FORMAT}\"")
        return self.models[0]

    def served_model(self, name: str) -> ServedModel | None:
        """The served model called `name`, or None."""
        return next((m for m in self.models if m.name == name), None)

    @property
    def visibility_timeout_seconds(self) -> int:
        """Broker visibility timeout: past the longest job, so the broker never redelivers the
        message of a job that may still run. A dead worker's jobs come back much sooner through
        their leases and the reaper (rein.jobs.reaper); the broker's late redelivery is a
        backstop that the claim makes harmless."""
        return 2 * self.job_timeout_seconds + 60


# Engine settings that name one model's files, so they cannot apply to several served models.
PER_MODEL_FIELDS = ("tokenizer", "revision", "tokenizer_revision", "chat_template")

# The engine options' variables (rein.engine.options: the worker, `rein run-batch`, `rein
# generate` and `rein.LLM` read them under their flags and keywords).
ENGINE_FIELDS = ("max_num_seqs", "max_num_batched_tokens", "interactive_step_budget", "max_model_len",
                 "kv_cache_memory", "gpu_memory_utilization", "device", "dtype", "kv_cache_dtype", "block_size",
                 "enforce_eager", "enable_prefix_caching", "async_scheduling", "seed", "generation_config", "model_impl", "tokenizer",
                 "revision", "tokenizer_revision", "chat_template", "trust_remote_code", "tensor_parallel_size",
                 "quantization", "reasoning_parser", "enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank",
                 "tool_call_parser", "max_num_encoder_tokens", "encoder_cache_tokens", "max_image_pixels",
                 "quantized_activations")


class _EngineSettingsBase(BaseSettings):
    model_config = SettingsConfigDict(**Settings.model_config)


EngineSettings = create_model(
    "EngineSettings", __base__=_EngineSettingsBase, __module__=__name__,
    __doc__="Settings' engine fields alone (the same definitions), so the offline tools read only these: "
            "a bad REIN_DATABASE_URL does not stop `rein generate`.",
    **{name: (Settings.model_fields[name].annotation, Settings.model_fields[name]) for name in ENGINE_FIELDS},
)


def load_engine_settings(**overrides: object) -> EngineSettings:
    """The engine's REIN_* variables alone (the offline tools); SettingsError lists each bad one."""
    try:
        return EngineSettings(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc)) from None


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment (overrides win); SettingsError lists each bad variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise SettingsError(describe_errors(exc)) from None


def describe_errors(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        where = f"REIN_{field.upper()}" if field else "settings"
        message = error["msg"].removeprefix("Value error, ")
        given = "" if error["type"] == "value_error" else f" (got {error.get('input')!r})"
        lines.append(f"{where}: {message}{given}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


# Passwords that stand for "put yours here" (deploy/k8s/base/secret.yaml ships CHANGE-ME),
# compared lower-case with everything but letters and digits dropped. No setup, local ones
# included, has a reason to run on one, so they are refused everywhere, not only in production.
PLACEHOLDER_PASSWORDS = frozenset({"changeme", "changethis", "changeit", "replaceme", "placeholder",
                                   "yourpassword", "setme", "fixme", "todo", "xxx", "xxxx", "xxxxxxxx"})


def refuse_placeholder_secrets(settings: Settings) -> None:
    """SettingsError naming each connection URL (REIN_DATABASE_URL, REIN_REDIS_URL) whose
    password is a placeholder, for the commands that connect first (`rein migrate`, `rein api`)."""
    from urllib.parse import urlsplit

    problems = []
    for field in ("database_url", "redis_url"):
        try:
            password = urlsplit(getattr(settings, field)).password
        except ValueError:   # an unparsable URL is its client's to report
            continue
        if password is not None and re.sub(r"[^a-z0-9]", "", password.lower()) in PLACEHOLDER_PASSWORDS:
            problems.append(f"REIN_{field.upper()}: its password is the placeholder {password!r}; put the "
                            f"server's real password in the URL (Kubernetes: the Secret rein-services, "
                            f"deploy/k8s/base/secret.yaml; compose: POSTGRES_PASSWORD and REDIS_PASSWORD in .env)")
    if problems:
        raise SettingsError("refusing placeholder secrets:\n  " + "\n  ".join(problems))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment once (`get_settings.cache_clear()` re-reads)."""
    return load_settings()


def setting_or_default(name: str) -> Any:
    """One setting, or its default when the settings as a whole are invalid: for code that
    runs under every command (the engine, the model cache), where a broken setting it does
    not use is the command's to report, not its."""
    try:
        return getattr(get_settings(), name)
    except SettingsError:
        return Settings.model_fields[name].default


def cache_root() -> Path:
    """REIN_CACHE_DIR (default ~/.cache/rein): models, GGUF views, built CPU kernels."""
    return Path(setting_or_default("cache_dir")).expanduser()


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES, when set (CUDA's own variable, read here as this module alone
    reads the environment)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def share_prometheus_multiproc_dir(path: str) -> None:
    """Set PROMETHEUS_MULTIPROC_DIR for the processes this one starts from now on (`rein api`
    with several workers). Here because this module alone touches the environment."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path


def share_settings_overrides(**overrides: object) -> None:
    """Set `REIN_<FIELD>` for the processes this one starts from now on, so they read the same
    settings as this one's CLI flags made (`rein api`: uvicorn starts the app from a factory
    that loads the settings itself). A tuple is written comma separated."""
    for name, value in overrides.items():
        text = ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)
        os.environ[f"REIN_{name.upper()}"] = text


def swap_environment(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set (None: remove) these variables for a library that takes an option from the
    environment alone (gloo's and NCCL's network interface, rein.model.parallel.group);
    returns what they were, to put back with a second call."""
    previous = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return previous
