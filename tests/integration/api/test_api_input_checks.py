"""Input no part of rein can take is refused up front, on every route, with a 400 naming it
(rein.api.checked_route, rein.core.input_checks): NUL characters and lone surrogates anywhere in
JSON (keys and values), query, path and header parameters; numbers past 64 bits or past
float64; token ids outside the vocabulary; query parameters not written as their schema
types them. Batch input lines with such values are reported by line."""

from __future__ import annotations

import io
import json

import pytest
from api_support import auth
from support import wait_for

NUL = "\\u0000"          # as JSON writes U+0000
SURROGATE = "\\ud800"    # a lone high surrogate, as JSON writes it (no UTF-8 form exists)


@pytest.fixture
def key(make_key, tenant) -> str:
    return make_key(tenant, "inference,usage,batch")


@pytest.fixture
def files_client(make_client, tmp_path):
    return make_client(files_dir=str(tmp_path / "files"), batch_poll_seconds=0.05)


def post_raw(client, key: str, path: str, text: str, **headers: str):
    """POST `text` as the JSON body, byte for byte (json= would re-encode the escapes)."""
    return client.post(path, content=text.encode(), headers=auth(key) | {"Content-Type": "application/json",
                                                                          **headers})


def refused(response, param: str | None, *words: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value", error
    for word in words:
        assert word in error["message"], error
    return error


# -- JSON bodies ------------------------------------------------------------------------------


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", f'{{"model": "tiny", "prompt": "a{NUL}b", "max_tokens": 2}}', "prompt"),
    ("/v1/completions", f'{{"model": "tiny{NUL}", "prompt": "hi"}}', "model"),
    ("/v1/completions", f'{{"model": "tiny", "prompt": ["ok", "b{NUL}"]}}', "prompt[1]"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": "x{NUL}"}}]}}', "messages[0].content"),
    ("/v1/chat/completions",
     f'{{"model": "tiny", "messages": [{{"role": "user", "content": [{{"type": "text", "text": "{NUL}"}}]}}]}}',
     "messages[0].content[0].text"),
    ("/v1/jobs", f'{{"endpoint": "/v1/completions", "body": {{"model": "tiny", "prompt": "{NUL}"}}}}',
     "body.prompt"),
    ("/v1/jobs", f'{{"endpoint": "/v1/completions", "body": {{"prompt": "hi"}}, "metadata": {{"k": "{NUL}"}}}}',
     "metadata.k"),
    ("/v1/batches", f'{{"input_file_id": "file{NUL}", "endpoint": "/v1/completions", "completion_window": "24h"}}',
     "input_file_id"),
])
def test_nul_in_json_text_is_refused_naming_its_path(client, key, path, text, param):
    refused(post_raw(client, key, path, text), param, "NUL character (U+0000)", "remove it")


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", f'{{"model": "tiny", "prompt": "a{SURROGATE}b"}}', "prompt"),
    ("/v1/completions", f'{{"model": "{SURROGATE}", "prompt": "hi"}}', "model"),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00x"}]}', "messages[0].content"),
    ("/v1/batches", f'{{"input_file_id": "{SURROGATE}", "endpoint": "/v1/completions", "completion_window": "24h"}}',
     "input_file_id"),
])
def test_lone_surrogates_are_refused(client, key, path, text, param):
    refused(post_raw(client, key, path, text), param, "lone UTF-16 surrogate", "surrogate pair")


def test_a_surrogate_pair_is_fine(client, key, fake_worker, tenant):
    """An escaped pair is one valid character (U+1F600): not refused."""
    fake_worker.serve_next(tenant, [("ok", [5])])
    response = post_raw(client, key, "/v1/completions",
                        '{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, text, param", [
    ("/v1/completions", f'{{"model": "tiny", "prompt": "hi", "{NUL}": 1}}', None),
    ("/v1/completions", f'{{"model": "tiny", "prompt": "hi", "stream_options": {{"a{SURROGATE}": 1}}}}',
     "stream_options"),
    ("/v1/jobs", f'{{"endpoint": "/v1/completions", "body": {{"prompt": "hi"}}, "metadata": {{"{NUL}": "v"}}}}',
     "metadata"),
    ("/v1/batches", f'{{"input_file_id": "f", "endpoint": "/v1/completions", "completion_window": "24h", '
                    f'"metadata": {{"{SURROGATE}": "v"}}}}', "metadata"),
])
def test_bad_object_keys_are_refused_naming_the_object(client, key, path, text, param):
    error = refused(post_raw(client, key, path, text), param, "an object key")
    assert error["message"].startswith(f"{param or 'the request body'}: an object key")


@pytest.mark.parametrize("field, value, param, words", [
    ("temperature", "1e400", "temperature", ["not finite", "finite number"]),
    ("repetition_penalty", "-1e999", "repetition_penalty", ["not finite"]),
    ("seed", str(2**63), "seed", ["64-bit integer range", "smaller number"]),
    ("seed", str(-(2**63) - 1), "seed", ["64-bit integer range"]),
    ("top_k", "9" * 40, "top_k", [f"a {(10**40 - 1).bit_length()}-bit integer"]),
    ("stream_options", '{"x": [' + "1" * 30 + "]}", "stream_options.x[0]", ["64-bit"]),
])
def test_numbers_past_64_bits_or_float64_are_refused(client, key, field, value, param, words):
    text = f'{{"model": "tiny", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}'
    refused(post_raw(client, key, "/v1/completions", text), param, *words)


def test_deep_nesting_is_refused(client, key):
    text = '{"model": "tiny", "prompt": "hi", "x": ' + "[" * 100 + "]" * 100 + "}"
    refused(post_raw(client, key, "/v1/completions", text), "x" + "[0]" * 63, "nested deeper than 64")


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": [5, 2**31]}, "prompt", ["prompt[1] is 2147483648", "from 0 to 2047"]),
    ({"prompt": [[7, 99999]]}, "prompt", ["prompt[1] is 99999"]),
    ({"prompt": "hi", "stop_token_ids": [2048]}, "stop_token_ids", ["stop_token_ids[0] is 2048"]),
    ({"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", ["stop_token_ids[0] is -1"]),
    ({"prompt": "hi", "repetition_penalty": 1e308}, "repetition_penalty", ["between 0.01 and 2.0"]),
    ({"prompt": "hi", "repetition_penalty": 1e-300}, "repetition_penalty", ["between 0.01 and 2.0"]),
    ({"prompt": ""}, "prompt", ["the prompt is empty"]),
    ({"prompt": "hi", "max_tokens": 0, "max_completion_tokens": 4}, "max_tokens", ["at least 1"]),
    ({"prompt": "hi", "stream_options": [None]}, "stream_options", ["stream_options"]),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     ["a boolean"]),
])
def test_values_that_reach_the_engine_or_the_database_are_checked(client, key, body, param, words):
    """Prompt token ids are stored as int4 and index the embedding: the vocabulary bounds them."""
    for path, payload in [("/v1/completions", {"model": "tiny", **body}),
                          ("/v1/jobs", {"endpoint": "/v1/completions", "body": {"model": "tiny", **body}})]:
        response = client.post(path, json=payload, headers=auth(key))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param, error
        for word in words:
            assert word in error["message"], error


# -- query, path and header parameters --------------------------------------------------------


@pytest.mark.parametrize("url, param", [
    ("/v1/jobs?after=a%00b", "after"),
    ("/v1/jobs?batch_id=%00", "batch_id"),
    ("/v1/batches?after=%00", "after"),
    ("/v1/files?purpose=batch%00", "purpose"),
    ("/v1/files?after=x&unknown=%00", "unknown"),
    ("/v1/usage?end=%00", "end"),
    ("/v1/jobs/job%00x", "job_id"),
    ("/v1/jobs/%00/events", "job_id"),
    ("/v1/files/%00/content", "file_id"),
    ("/v1/batches/%00", "batch_id"),
    ("/v1/models/tiny%00", "model"),
])
def test_nul_in_query_and_path_parameters_is_refused(client, key, url, param):
    refused(client.get(url, headers=auth(key)), param, "NUL character")


@pytest.mark.parametrize("method, url", [("POST", "/v1/jobs/%00/cancel"), ("DELETE", "/v1/files/%00"),
                                         ("POST", "/v1/batches/a%00/cancel")])
def test_nul_in_path_parameters_of_writes_is_refused(client, key, method, url):
    assert client.request(method, url, headers=auth(key)).status_code == 400


def test_nul_in_a_query_parameter_name_is_refused_without_echoing_it(client, key):
    error = refused(client.get("/v1/jobs?a%00=1", headers=auth(key)), None, "a query parameter name")
    assert "\x00" not in error["message"]


@pytest.mark.parametrize("url, param, words", [
    ("/v1/jobs?limit=1.0", "limit", ["an integer written in digits", "limit=20", "'1.0'"]),
    ("/v1/jobs?limit=1e1", "limit", ["an integer"]),
    ("/v1/batches?limit=%201", "limit", ["an integer"]),
    ("/v1/files?limit=" + "9" * 30, "limit", ["out of range", "more than 19 digits"]),
    ("/v1/usage?start=0", "start", ["YYYY-MM-DD", "'0'"]),
    ("/v1/usage?start=1700000000", "start", ["YYYY-MM-DD"]),
    ("/v1/usage?start=2025-01-01T00:00:00", "start", ["YYYY-MM-DD"]),
    ("/v1/usage?end=2025-02-30", "end", ["calendar date"]),
    ("/v1/usage?end=20250101", "end", ["YYYY-MM-DD"]),
])
def test_query_parameters_are_read_as_their_schema_types_them(client, key, url, param, words):
    refused(client.get(url, headers=auth(key)), param, *words)


@pytest.mark.parametrize("url", ["/v1/jobs?limit=5", "/v1/jobs?limit=%2B5", "/v1/usage?start=2025-01-31",
                                 "/v1/usage?start=0001-01-01&end=9999-12-31"])
def test_well_formed_query_parameters_still_work(client, key, url):
    assert client.get(url, headers=auth(key)).status_code == 200


@pytest.mark.parametrize("value", ["x", "-1", "99999999999999999999", "1.5", "5-0-0"])
def test_last_event_id_must_be_an_event_id(client, key, tenant, fake_worker, value):
    job_id = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": {"prompt": "hi"}},
                         headers=auth(key)).json()["id"]
    response = client.get(f"/v1/jobs/{job_id}/events", headers=auth(key) | {"Last-Event-ID": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "Last-Event-ID" and "an integer from 0 to" in error["message"], error


def test_idempotency_key_with_a_control_character_other_than_nul_still_works(client, key):
    """Only NUL is refused in text: other characters Postgres takes are kept as they are."""
    response = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": {"prompt": "hi"}},
                           headers=auth(key) | {"Idempotency-Key": "a\x01b"})
    assert response.status_code == 202, response.text


def test_the_schema_documents_the_ranges_that_are_enforced(client):
    """What the fuzz test holds the API to: documented ranges (tests/e2e/test_fuzz.py)."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert (completion["temperature"]["minimum"], completion["temperature"]["maximum"]) == (0, 2)
    assert completion["seed"]["format"] == "int64"
    assert completion["repetition_penalty"]["maximum"] == 2.0
    assert completion["prompt"]["anyOf"][1]["items"] == {"type": "integer", "minimum": 0}
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1
    job_body = schemas["JobCreate"]["properties"]["body"]["anyOf"]
    assert {"$ref": "#/components/schemas/CompletionRequest"} in job_body


# -- files and batch lines --------------------------------------------------------------------


def test_upload_refuses_a_file_name_with_nul(files_client, key):
    # Built by hand: httpx would percent-encode the NUL in the file name.
    body = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--b\r\nContent-Disposition: form-data; name="file"; filename="in\x00.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n{}\n\r\n--b--\r\n")
    response = files_client.post("/v1/files", content=body,
                                 headers=auth(key) | {"Content-Type": "multipart/form-data; boundary=b"})
    error = refused(response, "file", "the file name", "NUL character")
    assert "\x00" not in error["message"]


def test_batch_lines_with_nul_or_surrogates_are_reported_by_line(files_client, key):
    good = {"custom_id": "ok", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "hello", "max_tokens": 2}}
    lines = [
        json.dumps(good),
        json.dumps({**good, "custom_id": "nul", "body": {**good["body"], "prompt": "a\x00b"}}),
        json.dumps({**good, "custom_id": "surrogate", "body": {**good["body"], "prompt": "a\ud800"}}),
        json.dumps({**good, "custom_id": "key\x00", "body": good["body"]}),
        '{"custom_id": "raw", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a\x00"}}',
        json.dumps({**good, "custom_id": "ids", "body": {**good["body"], "prompt": [1, 2**40]}}),
        json.dumps({**good, "custom_id": "big", "body": {**good["body"], "seed": 2**64}}),
    ]
    content = "".join(line + "\n" for line in lines).encode("utf-8")
    upload = files_client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                               files={"file": ("in.jsonl", io.BytesIO(content), "application/jsonl")})
    assert upload.status_code == 200, upload.text
    created = files_client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert created.status_code == 200, created.text

    def failed() -> dict | None:
        batch = files_client.get(f"/v1/batches/{created.json()['id']}", headers=auth(key)).json()
        return batch if batch["status"] == "failed" else None

    batch = wait_for(failed, 30, "the batch to fail validation")
    errors = {error["line"]: error for error in batch["errors"]["data"]}
    assert sorted(errors) == [2, 3, 4, 5, 6, 7], errors
    assert errors[2]["param"] == "body.prompt" and "NUL character" in errors[2]["message"]
    assert errors[3]["param"] == "body.prompt" and "lone UTF-16 surrogate" in errors[3]["message"]
    assert errors[4]["param"] == "custom_id" and "NUL character" in errors[4]["message"]
    assert errors[5]["code"] == "invalid_json_line" and "NUL character" in errors[5]["message"]
    assert errors[6]["param"] == "body.prompt" and "not a token id of this model" in errors[6]["message"]
    assert errors[7]["param"] == "body.seed" and "64-bit integer range" in errors[7]["message"]
    assert all(error["message"].startswith(f"line {n}: ") for n, error in errors.items())


def test_a_large_body_is_parsed_off_the_event_loop(client, make_key, tenant, monkeypatch):
    import asyncio

    from rein.api import checked_route

    threads = []
    real = checked_route._parse_and_check

    def spy(raw):
        try:
            asyncio.get_running_loop()
            threads.append("event loop")
        except RuntimeError:
            threads.append("thread pool")
        return real(raw)

    monkeypatch.setattr(checked_route, "_parse_and_check", spy)
    key = make_key(tenant)
    small = {"endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "hi", "max_tokens": 1}}
    large = {**small, "metadata": {"note": "x" * 500}, "padding": ["y" * 1000] * 100}
    client.post("/v1/jobs", json=small, headers={"Authorization": f"Bearer {key}"})
    assert threads == ["event loop"]
    client.post("/v1/jobs", json=large, headers={"Authorization": f"Bearer {key}"})
    assert threads == ["event loop", "thread pool"]


def test_responses_requests_are_checked_at_intake(client, key):
    """/v1/responses and POST /v1/jobs with its endpoint: a refusal names the Responses field,
    and the route and its body are in the schema."""
    response = client.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"},
                           headers=auth(key))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "previous_response_id" and error["code"] == "unsupported_parameter"
    response = client.post("/v1/jobs", json={"endpoint": "/v1/responses", "body": {
        "input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}}, headers=auth(key))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "text.format.name", response.text
    response = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 10 ** 6}, headers=auth(key))
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert "input" in response.json()["error"]["message"], response.text
    schema = client.get("/openapi.json").json()
    assert "post" in schema["paths"]["/v1/responses"]
    assert {"$ref": "#/components/schemas/ResponsesRequest"} in \
        schema["components"]["schemas"]["JobCreate"]["properties"]["body"]["anyOf"]
    response = client.post("/v1/jobs", json={"endpoint": "/v1/responses", "body": {"input": "hi", "max_output_tokens": 2}},
                           headers=auth(key))
    assert response.status_code == 202, response.text
