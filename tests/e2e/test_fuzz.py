"""Fuzzing the live API from its OpenAPI schema with Schemathesis.

`rein api` and `rein worker` run on a tiny model (e2e_support); the Schemathesis CLI
reads /openapi.json and sends every operation generated requests, both valid ones
(positive) and ones that break the schema (negative: wrong types, missing or extra
fields, out-of-range numbers, NUL characters in strings), with a key that holds every
scope. Two properties must hold on every request:

- `not_a_server_error`: no 5xx. Bad input is the client's fault: a 4xx naming the
  parameter, never an exception surfacing as a 500.
- `negative_data_rejection`: a request that violates the schema is refused (4xx), not
  silently accepted (e.g. a `start` that is not a date on GET /v1/usage).

Random data alone seldom reaches what broke the API before, so the run's config
(`_config`) also draws, now and then, known-bad values (text with NUL, integers past 32 and
64 bits, extreme floats) for the fields that reach Postgres or the engine, and real ids for
the object parameters. The checks themselves are Schemathesis's, unmodified.

Schemathesis draws values of a field's own shape and size; what broke the API's memory and
stack was bodies far larger or deeper than any schema says. `test_large_and_deep_bodies`
sends those too, from Hypothesis strategies of its own (derandomized): arrays and objects a
few thousand levels deep, arrays of up to two million small values, strings of up to 15 MB,
each put in a field of a valid request of every JSON operation. Every answer must be a 4xx
(or a 2xx, where the request still fits), and the API must go on answering.

The run is reproducible: a fixed seed, a fixed number of examples per operation, one
worker thread, and no time-based repetition (`--max-time` would make the number of cases
depend on the machine's speed). The phases are examples, coverage (every schema boundary,
positive and negative) and fuzzing; not stateful, which needs OpenAPI links the schema
does not declare. Schemathesis takes about 75 s of the test's ~100 s on a laptop CPU (the
synchronous completions really generate tokens). On failure the assertion shows its
summary, which lists each failing case with a `curl` line to reproduce it (add the
Authorization header printed in the message), and the paths of its JUnit and NDJSON
reports and of the config, kept under pytest's tmp dir (with the crash cache that
`st replay <case id>`, run there, reads).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e_support import MODEL, Service, run_service, submit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

SEED = 20240601
# Per operation and phase; with ~20 operations this keeps the whole run near a minute.
MAX_EXAMPLES = 40
# One at a time: Schemathesis 4.32's coverage phase is not thread-safe (with --workers 4 it
# fails with "AST constructor recursion depth mismatch" in its own code).
WORKERS = 1
# The served context: a chat completion without max_tokens generates up to the rest of it,
# and the synchronous ones wait for every token. 128 keeps the run near a minute.
CONTEXT = 128
RUN_TIMEOUT = 600.0   # a hard stop: the run itself is sized for ~75 s
CHECKS = "not_a_server_error,negative_data_rejection"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    model_dir = tiny_models("llama")
    with run_service(tmp_path_factory.mktemp("fuzz"), model_dir, scopes="inference,usage,batch",
                     extra_env={"REIN_MODELS": f"{MODEL}={model_dir}@{CONTEXT}"}) as svc:
        yield svc


def _real_ids(service: Service) -> dict[str, list[str]]:
    """A job, a file and a batch of key a: ids for the path parameters, so the operations on
    one object reach their logic instead of answering 404 to every generated id."""
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"fuzz seed {i}", "max_tokens": 2}} for i in range(2)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with service.client("a") as client:
        files = [client.post("/v1/files", files={"file": (f"in{i}.jsonl", content)}, data={"purpose": "batch"})
                 .raise_for_status().json()["id"] for i in range(2)]
        batch = client.post("/v1/batches", json={"input_file_id": files[0], "endpoint": "/v1/completions",
                                                 "completion_window": "24h"}).raise_for_status().json()["id"]
        job = submit(client, {"prompt": "fuzz seed", "max_tokens": 2})
        service.wait_job(client, job)
    return {"jobs": [job], "files": files, "batches": [batch]}


# Values that random generation rarely hits but that broke the API before: text Postgres
# refuses (U+0000), integers past int32/int64 (prompt token ids are stored as int4, seeds
# reach torch), floats at the edges of float64 and float32 (5e-324 is 0 in float32). Each
# is drawn now and then for the parameters and fields below, in positive and negative
# cases alike (an entry that breaks a field's schema is only used where Schemathesis wants
# schema-violating data). A lone surrogate cannot be written in TOML:
# tests/integration/api/test_api_input_checks.py sends those.
NUL_TEXT = ["a\x00b", "\x00", "tiny\x00"]
HUGE_INTEGERS = [2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1, 10**29]
EXTREME_NUMBERS = [1e308, -1e308, 5e-324, 1e-45]
NASTY_FIELDS = {
    "text": ["body.prompt", "body.messages[*].content", "body.model", "body.metadata.tag",
             "query.after", "query.purpose"],
    "integers": ["body.prompt[*]", "body.stop_token_ids[*]", "body.seed", "body.max_tokens"],
    "numbers": ["body.temperature", "body.top_p", "body.repetition_penalty"],
}
# Parameters naming an object of key a: half of the time a real one (_real_ids), so the
# operations on it reach their logic rather than a 404, or text with a NUL.
ID_PARAMS = {"path.job_id": "jobs", "path.file_id": "files", "path.batch_id": "batches",
             "query.batch_id": "batches", "body.input_file_id": "files"}


def _config(ids: dict[str, list[str]], path: Path) -> Path:
    """The run's schemathesis.toml (TOML strings, numbers and lists read as JSON writes them)."""
    dictionaries = {"text": NUL_TEXT, "integers": HUGE_INTEGERS, "numbers": EXTREME_NUMBERS,
                    **{name: values + NUL_TEXT for name, values in ids.items()}}
    bindings = {param: (name, 0.1) for name, params in NASTY_FIELDS.items() for param in params}
    bindings |= {param: (name, 0.5) for param, name in ID_PARAMS.items()}
    lines = ["[dictionaries]"]
    lines += [f"{name} = {{ values = {json.dumps(values)} }}" for name, values in dictionaries.items()]
    lines += ["[generation.dictionaries]",   # every other parameter whose schema has a plain type
              'string = { dictionary = "text", probability = 0.1 }',
              'integer = { dictionary = "integers", probability = 0.1 }',
              'number = { dictionary = "numbers", probability = 0.1 }',
              "[parameters]"]
    lines += [f'"{param}" = {{ dictionary = "{name}", probability = {p} }}'
              for param, (name, p) in bindings.items()]
    # Resuming the events of a finished job past its last event waits for the stream's next
    # poll (rein.api.streams) before it ends: fewer of those keep the run near a minute.
    lines += ["[[operations]]", 'include-name = "GET /v1/jobs/{job_id}/events"',
              "generation = { max-examples = 10 }",
              'parameters = { "path.job_id" = { dictionary = "jobs", probability = 0.3 } }']
    path.write_text("\n".join(lines) + "\n")
    return path


def _schemathesis(service: Service, report_dir: Path, config: Path) -> subprocess.CompletedProcess[str]:
    """The CLI run, in the config's directory: its crash cache (`st replay <id>`) goes there too."""
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config),
        "run", f"{service.base_url}/openapi.json",
        "--header", f"Authorization: Bearer {service.keys['a']}",
        "--checks", CHECKS,
        "--mode", "all",                  # positive and negative data
        "--phases", "examples,coverage,fuzzing",
        "--seed", str(SEED),
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", str(WORKERS),
        "--request-timeout", "60",
        "--generation-database", "none",  # no examples carried over from earlier runs
        "--report", "junit,ndjson",
        "--report-dir", str(report_dir),
        "--no-color",
        "--output-truncate", "false",
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=config.parent)


def test_fuzz_openapi(service: Service, tmp_path: Path) -> None:
    report_dir = tmp_path / "schemathesis-report"
    config = _config(_real_ids(service), tmp_path / "schemathesis.toml")
    where = f"reports in {report_dir}, config {config}"
    started = time.monotonic()
    try:
        done = _schemathesis(service, report_dir, config)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"Schemathesis ran past {RUN_TIMEOUT:.0f} s; {where}\n{exc.stdout}{service.diagnostics()}")
    took = time.monotonic() - started
    print(f"\nschemathesis: {took:.1f} s, exit {done.returncode}, {where}")
    print(done.stdout[-4000:])
    assert done.returncode == 0, (
        f"Schemathesis found failures (exit {done.returncode}, {took:.0f} s); {where}\n"
        f"to reproduce a case, run its curl line with -H 'Authorization: Bearer {service.keys['a']}' "
        f"while the service runs\n{done.stdout}\n{done.stderr}{service.diagnostics()}")


# -- large and deep bodies --------------------------------------------------------------------

HOLE = '"__fragment__"'
# A valid request of each JSON operation, with one field's value left as a HOLE for a fragment.
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BODIES = [
    ("/v1/chat/completions", CHAT | {"messages": [{"role": "user", "content": "__fragment__"}]}),
    ("/v1/chat/completions", CHAT | {"messages": "__fragment__"}),
    ("/v1/chat/completions", CHAT | {"tools": "__fragment__"}),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": "__fragment__"}}}),
    ("/v1/chat/completions", CHAT | {"logit_bias": "__fragment__"}),
    ("/v1/chat/completions", CHAT | {"stop": "__fragment__"}),
    ("/v1/completions", {"model": MODEL, "prompt": "__fragment__", "max_tokens": 2}),
    ("/v1/embeddings", {"model": MODEL, "input": "__fragment__"}),
    ("/v1/jobs", {"endpoint": "/v1/chat/completions", "body": CHAT, "metadata": "__fragment__"}),
    ("/v1/jobs", {"endpoint": "/v1/completions", "body": "__fragment__"}),
    ("/v1/batches", {"input_file_id": "__fragment__", "endpoint": "/v1/completions", "completion_window": "24h"}),
]
ATOMS = ["[]", "{}", "0", "1.5", '"ab"', '{"a":[]}', "null"]


def _deep(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a":' * depth + "{}" + "}" * depth)


fragments = st.one_of(
    st.builds(_deep, st.integers(50, 5_000), st.sampled_from(["list", "object"])),
    st.builds(lambda atom, count: "[" + ",".join([atom] * count) + "]",
              st.sampled_from(ATOMS), st.integers(1_000, 2_000_000)),
    st.builds(lambda count: '"' + "x" * count + '"', st.integers(100_000, 15_000_000)),
)


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(body=st.sampled_from(BODIES), fragment=fragments)
def _large_and_deep(client: httpx.Client, seen: list, body, fragment: str) -> None:
    path, template = body
    content = json.dumps(template).replace(HOLE, fragment, 1).encode()
    response = client.post(path, content=content, headers={"Content-Type": "application/json"})
    seen.append((path, len(content), response.status_code))
    assert response.status_code < 500, (path, len(content), fragment[:80], response.text[:500])
    assert client.get("/v1/models").status_code == 200


def test_large_and_deep_bodies(service: Service) -> None:
    seen: list[tuple[str, int, int]] = []
    with service.client("a", timeout=120) as client:
        _large_and_deep(client, seen)
    statuses: dict[int, int] = {}
    for _, _, status in seen:
        statuses[status] = statuses.get(status, 0) + 1
    print(f"\nlarge and deep bodies: {len(seen)} requests, up to {max(n for _, n, _ in seen) / 1e6:.1f} MB, "
          f"statuses {dict(sorted(statuses.items()))}")
    assert any(status in (400, 413) for status in statuses)
