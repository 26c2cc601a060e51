"""JSON inside strings, and charsets, reach parsers the body checks do not bound: a tool call's
`arguments`, a `guided_json` schema given as text, a multipart body's `charset`. Each is a 400
in OpenAI's shape naming the field (rein.openai.fields.json_from_text,
rein.openai.structured_fields, rein.api.multipart_upload), and rein.api.errors turns any
RecursionError or codec LookupError that still gets through into a 400, never a 500."""

from __future__ import annotations

import json

import pytest
from api_support import auth, chat_body

DEEP = 100_000           # past Python's recursion limit: json.loads raises RecursionError


@pytest.fixture
def key(make_key, tenant) -> str:
    return make_key(tenant, "inference,usage,batch")


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


def refused(response, param: str | None, *words: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def with_call_arguments(arguments: str) -> dict:
    return chat_body(messages=[
        {"role": "user", "content": "What is the weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])


# (Nested 100 deep only as a job: a chat completion accepted by mistake would wait for a worker.)
@pytest.mark.parametrize("path, levels, words", [
    ("/v1/chat/completions", DEEP, "nested too deeply"), ("/v1/jobs", DEEP, "nested too deeply"),
    ("/v1/jobs", 100, "nested deeper than 64 levels")])
def test_deeply_nested_json_text_is_a_400(client, key, path, levels, words):
    def post(body):
        if path == "/v1/jobs":
            return client.post(path, json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth(key))
        return client.post(path, json=body, headers=auth(key))

    param = "messages[1].tool_calls[0].function.arguments"
    refused(post(with_call_arguments('{"a": ' + nested(levels) + "}")), param, words)
    refused(post(chat_body(guided_json=nested(levels))), "guided_json", words)
    refused(post(chat_body(structured_outputs={"json": nested(levels)})), "structured_outputs.json", words)
    refused(post(with_call_arguments("{not json")), param, "is not valid JSON")
    if path == "/v1/jobs":   # within the bounds, accepted (a chat completion would wait for a worker)
        assert post(with_call_arguments('{"city": "Paris"}')).status_code == 202


def test_a_ref_chain_that_crashed_the_grammar_compiler_is_a_400(client, key):
    """2,500 `$defs` each naming the next through `$ref` crashed llguidance: refused by the cap on
    a schema's depth counted through its $refs (rein.engine.structured.limits), before any compiler."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(2500)} | {"d2500": {"type": "string"}}
    body = chat_body(guided_json={"$defs": defs, "$ref": "#/$defs/d0"})
    response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth(key))
    refused(response, "guided_json", "2500 $refs in a chain", "rein takes at most 256")


def multipart(charset: str) -> tuple[bytes, dict[str, str]]:
    boundary = "rein-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n{{}}\n\r\n--{boundary}--\r\n").encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}; charset={charset}"}


@pytest.fixture
def files_client(make_client, tmp_path):
    return make_client(files_dir=str(tmp_path / "files"))


@pytest.mark.parametrize("charset", ["rot13", "base64", "zlib"])
def test_a_multipart_charset_that_is_no_text_encoding_is_a_400(files_client, key, charset):
    body, headers = multipart(charset)
    refused(files_client.post("/v1/files", content=body, headers=auth(key) | headers), None,
            f"charset '{charset}' is not a text encoding")


def test_a_multipart_charset_that_cannot_decode_is_read_as_latin1(files_client, key):
    body, headers = multipart("undefined")   # a text codec whose decode always raises UnicodeError
    response = files_client.post("/v1/files", content=body, headers=auth(key) | headers)
    assert response.status_code not in (500, 400), response.text   # the file itself is checked later


def test_recursion_and_codec_errors_that_get_through_are_400s(client, key):
    """The safety net: a route that fails that way answers 400; a KeyError stays a 500."""
    def raises(kind: str):
        if kind == "deep":
            json.loads(nested(DEEP))
        if kind == "codec":
            b"x".decode("rot13")
        if kind == "key":
            return {}["missing"]
        return {}

    client.app.add_api_route("/v1/test-raises/{kind}", raises)
    refused(client.get("/v1/test-raises/deep", headers=auth(key)), None, "nested too deeply")
    refused(client.get("/v1/test-raises/codec", headers=auth(key)), None, "'rot13' is not a text encoding")
    with pytest.raises(KeyError):   # the test client re-raises what the server answered 500 for
        client.get("/v1/test-raises/key", headers=auth(key))
