"""End to end: the Prometheus metrics of `rein worker` (its own port) and `rein api`
(GET /metrics) move as the jobs run. The counts must equal what the jobs report: finished
requests, prompt and generation tokens; the engine's gauges return to 0 once it idles."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2e_support import MODEL, Service, run_service, submit
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, wait_for

pytestmark = pytest.mark.slow

NUM_JOBS = 12




@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models, metrics_port) -> Iterator[Service]:
    with run_service(tmp_path_factory.mktemp("e2e-metrics"), tiny_models("llama"), scopes="inference,usage,admin",
                     extra_env={"REIN_WORKER_METRICS_PORT": str(metrics_port)}) as svc:
        yield svc


def scrape(url: str, key: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Sample name -> [(labels, value)], parsed as Prometheus parses the exposition (the API's
    with a key holding the `admin` scope)."""
    response = httpx.get(url, timeout=10, headers={"Authorization": f"Bearer {key}"} if key else {})
    assert response.status_code == 200, response.text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def total(samples, name: str, **labels: str) -> float:
    return sum(value for sample_labels, value in samples.get(name, [])
               if all(sample_labels.get(k) == v for k, v in labels.items()))


def test_worker_and_api_metrics_follow_the_jobs(service: Service, metrics_port: int) -> None:
    worker_url = f"http://127.0.0.1:{metrics_port}/metrics"
    before = scrape(worker_url)
    assert total(before, "rein:request_success_total") == 0
    assert total(before, "rein:kv_cache_usage_perc", model_name=MODEL) == 0

    with service.client("a") as client:
        def run(i: int) -> dict:
            body = {"prompt": f"metrics job {i}", "max_tokens": 4 + i % 7, "temperature": 0.0}
            if i % 3 == 0:
                body["ignore_eos"] = True
            return service.wait_job(client, submit(client, body))

        with ThreadPoolExecutor(max_workers=NUM_JOBS) as pool:
            jobs = list(pool.map(run, range(NUM_JOBS)))
        assert all(job["status"] == "succeeded" for job in jobs), jobs
        usage = client.get("/v1/usage").raise_for_status().json()["data"]
        assert httpx.get(f"{service.base_url}/v1/models", timeout=10).status_code == 401

    completion_tokens = sum(job["usage"]["completion_tokens"] for job in jobs)
    prompt_tokens = sum(job["usage"]["prompt_tokens"] for job in jobs)
    assert completion_tokens == sum(bucket["completion_tokens"] for bucket in usage)

    def idle() -> dict | None:
        samples = scrape(worker_url)
        engine_busy = (total(samples, "rein:kv_cache_usage_perc") + total(samples, "rein:num_requests_running")
                       + total(samples, "rein:num_requests_waiting"))
        return samples if engine_busy == 0 else None

    after = wait_for(idle, 30, "the worker's KV cache usage and running requests back to 0")
    finished = {labels["finished_reason"]: value for labels, value in after["rein:request_success_total"]}
    assert sum(finished.values()) == NUM_JOBS, finished
    assert finished["abort"] == 0
    assert finished["length"] >= NUM_JOBS // 3          # the ignore_eos jobs run to max_tokens
    assert total(after, "rein:generation_tokens_total", model_name=MODEL) == completion_tokens
    assert total(after, "rein:prompt_tokens_total", model_name=MODEL) == prompt_tokens
    for histogram in ("rein:request_queue_time_seconds", "rein:time_to_first_token_seconds",
                      "rein:e2e_request_latency_seconds"):
        assert total(after, f"{histogram}_count") == NUM_JOBS, histogram
    steps = total(after, "rein:step_duration_seconds_count")
    assert steps >= max(job["usage"]["completion_tokens"] for job in jobs)
    assert total(after, "rein:batch_size_count") == steps
    assert total(after, "rein:step_duration_seconds_sum") > 0

    api = scrape(f"{service.base_url}/metrics", service.keys["a"])
    assert total(api, "rein:api_requests_total", route="/v1/jobs", method="POST", status="202") == NUM_JOBS
    assert total(api, "rein:api_requests_total", route="/v1/jobs/{job_id}", method="GET",
                 status="200") >= NUM_JOBS
    assert total(api, "rein:api_requests_total", route="/v1/models", status="401") == 1
    assert total(api, "rein:api_request_duration_seconds_count", route="/v1/jobs") == NUM_JOBS
    assert total(api, "rein:queue_depth", model_name=MODEL) == 0
    assert {labels["priority"] for labels, _ in api["rein:queue_depth"]} >= {"interactive", "batch"}
