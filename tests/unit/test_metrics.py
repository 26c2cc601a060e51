"""The Prometheus metrics of the worker (rein.worker.metrics) and of the API
(rein.api.metrics), without services: exposed names, values fed by fake engine steps and
by a real tiny engine, the worker's metrics server, and the API middleware on a small app."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port

from rein.api.errors import install_error_handlers
from rein.api.metrics import APIMetrics, MetricsMiddleware
from rein.api.metrics import router as metrics_router
from rein.core.settings import Settings
from rein.engine.engine import EngineStats
from rein.engine.step_outputs import RequestOutput
from rein.jobs.errors import APIError
from rein.worker.metrics import WorkerMetrics, compose_hooks

WORKER_NAMES = {
    "rein:num_requests_running": "gauge", "rein:num_requests_waiting": "gauge",
    "rein:kv_cache_usage_perc": "gauge", "rein:num_preemptions": "counter",
    "rein:prompt_tokens": "counter", "rein:generation_tokens": "counter",
    "rein:request_success": "counter", "rein:request_queue_time_seconds": "histogram",
    "rein:time_to_first_token_seconds": "histogram", "rein:time_per_output_token_seconds": "histogram",
    "rein:e2e_request_latency_seconds": "histogram", "rein:request_inference_time_seconds": "histogram",
    "rein:step_duration_seconds": "histogram",
    "rein:batch_size": "histogram", "rein:iteration_tokens_total": "histogram",
    "rein:prefix_cache_queries": "counter", "rein:prefix_cache_hits": "counter",
}


def families(text: str) -> dict[str, str]:
    """Metric family name -> type, as a Prometheus server parses the exposition."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


# -- the worker ---------------------------------------------------------------------------------


@dataclass
class FakePool:
    usage: float = 0.0


@dataclass
class FakeEngine:
    """What WorkerMetrics reads of an LLMEngine."""

    num_running: int = 0
    num_waiting: int = 0
    pool: FakePool = field(default_factory=FakePool)
    stats: EngineStats = field(default_factory=EngineStats)

    def step(self, seconds: float, requests: int, tokens: int, preemptions: int = 0,
             prefix_queries: int = 0, prefix_hits: int = 0) -> None:
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        self.stats.scheduled_requests += requests
        self.stats.scheduled_tokens += tokens
        self.stats.preemptions += preemptions
        self.stats.prefix_cache_queries += prefix_queries
        self.stats.prefix_cache_hits += prefix_hits


def output(request_id: str, n_out: int, *, prompt: int = 5, finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, [100 + n_out], "x", finished=finish is not None, finish_reason=finish,
                         num_prompt_tokens=prompt, num_output_tokens=n_out)


def value(metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0


def test_worker_exposes_vllm_style_names_and_types():
    metrics = WorkerMetrics("tiny")
    metrics.attach(FakeEngine())
    text = generate_latest(metrics.registry).decode()
    found = families(text)
    for name, kind in WORKER_NAMES.items():
        assert found.get(name) == kind, f"{name}: {found.get(name)}"
    names = sample_names(text)
    for exposed in ("rein:num_preemptions_total", "rein:prompt_tokens_total", "rein:generation_tokens_total",
                    "rein:request_success_total", "rein:time_to_first_token_seconds_bucket",
                    "rein:iteration_tokens_total_bucket", "rein:batch_size_count"):
        assert exposed in names, exposed
    assert 'model_name="tiny"' in text
    # Every finish reason is there from the start (at 0), so rate() works from the first job.
    for reason in ("stop", "length", "abort"):
        assert metrics.registry.get_sample_value(
            "rein:request_success_total", {"model_name": "tiny", "finished_reason": reason}) == 0.0


def test_gauges_are_read_from_the_engine_when_scraped():
    engine = FakeEngine()
    metrics = WorkerMetrics("tiny")
    metrics.attach(engine)
    engine.num_running, engine.num_waiting, engine.pool.usage = 3, 2, 0.25
    assert value(metrics, "rein:num_requests_running") == 3
    assert value(metrics, "rein:num_requests_waiting") == 2
    assert value(metrics, "rein:kv_cache_usage_perc") == 0.25
    engine.num_running, engine.num_waiting, engine.pool.usage = 0, 0, 0.0
    assert value(metrics, "rein:kv_cache_usage_perc") == 0.0
    assert value(metrics, "rein:num_requests_running") == 0


def test_steps_move_tokens_finishes_and_step_histograms():
    engine = FakeEngine()
    engine.step(0.5, 9, 999)           # before attach: not this worker's business
    metrics = WorkerMetrics("tiny")
    metrics.attach(engine)

    engine.step(0.010, 2, 12, prefix_queries=12)   # prefill of a (5 tokens) and b (7): both sample a first token
    metrics.observe_step([output("a", 1, prompt=5), output("b", 1, prompt=7)])
    engine.step(0.004, 2, 2, preemptions=1)
    metrics.observe_step([output("a", 2, finish="length"), output("b", 2)])
    engine.step(0.002, 1, 1, prefix_queries=32, prefix_hits=16)   # a request that found 16 cached
    metrics.observe_step([output("b", 3, prompt=7, finish="stop")])
    # An aborted request's final output carries no token and counts as an abort.
    metrics.observe_step([RequestOutput("c", [], "", finished=True, finish_reason="abort",
                                        num_prompt_tokens=4, num_output_tokens=0)])

    assert value(metrics, "rein:prompt_tokens_total") == 12          # 5 + 7, once each
    assert value(metrics, "rein:generation_tokens_total") == 5
    assert value(metrics, "rein:num_preemptions_total") == 1
    assert value(metrics, "rein:prefix_cache_queries_total") == 44
    assert value(metrics, "rein:prefix_cache_hits_total") == 16
    assert value(metrics, "rein:request_success_total", finished_reason="length") == 1
    assert value(metrics, "rein:request_success_total", finished_reason="stop") == 1
    assert value(metrics, "rein:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "rein:step_duration_seconds_count") == 3
    assert value(metrics, "rein:step_duration_seconds_sum") == pytest.approx(0.016)
    assert value(metrics, "rein:batch_size_sum") == 5
    assert value(metrics, "rein:batch_size_bucket", le="1.0") == 1
    assert value(metrics, "rein:iteration_tokens_total_sum") == 15
    assert value(metrics, "rein:iteration_tokens_total_bucket", le="8.0") == 2


def test_steps_without_outputs_are_observed_at_their_mean_by_the_next_hook():
    engine = FakeEngine()
    metrics = WorkerMetrics("tiny")
    metrics.attach(engine)
    engine.step(0.030, 1, 64)          # a prefill chunk: no token sampled, so no hook call
    engine.step(0.010, 1, 16)          # the last chunk samples the first token
    metrics.observe_step([output("a", 1, prompt=80)])
    assert value(metrics, "rein:step_duration_seconds_count") == 2
    assert value(metrics, "rein:step_duration_seconds_sum") == pytest.approx(0.040)
    assert value(metrics, "rein:iteration_tokens_total_sum") == 80
    assert value(metrics, "rein:prompt_tokens_total") == 80


def test_request_latencies_count_from_acceptance_as_vllm_does():
    """TTFT and end-to-end latency start when the API accepted the job (vLLM: arrival), so
    queue time is inside them; inference time is the worker's part alone."""
    metrics = WorkerMetrics("tiny")
    metrics.observe_queue_time(2.0)
    metrics.observe_request(accepted=8.0, claimed=10.0, first_token=10.5, finished=12.5, num_output_tokens=5)
    metrics.observe_request(accepted=20.0, claimed=20.0, first_token=20.1, finished=20.1, num_output_tokens=1)
    metrics.observe_request(accepted=29.0, claimed=30.0, first_token=None, finished=30.2, num_output_tokens=0)
    assert value(metrics, "rein:request_queue_time_seconds_sum") == 2.0
    assert value(metrics, "rein:time_to_first_token_seconds_count") == 2
    assert value(metrics, "rein:time_to_first_token_seconds_sum") == pytest.approx(2.5 + 0.1)
    # (12.5 - 10.5) / 4 gaps; a one-token request has no gap to time.
    assert value(metrics, "rein:time_per_output_token_seconds_count") == 1
    assert value(metrics, "rein:time_per_output_token_seconds_sum") == pytest.approx(0.5)
    assert value(metrics, "rein:e2e_request_latency_seconds_count") == 3
    assert value(metrics, "rein:e2e_request_latency_seconds_sum") == pytest.approx(4.5 + 0.1 + 1.2)
    assert value(metrics, "rein:request_inference_time_seconds_sum") == pytest.approx(2.5 + 0.1 + 0.2)


def test_composed_hooks_all_run_when_one_fails():
    seen = []

    def broken(outputs):
        raise RuntimeError("publisher down")

    hook = compose_hooks(broken, seen.append)
    hook([output("a", 1)])
    assert len(seen) == 1




def test_worker_serves_its_registry_on_its_port_and_refuses_a_taken_one():
    engine = FakeEngine(num_running=1)
    first, second = WorkerMetrics("tiny"), WorkerMetrics("tiny")   # two registries in one process
    first.attach(engine)
    port = free_port()
    first.serve(port, host="127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'rein:num_requests_running{model_name="tiny"} 1.0' in text
        with pytest.raises(OSError):
            second.serve(port, host="127.0.0.1")
    finally:
        first.stop()


def test_a_real_engine_step_by_step(tiny_models):
    """Through EngineClient's hook: counts equal what the requests got, KV usage returns to 0."""
    from rein.engine import EngineClient, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="4MiB",
                                    max_model_len=256))
    metrics = WorkerMetrics("tiny")
    metrics.attach(engine)
    prompts = [[3 + i] * (5 + 3 * i) for i in range(4)]
    with EngineClient(engine, on_step=metrics.observe_step) as runner:
        streams = [runner.submit(f"r{i}", prompt, SamplingParams(max_tokens=4 + i, temperature=0,
                                                                 ignore_eos=True))
                   for i, prompt in enumerate(prompts)]
        finals = [[o for o in stream][-1] for stream in streams]
    assert value(metrics, "rein:generation_tokens_total") == sum(f.num_output_tokens for f in finals) == 22
    assert value(metrics, "rein:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert value(metrics, "rein:request_success_total", finished_reason="length") == 4
    assert value(metrics, "rein:step_duration_seconds_count") == engine.stats.steps
    assert value(metrics, "rein:batch_size_sum") == engine.stats.scheduled_requests
    assert value(metrics, "rein:batch_size_bucket", le="1.0") < engine.stats.steps   # batched
    assert value(metrics, "rein:kv_cache_usage_perc") == 0.0
    assert value(metrics, "rein:num_requests_running") == 0


# -- the API ------------------------------------------------------------------------------------

KEY = "rein_0123456789ab_" + "S" * 43


def _api(settings: Settings) -> TestClient:
    """A small app with the real middleware, error handlers and /metrics route (no lifespan)."""
    app = FastAPI()
    install_error_handlers(app)
    app.state.settings = settings
    app.state.metrics = APIMetrics(settings)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.include_router(metrics_router)

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request) -> dict:
        if job_id == "limited":
            raise APIError(429, "Rate limit reached on tokens per min (TPM)", type="tokens",
                           code="rate_limit_exceeded", headers={"Retry-After": "3"})
        if job_id == "busy":
            raise APIError(429, "something else", code="slow_down")
        if job_id == "broken":
            raise RuntimeError("bug")
        return {"id": job_id}

    return TestClient(app, raise_server_exceptions=False)


def test_api_middleware_counts_by_route_template_and_status():
    client = _api(Settings(models="tiny=/m", metrics_public=True))   # (no key store here)
    for job_id in ("a", "b", "c"):
        assert client.get(f"/v1/jobs/{job_id}").status_code == 200
    assert client.get("/v1/jobs/limited", headers={"Authorization": f"Bearer {KEY}"}).status_code == 429
    assert client.get("/v1/jobs/busy", headers={"Authorization": f"Bearer {KEY}"}).status_code == 429
    assert client.get("/v1/jobs/broken").status_code == 500
    assert client.get("/nowhere/at/all").status_code == 404
    assert client.post("/v1/jobs/a").status_code == 405

    text = client.get("/metrics").text
    registry = client.app.state.metrics.registry

    def requests(route: str, method: str, status: str) -> float:
        return registry.get_sample_value(
            "rein:api_requests_total", {"route": route, "method": method, "status": status}) or 0.0

    assert requests("/v1/jobs/{job_id}", "GET", "200") == 3
    assert requests("/v1/jobs/{job_id}", "GET", "429") == 2
    assert requests("/v1/jobs/{job_id}", "GET", "500") == 1
    assert requests("/v1/jobs/{job_id}", "POST", "405") == 1
    assert requests("unmatched", "GET", "404") == 1
    assert registry.get_sample_value("rein:api_request_duration_seconds_count",
                                     {"route": "/v1/jobs/{job_id}"}) == 7
    # Only the rate-limit 429 is a rate-limit refusal; the key id labels it, the secret never appears.
    assert registry.get_sample_value("rein:api_rate_limited_total",
                                     {"key_id": "0123456789ab", "kind": "tokens"}) == 1
    assert "S" * 43 not in text and "/v1/jobs/a" not in text
    assert families(text)["rein:api_requests"] == "counter"
    assert "rein:api_requests_total" in sample_names(text)
    assert families(text)["rein:api_request_duration_seconds"] == "histogram"


def test_worker_metrics_port_setting_and_flag(monkeypatch, capsys):
    from rein.cli.main import main
    from rein.core.settings import get_settings

    assert Settings(worker_metrics_port=0).worker_metrics_port == 0          # 0: serve none
    with pytest.raises(ValueError):
        Settings(worker_metrics_port=70000)
    monkeypatch.setenv("REIN_MODELS", "tiny=/nowhere")
    get_settings.cache_clear()
    try:
        assert main(["worker", "--metrics-port", "70000"]) == 2
    finally:
        get_settings.cache_clear()
    assert "--metrics-port must be 0 (none) to 65535, got 70000" in capsys.readouterr().err
