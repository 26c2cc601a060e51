"""The worker's Prometheus metrics, named after vLLM's (`vllm:x` -> `rein:x`) so that
dashboards built for vLLM carry over. One registry per worker process, served on its own
port (REIN_WORKER_METRICS_PORT / `rein worker --metrics-port`).

Where each figure comes from, so that the engine thread pays only a few calls per step:

* gauges (requests running and waiting, KV cache usage) are read from the engine when
  Prometheus scrapes, so they are current even while the engine idles;
* step figures (duration, batch size, tokens, preemptions, finished requests) come from
  `observe_step`, which runs on the engine thread after every step with outputs (composed
  with the token publisher's hook, see `compose_hooks`). A step without outputs (a prefill
  chunk) is covered by the next hook through the deltas of the engine's running totals;
* per-request histograms (queue time, time to first token, time per output token,
  end-to-end latency, inference time) are observed by the job task, which knows when the
  job was accepted, claimed, and when its first and last tokens came (`observe_queue_time`,
  `observe_request`). TTFT and end-to-end latency count from the job's acceptance by the
  API, as vLLM's count from a request's arrival, so the two compare.

rein/engine knows nothing of Prometheus: this module reads its `EngineStats`,
`RequestOutput`s and counts, never the other way round.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.engine.step_outputs import RequestOutput

log = logging.getLogger(__name__)

# vLLM's buckets, so that panels and quantiles compare like for like.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort")
MODEL_LABEL = ("model_name",)

StepHook = Callable[[list["RequestOutput"]], None]


class WorkerMetrics:
    """The metrics of one worker process (one served model), in their own registry."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, MODEL_LABEL, registry=self.registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = MODEL_LABEL) -> Counter:
            # prometheus_client appends `_total` to a counter's name itself.
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, MODEL_LABEL, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge(
            "rein:num_requests_running", "Requests in the engine's running batch.")
        self.num_requests_waiting = gauge(
            "rein:num_requests_waiting",
            "Requests in the engine waiting to be scheduled (new or preempted).")
        self.kv_cache_usage_perc = gauge(
            "rein:kv_cache_usage_perc", "KV cache usage: share of KV blocks in use, 0 to 1.")
        self.num_preemptions = counter(
            "rein:num_preemptions", "Requests preempted (blocks freed, recomputed later).")
        self.prefix_cache_queries = counter(
            "rein:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (each request once, when first scheduled).")
        self.prefix_cache_hits = counter(
            "rein:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).")
        self.prompt_tokens = counter(
            "rein:prompt_tokens",
            "Prompt tokens of requests, counted when their prefill completes.")
        self.generation_tokens = counter("rein:generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "rein:request_success",
            "Requests finished in the engine, by finish reason (stop, length, abort).",
            (*MODEL_LABEL, "finished_reason"))
        self.request_queue_time = histogram(
            "rein:request_queue_time_seconds",
            "Time a job waited in its queue, from its submission to its first claim by a worker.",
            REQUEST_LATENCY_BUCKETS)
        # As vLLM measures them: from the request's arrival (here the job's acceptance by the
        # API), so queue time is inside; request_inference_time is the worker's part alone.
        self.time_to_first_token = histogram(
            "rein:time_to_first_token_seconds",
            "Time from the job's acceptance by the API to its first token (queue time included).",
            TTFT_BUCKETS)
        self.time_per_output_token = histogram(
            "rein:time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.", TPOT_BUCKETS)
        self.e2e_request_latency = histogram(
            "rein:e2e_request_latency_seconds",
            "Time from the job's acceptance by the API to its last token (queue time included).",
            REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "rein:request_inference_time_seconds",
            "Time from a worker claiming a job to its last token.", REQUEST_LATENCY_BUCKETS)
        self.step_duration = histogram(
            "rein:step_duration_seconds",
            "Duration of one engine step (schedule, forward, sample, detokenize).", STEP_BUCKETS)
        self.batch_size = histogram(
            "rein:batch_size", "Requests scheduled in one engine step.", BATCH_SIZE_BUCKETS)
        self.iteration_tokens = histogram(
            "rein:iteration_tokens_total",
            "Tokens (prefill chunks + decodes) computed in one engine step.",
            ITERATION_TOKENS_BUCKETS)
        # Per LoRA adapter (vLLM reports adapters through a gauge's labels; counters sum better).
        self.lora_requests = counter(
            "rein:lora_requests", "Jobs run under a LoRA adapter, by adapter and outcome (succeeded, failed, "
            "cancelled).", (*MODEL_LABEL, "lora_name", "status"))
        self.lora_prompt_tokens = counter(
            "rein:lora_prompt_tokens", "Prompt tokens of jobs run under a LoRA adapter.", (*MODEL_LABEL, "lora_name"))
        self.lora_generation_tokens = counter(
            "rein:lora_generation_tokens", "Tokens generated under a LoRA adapter.", (*MODEL_LABEL, "lora_name"))
        self._bind_children()
        self._engine: LLMEngine | None = None
        self._seen: tuple[int, float, int, int, int, int, int] = (0, 0.0, 0, 0, 0, 0, 0)
        self._server: Any = None

    def _bind_children(self) -> None:
        # Labelled children resolved once: the engine thread then pays one call per figure.
        name = self.model_name
        self._preemptions = self.num_preemptions.labels(name)
        self._prefix_queries = self.prefix_cache_queries.labels(name)
        self._prefix_hits = self.prefix_cache_hits.labels(name)
        self._prompt_tokens = self.prompt_tokens.labels(name)
        self._generation_tokens = self.generation_tokens.labels(name)
        self._finished = {reason: self.request_success.labels(name, reason)
                          for reason in FINISH_REASONS}
        self._queue_time = self.request_queue_time.labels(name)
        self._ttft = self.time_to_first_token.labels(name)
        self._tpot = self.time_per_output_token.labels(name)
        self._e2e = self.e2e_request_latency.labels(name)
        self._inference_time = self.request_inference_time.labels(name)
        self._step_duration = self.step_duration.labels(name)
        self._batch_size = self.batch_size.labels(name)
        self._iteration_tokens = self.iteration_tokens.labels(name)

    # -- the engine --------------------------------------------------------------------------

    def attach(self, engine: LLMEngine) -> None:
        """Read the gauges from `engine` at scrape time, and step deltas from its stats."""
        self._engine = engine
        name = self.model_name
        self.num_requests_running.labels(name).set_function(lambda: engine.num_running)
        self.num_requests_waiting.labels(name).set_function(lambda: engine.num_waiting)
        self.kv_cache_usage_perc.labels(name).set_function(lambda: engine.pool.usage)
        self._seen = self._totals(engine)

    @staticmethod
    def _totals(engine: LLMEngine) -> tuple[int, float, int, int, int, int, int]:
        stats = engine.stats
        return (stats.steps, stats.step_seconds, stats.preemptions, stats.scheduled_requests,
                stats.scheduled_tokens, stats.prefix_cache_queries, stats.prefix_cache_hits)

    def observe_step(self, outputs: Iterable[RequestOutput]) -> None:
        """The runner's on_step hook (engine thread): the steps since its last call, and their
        outputs."""
        generated = 0
        for output in outputs:
            new_tokens = len(output.new_token_ids)
            generated += new_tokens
            # The request's first token (of choice 0: an n > 1 request's prompt counts once).
            if new_tokens and output.num_output_tokens == new_tokens and output.index == 0:
                self._prompt_tokens.inc(output.num_prompt_tokens)
            if output.finished:
                child = self._finished.get(output.finish_reason or "abort")
                if child is not None:
                    child.inc()
        if generated:
            self._generation_tokens.inc(generated)
        if self._engine is None:
            return
        totals = self._totals(self._engine)
        steps, seconds, preemptions, requests, tokens, queries, hits = (
            now - before for now, before in zip(totals, self._seen, strict=True))
        self._seen = totals
        if preemptions:
            self._preemptions.inc(preemptions)
        if queries:
            self._prefix_queries.inc(queries)
        if hits:
            self._prefix_hits.inc(hits)
        # Usually one step; steps without outputs in between are observed at their mean.
        for _ in range(steps):
            self._step_duration.observe(seconds / steps)
            self._batch_size.observe(requests / steps)
            self._iteration_tokens.observe(tokens / steps)

    # -- requests (task threads) -------------------------------------------------------------

    def observe_queue_time(self, seconds: float) -> None:
        self._queue_time.observe(max(seconds, 0.0))

    def observe_request(self, *, accepted: float, claimed: float, first_token: float | None, finished: float,
                        num_output_tokens: int) -> None:
        """One finished request's latencies; times are time.monotonic() readings (`accepted`:
        when the API accepted the job, on this clock)."""
        self._e2e.observe(max(finished - accepted, 0.0))
        self._inference_time.observe(max(finished - claimed, 0.0))
        if first_token is None:
            return
        self._ttft.observe(max(first_token - accepted, 0.0))
        if num_output_tokens > 1:
            self._tpot.observe(max(finished - first_token, 0.0) / (num_output_tokens - 1))

    def observe_lora_job(self, lora_name: str, status: str, prompt_tokens: int, output_tokens: int) -> None:
        """One job run under LoRA adapter `lora_name` ended with `status` (task thread)."""
        name = self.model_name
        self.lora_requests.labels(name, lora_name, status).inc()
        self.lora_prompt_tokens.labels(name, lora_name).inc(prompt_tokens)
        self.lora_generation_tokens.labels(name, lora_name).inc(output_tokens)

    # -- serving -----------------------------------------------------------------------------

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve the registry at http://host:port/metrics from a daemon thread; OSError if the
        port is taken."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        log.info("worker metrics on http://%s:%d/metrics", host, port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def compose_hooks(*hooks: StepHook) -> StepHook:
    """One on_step hook calling each of `hooks` in order; one failing does not skip the rest."""

    def on_step(outputs: list[RequestOutput]) -> None:
        for hook in hooks:
            try:
                hook(outputs)
            except Exception:
                log.exception("on_step hook %s failed", getattr(hook, "__qualname__", hook))

    return on_step
