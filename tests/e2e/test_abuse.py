"""End to end: one tenant cannot hurt another (`rein api` + `rein worker` on a tiny model, see
e2e_support; one stack for the module).

- Tenant A's requests with token ids outside the vocabulary (even past int4, where Postgres
  would refuse the row) each get a 400 naming the parameter, while tenant B's requests sent
  with them in the same moments all succeed: no 5xx anywhere.
- One key filling its share of a model's queue (REIN_TENANT_QUEUE_SHARE of
  REIN_MAX_QUEUE_DEPTH, 429 `tenant_queue_full`) leaves room for another tenant.
- 1,000 SSE followers (GET /v1/jobs/{id}/events) on one API process, from one event loop,
  all open at once on 50 running jobs: every stream ends with its final event and the
  stored text, chat completions sent meanwhile keep answering, and a key holding
  REIN_MAX_STREAMS_PER_KEY streams gets 429 `too_many_streams` for one more. The figures
  (time to open all, to complete all, CPU while they wait, latencies) are printed for notes.
- A 50 MB body is refused before it is read (REIN_MAX_REQUEST_BYTES, 413; 401 without a key).
- Eight 15 MB bodies at once from a valid key without the route's scope: each 403 before its
  body is read; from a key with the scope: each refused (400 unparsed, or 429 past the key's
  large-body slots), with the API's peak resident memory bounded.

File descriptors: 1,000 streams are 1,000 sockets in this process and about 2,000 in the
API's (a client socket and, while it reads, a Redis connection per follower). The module's
fixture raises this process's soft RLIMIT_NOFILE to NOFILE_NEEDED (within the hard limit)
before the service starts, so the API and worker, which inherit it, get it too, and puts it
back at the end; it skips if the hard limit is lower.

The worker is paused (SIGSTOP, always resumed) where a test needs jobs to stay queued, for
a second or two (under the reaper's REIN_REQUEUE_UNCLAIMED_SECONDS), and, in the followers'
test, with its jobs running while 1,000 followers open: REIN_LEASE_SECONDS is raised so
that their leases outlast the pause. The followers open on jobs that have started (their
streams exist): a follower of a job still queued asks Postgres about it after every idle
XREAD block (2 s), and 1,000 of those swamp a 2-core API.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import resource
import select
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from e2e_support import MODEL, REIN, REPO, Service, result_text, run_service, submit
from support import wait_for

pytestmark = pytest.mark.slow

QUEUE_DEPTH = 64             # REIN_MAX_QUEUE_DEPTH: each tenant's share (0.5) is 32 queued jobs
TENANT_SHARE = QUEUE_DEPTH // 2
STREAMS_PER_KEY = 500        # REIN_MAX_STREAMS_PER_KEY: the followers of one key, exactly
FOLLOW_JOBS = 50             # 25 per tenant ...
FOLLOWERS_PER_JOB = 20       # ... 500 followers per key, 1,000 in all
# Long enough that no job can end between the last job's first event and the worker's pause
# (the test reads that event through the API, then stops the worker): at 64 tokens a loaded
# CI machine lost that race (the tiny model's steps are a few milliseconds).
JOB_TOKENS = 192
MAX_NUM_SEQS = 64            # the worker runs all FOLLOW_JOBS at once
NOFILE_NEEDED = 4096
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < NOFILE_NEEDED:
        pytest.skip(f"1,000 streams need {NOFILE_NEEDED} file descriptors; the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < NOFILE_NEEDED:
        resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE_NEEDED, hard))
    try:
        with run_service(tmp_path_factory.mktemp("abuse"), tiny_models("llama"), extra_env={
                "REIN_MAX_QUEUE_DEPTH": str(QUEUE_DEPTH),
                "REIN_MAX_STREAMS_PER_KEY": str(STREAMS_PER_KEY),
                "REIN_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
                # The worker is paused with jobs running: their leases must outlast the pause.
                "REIN_LEASE_SECONDS": "300"}) as svc:
            yield svc
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _async_client(service: Service, tenant: str, connections: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=service.base_url, timeout=TIMEOUT,
        headers={"Authorization": f"Bearer {service.keys[tenant]}"},
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def _wait_idle(service: Service) -> None:
    """Until the worker's heartbeat shows nothing running or waiting (earlier tests' jobs done)."""
    def idle() -> bool:
        beat = service.heartbeat()
        return bool(beat) and beat["running"] == 0 and beat["waiting"] == 0

    wait_for(idle, 60, "the worker to be idle", interval=0.2)


@contextmanager
def _worker_paused(service: Service) -> Iterator[None]:
    """SIGSTOP the worker for the block, SIGCONT after it whatever happens."""
    service.worker.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        service.worker.send_signal(signal.SIGCONT)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _open_files_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return line.split()[3]
    return "?"


# -- tests ------------------------------------------------------------------------------------


BAD_REQUESTS = [   # (endpoint, body, the parameter the 400 must name)
    ("/v1/completions", {"prompt": [2**40], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [10**6], "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 2**31]], "max_tokens": 4}, "prompt"),   # past int4
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/jobs", {"endpoint": "/v1/completions", "body": {"model": MODEL, "prompt": [2**40]}}, "prompt"),
]


def test_a_tenants_bad_token_ids_fail_only_its_own_requests(service: Service) -> None:
    """40 requests of tenant A with token ids no model has, 24 valid ones of tenant B, all at once:
    every A request is a 400 naming its parameter, every B request succeeds."""
    async def run() -> tuple[list[tuple[str, httpx.Response]], list[httpx.Response]]:
        async with _async_client(service, "a") as a, _async_client(service, "b") as b:
            async def bad(i: int) -> tuple[str, httpx.Response]:
                endpoint, body, param = BAD_REQUESTS[i % len(BAD_REQUESTS)]
                body = body if endpoint == "/v1/jobs" else {"model": MODEL, **body}
                return param, await a.post(endpoint, json=body)

            async def good(i: int) -> httpx.Response:
                if i % 3 == 0:
                    return await b.post("/v1/chat/completions", json={
                        "model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
                        "max_tokens": 4, "temperature": 0.0})
                return await b.post("/v1/completions", json={
                    "model": MODEL, "prompt": [1, 2, 3 + i] if i % 3 == 1 else f"story {i}",
                    "max_tokens": 4, "temperature": 0.0})

            # Interleaved, so the intake commits A's and B's requests in the same groups.
            requests = []
            for i in range(40):
                requests.append(bad(i))
                if i < 24:
                    requests.append(good(i))
            results = await asyncio.gather(*requests)
            return ([r for r in results if isinstance(r, tuple)],
                    [r for r in results if isinstance(r, httpx.Response)])

    started = time.monotonic()
    bad_answers, good_answers = asyncio.run(run())
    print(f"\nbad token ids: {len(bad_answers)} refused, {len(good_answers)} valid requests served "
          f"in {time.monotonic() - started:.1f} s")
    assert len(bad_answers) == 40 and len(good_answers) == 24
    for param, response in bad_answers:
        assert response.status_code == 400, (param, response.status_code, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    for response in good_answers:
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length"), choice


def test_one_key_filling_its_queue_share_leaves_room_for_another_tenant(service: Service) -> None:
    _wait_idle(service)
    a_ids: list[str] = []
    with service.client("a") as a, service.client("b") as b:
        with _worker_paused(service):
            for i in range(TENANT_SHARE):
                a_ids.append(submit(a, {"prompt": f"fill {i}", "max_tokens": 2, "temperature": 0.0}))
            refused = a.post("/v1/jobs", json={"endpoint": "/v1/completions",
                                               "body": {"model": MODEL, "prompt": "one more", "max_tokens": 2}})
            assert refused.status_code == 429, refused.text
            assert refused.headers.get("Retry-After", "").isdigit()
            error = refused.json()["error"]
            assert error["code"] == "tenant_queue_full" and "REIN_TENANT_QUEUE_SHARE" in error["message"]
            b_id = submit(b, {"prompt": "room for me", "max_tokens": 2, "temperature": 0.0})
        assert service.wait_job(b, b_id)["status"] == "succeeded"
        for job_id in a_ids:
            assert service.wait_job(a, job_id)["status"] == "succeeded"
        # The share is held by queued jobs only: once they ran, A is admitted again.
        assert service.wait_job(a, submit(a, {"prompt": "again", "max_tokens": 2}))["status"] == "succeeded"


async def _follow(client: httpx.AsyncClient, job_id: str, opened: list[float],
                  first_event: asyncio.Event | None = None) -> list[dict]:
    """The events of one job's stream, to its final one; appends when its response started."""
    events: list[dict] = []
    async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
        assert response.status_code == 200, (await response.aread()).decode()
        opened.append(time.monotonic())
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                data = json.loads(line[5:])
                events.append(data)
                if first_event is not None:
                    first_event.set()
                if data.get("finish_reason") is not None or data.get("error") is not None:
                    break
    return events


def test_a_thousand_followers_on_one_api_process(service: Service) -> None:
    """50 jobs run, the worker is paused after their first events, 1,000 followers open (20 a
    job, 500 a key), the worker resumes: every follower gets the whole text."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(f"\nRLIMIT_NOFILE soft: test process {soft}, api process {_open_files_limit(service.api.pid)}")
    _wait_idle(service)
    tenants = ("a", "b")
    followers = FOLLOW_JOBS * FOLLOWERS_PER_JOB
    chat_body = {"model": MODEL, "messages": [{"role": "user", "content": "Are you there?"}],
                 "max_tokens": 8, "temperature": 0.0}

    async def run() -> dict:
        clients = {t: _async_client(service, t, connections=STREAMS_PER_KEY + 8) for t in tenants}
        figures: dict = {}
        try:
            t0 = time.monotonic()
            baseline = await clients["a"].post("/v1/chat/completions", json=chat_body)
            assert baseline.status_code == 200, baseline.text
            figures["chat_idle"] = time.monotonic() - t0

            jobs: dict[str, str] = {}   # job id -> tenant, in the order sent
            opened: list[float] = []
            tasks: dict[asyncio.Future, str] = {}
            with _worker_paused(service):
                for i in range(FOLLOW_JOBS):
                    tenant = tenants[i % 2]
                    response = await clients[tenant].post("/v1/jobs", json={
                        "endpoint": "/v1/completions",
                        "body": {"model": MODEL, "prompt": f"Once upon a time {i}", "max_tokens": JOB_TOKENS,
                                 "temperature": 0.0, "ignore_eos": True}})
                    assert response.status_code == 202, response.text
                    jobs[response.json()["id"]] = tenant
                # One follower of the last job sent: its first event means the worker has started
                # every job (it takes them in order, and batches them all).
                last_job = next(reversed(jobs))
                first_event = asyncio.Event()
                tasks[asyncio.ensure_future(_follow(clients[jobs[last_job]], last_job, opened, first_event))] = \
                    last_job
            await asyncio.wait_for(first_event.wait(), 60)
            with _worker_paused(service):
                started = time.monotonic()
                for job_id, tenant in jobs.items():
                    for _ in range(FOLLOWERS_PER_JOB - (job_id == last_job)):
                        tasks[asyncio.ensure_future(_follow(clients[tenant], job_id, opened))] = job_id

                async def all_open() -> None:
                    while len(opened) < followers:
                        failed = [t for t in tasks if t.done() and t.exception()]
                        if failed:
                            raise failed[0].exception()
                        await asyncio.sleep(0.05)

                await asyncio.wait_for(all_open(), 90)
                figures["open_all"] = max(opened) - started
                figures["open_p50"] = sorted(opened)[len(opened) // 2] - started
                figures["open_at_once"] = sum(not t.done() for t in tasks)
                assert figures["open_at_once"] == followers, "a job ended before the worker was paused"
                # What 1,000 idle followers cost (each XREAD blocks 2 s, then a keepalive).
                api_before, own_before, t0 = _cpu_seconds(service.api.pid), time.process_time(), time.monotonic()
                await asyncio.sleep(3)
                window = time.monotonic() - t0
                figures["api_cpu"] = (_cpu_seconds(service.api.pid) - api_before) / window
                figures["own_cpu"] = (time.process_time() - own_before) / window
                # While all are open: the API answers, and a stream more of a key that holds
                # REIN_MAX_STREAMS_PER_KEY is refused.
                async with httpx.AsyncClient(base_url=service.base_url, timeout=30, headers={
                        "Authorization": f"Bearer {service.keys['a']}"}) as extra:
                    figures["models_while_open"] = []
                    for _ in range(3):
                        t0 = time.monotonic()
                        assert (await extra.get("/v1/models")).status_code == 200
                        figures["models_while_open"].append(time.monotonic() - t0)
                    one_more = await extra.get(f"/v1/jobs/{next(iter(jobs))}/events")
                assert one_more.status_code == 429, one_more.text
                assert one_more.json()["error"]["code"] == "too_many_streams"
                resumed = time.monotonic()

            # The worker runs again: chat completions meanwhile, one after another, until all end.
            chats: list[float] = []

            async def chat_loop() -> None:
                n = 0
                while not all(t.done() for t in tasks) or n < 3:
                    t0 = time.monotonic()
                    answer = await clients[tenants[n % 2]].post("/v1/chat/completions", json=chat_body)
                    assert answer.status_code == 200, answer.text
                    chats.append(time.monotonic() - t0)
                    n += 1

            chatting = asyncio.ensure_future(chat_loop())
            done, _ = await asyncio.wait(tasks, timeout=90)
            figures["complete_all"] = time.monotonic() - resumed
            assert len(done) == followers, f"{followers - len(done)} streams did not end in 90 s"
            await asyncio.wait_for(chatting, 90)
            figures["chats"] = chats
            figures["streams"] = {job_id: [] for job_id in jobs}
            for task, job_id in tasks.items():
                figures["streams"][job_id].append(task.result())
            figures["stored"] = {job_id: (await clients[tenant].get(f"/v1/jobs/{job_id}")).json()
                                 for job_id, tenant in jobs.items()}
        finally:
            for client in clients.values():
                await client.aclose()
        return figures

    figures = asyncio.run(run())
    chats = figures["chats"]
    print(f"{followers} followers ({FOLLOW_JOBS} jobs x {FOLLOWERS_PER_JOB}, {JOB_TOKENS} tokens each, worker "
          f"paused): all open in {figures['open_all']:.1f} s (median {figures['open_p50']:.1f} s), "
          f"{figures['open_at_once']} open at once; GET /v1/models then {', '.join(f'{t * 1000:.0f}' for t in figures['models_while_open'])} ms; "
          f"all complete {figures['complete_all']:.1f} s after the worker resumed")
    print(f"while all {followers} wait: api process CPU {figures['api_cpu']:.0%}, this test process "
          f"{figures['own_cpu']:.0%} (of one core)")
    print(f"chat completion (8 tokens): idle {figures['chat_idle']:.2f} s; meanwhile {len(chats)} sent, "
          f"max {max(chats):.2f} s, mean {sum(chats) / len(chats):.2f} s")
    for job_id, streams in figures["streams"].items():
        job = figures["stored"][job_id]
        assert job["status"] == "succeeded", job
        text = result_text(job)
        assert len(streams) == FOLLOWERS_PER_JOB
        for events in streams:
            assert events[-1].get("finish_reason") == "length", events[-1]
            assert "".join(e["text"] for e in events) == text, job_id
    assert max(chats) < 60, chats


BIG_BODY = 50 * 1024 * 1024
CHUNK = 1024 * 1024


def _send_big_body(service: Service, *, chunked: bool, key: str | None = None) -> tuple[int, dict, int]:
    """POST /v1/chat/completions announcing a 50 MB body, sent 1 MiB at a time until the
    response comes: (status, error, bytes of the body sent by then)."""
    host, port = service.base_url.removeprefix("http://").split(":")
    head = ["POST /v1/chat/completions HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    head.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {BIG_BODY}")
    if key:
        head.append(f"Authorization: Bearer {key}")
    piece = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (CHUNK - 60)
    piece = piece.ljust(CHUNK, b"x")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        sent = 0
        try:
            while sent < BIG_BODY and not select.select([sock], [], [], 0.05)[0]:
                data = piece if sent == 0 else b"x" * CHUNK
                sock.sendall(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                sent += len(data)
        except OSError:     # the server answered and closed while the body was still coming
            pass
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())["error"], sent


def test_a_fifty_megabyte_body_is_refused_before_it_is_read(service: Service) -> None:
    """REIN_MAX_REQUEST_BYTES (16 MiB): a 50 MB body is refused at once when its Content-Length
    says so, key or not; without a key, a chunked one is refused (401) before its body is read;
    with a key, a chunked one is refused (413) as soon as it passes the limit."""
    status, error, sent = _send_big_body(service, chunked=False)
    assert status == 413 and error["code"] == "request_too_large", error
    assert "REIN_MAX_REQUEST_BYTES" in error["message"]
    assert sent <= 2 * CHUNK, f"{sent} bytes sent before the 413"
    status, error, sent = _send_big_body(service, chunked=True)
    assert status == 401 and error["code"] == "invalid_api_key", error
    assert sent <= 2 * CHUNK, f"{sent} bytes sent before the 401"
    status, error, sent = _send_big_body(service, chunked=True, key=service.keys["a"])
    assert status == 413 and error["code"] == "request_too_large", error
    assert sent < BIG_BODY, "the whole body was read before the 413"
    print(f"\nchunked 50 MB body with a key: 413 after {sent / CHUNK:.0f} MiB sent")
    with service.client("b") as b:    # and the API serves on
        assert b.get("/v1/models").status_code == 200


FLOOD_BODY = b"[" + b"[]," * (5_000_000 - 1) + b"[]]"    # 15 MB; 399 MiB per 16 MiB when it was parsed
FLOOD_SENDERS = 8
FLOOD_PEAK_GROWTH_MB = 400


def _create_key(service: Service, tenant: str, scopes: str) -> str:
    import subprocess

    created = subprocess.run([*REIN, "keys", "create", "--name", f"flood-{scopes}", "--tenant", tenant,
                              "--scopes", scopes], env=service.env, cwd=REPO, capture_output=True, text=True,
                             timeout=120, check=True)
    return created.stdout.strip().splitlines()[-1]


def _send_flood_body(service: Service, key: str) -> tuple[int, int]:
    """POST the 15 MB body 1 MiB at a time until the response comes: (status, bytes sent by then)."""
    host, port = service.base_url.removeprefix("http://").split(":")
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(FLOOD_BODY)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        sent = 0
        try:
            # 50 ms for an answer after each MiB: the refusal comes before the body is read, but on a
            # loaded machine (8 senders, CI's other workers) it can take some tens of ms to come.
            while sent < len(FLOOD_BODY) and not select.select([sock], [], [], 0.05)[0]:
                sock.sendall(FLOOD_BODY[sent:sent + CHUNK])
                sent += min(CHUNK, len(FLOOD_BODY) - sent)
        except OSError:
            pass
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, sent


def _memory_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def test_eight_fifteen_megabyte_bodies_from_valid_keys(service: Service) -> None:
    """Without the scope, each body is refused (403) after at most a few MiB of it were sent;
    with it, each is refused unparsed (400) or past the key's slots (429), and the API's peak
    resident memory grows by less than FLOOD_PEAK_GROWTH_MB (it grew by 1.7-3.1 GB before)."""
    usage_only = _create_key(service, "flood", "usage")
    scoped = _create_key(service, "flood", "inference")
    pid = service.api.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")     # VmHWM back to VmRSS (we own the process)
    before = _memory_mb(pid, "VmRSS")
    with ThreadPoolExecutor(FLOOD_SENDERS) as pool:
        refused = list(pool.map(lambda _: _send_flood_body(service, usage_only), range(FLOOD_SENDERS)))
    assert {status for status, _ in refused} == {403}, refused
    # A few MiB at most of the 15 (once at 4 with the answer taking longer than 10 ms under load).
    assert max(sent for _, sent in refused) <= 4 * CHUNK, refused
    with ThreadPoolExecutor(FLOOD_SENDERS) as pool:
        answered = list(pool.map(lambda _: _send_flood_body(service, scoped), range(FLOOD_SENDERS)))
    assert {status for status, _ in answered} <= {400, 429} and 400 in {s for s, _ in answered}, answered
    growth = _memory_mb(pid, "VmHWM") - before
    print(f"\neight 15 MB bodies: without the scope {[s for s, _ in refused]}, with it "
          f"{[s for s, _ in answered]}; API peak RSS +{growth:.0f} MB over {before:.0f} MB")
    assert growth < FLOOD_PEAK_GROWTH_MB
    with service.client("b") as b:
        assert b.get("/v1/models").status_code == 200
