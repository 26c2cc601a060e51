"""End to end with the official `openai` client: rein must be a drop-in base_url.

`rein api` and `rein worker` run as subprocesses on a tiny model (see e2e_support);
every request here goes through `openai.OpenAI(base_url=<rein>/v1, api_key=<rein key>)`, so
the client's own parsing (pydantic models, SSE decoding, error classes) checks rein's wire
format: response shapes, streamed chunks, the usage chunk, and errors mapped to the client's
exception classes by status code with OpenAI's `code`.
"""

from __future__ import annotations

import asyncio
import importlib.util as importlib_util
import json
import subprocess
import time
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from e2e_support import MAX_MODEL_LEN, MODEL, REIN, REPO, Service, run_service

pytestmark = pytest.mark.slow

TIMEOUT = 120.0   # a whole generation on a busy 2-core machine


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("openai-client")
    with run_service(tmp, tiny_models("llama"), scopes="inference,batch,usage",
                     extra_env={"REIN_FILES_DIR": str(tmp / "files"), "REIN_BATCH_POLL_SECONDS": "0.2",
                                # webhooks to the test's own receiver on 127.0.0.1 over http
                                "REIN_WEBHOOK_ALLOW_PRIVATE": "true", "REIN_WEBHOOK_ALLOW_HTTP": "true",
                                "REIN_WEBHOOK_POLL_SECONDS": "0.2"}) as svc:
        yield svc


def make_client(service: Service, key: str) -> openai.OpenAI:
    # No retries: a retried 5xx or 429 would hide the error the test wants to see.
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=key, max_retries=0,
                         timeout=TIMEOUT)


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with make_client(service, service.keys["a"]) as c:
        yield c


# -- models -----------------------------------------------------------------------------------


def test_models_list(client: openai.OpenAI) -> None:
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "rein"
    assert models[0].created > 0


# -- chat completions -------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers."}],
        "max_tokens": 12, "temperature": 0.0}


def test_chat_completion(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(**CHAT)
    assert isinstance(completion, openai.types.chat.ChatCompletion)
    assert completion.object == "chat.completion" and completion.model == MODEL
    assert completion.id.startswith("chatcmpl-")
    [choice] = completion.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= CHAT["max_tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    """Greedy: the streamed deltas concatenate to the non-streamed answer; no usage chunk unasked."""
    expected = client.chat.completions.create(**CHAT)
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert chunks, "no chunks"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == expected.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1]), finishes


def test_chat_stream_include_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(**{**CHAT, "max_tokens": 9}, stream=True,
                                                  stream_options={"include_usage": True}))
    *content, last = chunks
    # OpenAI's shape: every chunk carries `usage: null` but the last, which has no choices.
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None and len(c.choices) == 1 for c in content)
    assert 0 < last.usage.completion_tokens <= 9
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    expected = client.chat.completions.create(**{**CHAT, "max_tokens": 9})
    assert last.usage.model_dump() == expected.usage.model_dump()


# -- completions ------------------------------------------------------------------------------

COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.0}


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(**COMPLETION)
    assert isinstance(completion, openai.types.Completion)
    assert completion.object == "text_completion" and completion.model == MODEL
    [choice] = completion.choices
    assert isinstance(choice.text, str) and choice.finish_reason in ("stop", "length")
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 10


def test_completion_stream(client: openai.OpenAI) -> None:
    expected = client.completions.create(**COMPLETION)
    chunks = list(client.completions.create(**COMPLETION, stream=True))
    assert chunks and all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == expected.choices[0].text
    assert chunks[-1].choices[0].finish_reason == expected.choices[0].finish_reason
    with_usage = list(client.completions.create(**COMPLETION, stream=True,
                                                stream_options={"include_usage": True}))
    assert with_usage[-1].choices == []
    assert with_usage[-1].usage.model_dump() == expected.usage.model_dump()


def test_completion_token_id_prompt(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4,
                                           temperature=0.0)
    assert completion.usage.prompt_tokens == 4


def test_models_retrieve(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(**CHAT, logprobs=True, top_logprobs=2)
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens
    assert "".join(t.token for t in content) == completion.choices[0].message.content
    for token in content:
        assert token.logprob <= 0 and len(token.top_logprobs) == 2
        assert token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob


def test_completion_logprobs(client: openai.OpenAI) -> None:
    completion = client.completions.create(**COMPLETION, logprobs=1)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == completion.usage.completion_tokens
    assert len(logprobs.text_offset) == len(logprobs.tokens)
    assert all(len(top) >= 1 for top in logprobs.top_logprobs)


def test_newer_client_parameters(client: openai.OpenAI) -> None:
    """max_completion_tokens, user, n=1, stop and a seed are what current code sends."""
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        max_completion_tokens=6, user="someone", n=1, stop=["zzzz"], seed=7, temperature=0.9)
    assert completion.usage.completion_tokens <= 6
    again = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        max_completion_tokens=6, user="someone", n=1, stop=["zzzz"], seed=7, temperature=0.9)
    assert again.choices[0].message.content == completion.choices[0].message.content


def test_rein_parameters_through_extra_body(client: openai.OpenAI) -> None:
    completion = client.completions.create(**{**COMPLETION, "max_tokens": 20},
                                           extra_body={"ignore_eos": True, "top_k": 1})
    assert completion.usage.completion_tokens == 20 and completion.choices[0].finish_reason == "length"


def test_async_client_stream(service: Service) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=f"{service.base_url}/v1", api_key=service.keys["a"],
                                      max_retries=0, timeout=TIMEOUT) as client:
            expected = await client.chat.completions.create(**CHAT)
            stream = await client.chat.completions.create(**CHAT, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return text, expected.choices[0].message.content

    streamed, expected = asyncio.run(run())
    assert streamed == expected


# -- errors -----------------------------------------------------------------------------------


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(**{**CHAT, "model": "no-such-model"})
    assert caught.value.status_code == 404
    assert "no-such-model" in caught.value.message


def test_context_length_is_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=MAX_MODEL_LEN + 1)
    assert caught.value.code == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in caught.value.message
    # streaming requests are checked before the stream starts
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**CHAT, "max_tokens": MAX_MODEL_LEN + 1}, stream=True)
    assert caught.value.code == "context_length_exceeded"


def test_bad_parameter_is_bad_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{**CHAT, "temperature": -1.0})
    assert caught.value.param == "temperature" or "temperature" in caught.value.message


def test_bad_key_is_authentication_error(service: Service) -> None:
    with make_client(service, "rein_nope_notakey") as bad, pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


def create_key(service: Service, name: str, *args: str) -> str:
    created = subprocess.run([*REIN, "keys", "create", "--name", name, "--tenant", f"openai-{name}", *args],
                             env=service.env, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    return created.stdout.strip().splitlines()[-1]


def test_rate_limit_is_rate_limit_error(service: Service) -> None:
    with make_client(service, create_key(service, "one-rpm", "--scopes", "inference", "--rpm", "1")) as limited:
        limited.completions.create(**COMPLETION)
        with pytest.raises(openai.RateLimitError) as caught:
            limited.completions.create(**COMPLETION)
    assert caught.value.status_code == 429 and caught.value.code == "rate_limit_exceeded"
    assert int(caught.value.response.headers["retry-after"]) >= 1


def test_missing_scope_is_permission_denied(service: Service) -> None:
    key = create_key(service, "usage-only", "--scopes", "usage")
    with make_client(service, key) as usage_only:
        with pytest.raises(openai.PermissionDeniedError) as caught:
            usage_only.chat.completions.create(**CHAT)
        assert caught.value.status_code == 403
        assert "inference" in caught.value.message
        with pytest.raises(openai.PermissionDeniedError) as caught:
            usage_only.completions.create(**COMPLETION, stream=True)
        assert "inference" in caught.value.message


# -- files ------------------------------------------------------------------------------------


def batch_lines(n: int, prefix: str = "req", **body) -> bytes:
    """n chat-completion batch lines with custom_ids `<prefix>-<i>`, greedy, varied lengths."""
    lines = []
    for i in range(n):
        request = {"model": MODEL, "messages": [{"role": "user", "content": f"{prefix} question {i}"}],
                   "max_tokens": 4 + i % 7, "temperature": 0.0, **body}
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST",
                                 "url": "/v1/chat/completions", "body": request}))
    return ("\n".join(lines) + "\n").encode()


def test_files_round_trip(client: openai.OpenAI, service: Service) -> None:
    content = batch_lines(3, prefix="files")
    created = client.files.create(file=("requests.jsonl", content), purpose="batch")
    assert isinstance(created, openai.types.FileObject)
    assert created.id.startswith("file") and created.object == "file"
    assert created.bytes == len(content) and created.filename == "requests.jsonl"
    assert created.purpose == "batch" and created.created_at > 0

    assert client.files.retrieve(created.id).model_dump() == created.model_dump()
    assert created.id in [f.id for f in client.files.list()]
    assert created.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.content(created.id).content == content

    with make_client(service, service.keys["b"]) as other:   # another tenant sees nothing
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(created.id)
        with pytest.raises(openai.NotFoundError):
            other.files.delete(created.id)
        assert created.id not in [f.id for f in other.files.list()]

    deleted = client.files.delete(created.id)
    assert deleted.id == created.id and deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    assert created.id not in [f.id for f in client.files.list()]


def test_files_list_pages(client: openai.OpenAI) -> None:
    ids = [client.files.create(file=(f"page-{i}.jsonl", batch_lines(1, prefix=f"page{i}")),
                               purpose="batch").id for i in range(3)]
    first = client.files.list(limit=2)
    assert len(first.data) == 2 and first.has_more
    # The client follows `after` across pages: every file once, newest first.
    listed = [f.id for f in client.files.list(limit=2)]
    assert len(listed) == len(set(listed))
    assert [i for i in listed if i in ids] == ids[::-1]
    for file_id in ids:
        client.files.delete(file_id)


# -- batches ----------------------------------------------------------------------------------

BATCH_TIMEOUT = 180.0
TERMINAL = ("completed", "failed", "expired", "cancelled")


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = BATCH_TIMEOUT):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout:.0f} s: "
                                 f"{batch.request_counts}")
        time.sleep(0.25)


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line.strip()]


def submit_batch(client: openai.OpenAI, content: bytes, **kwargs):
    input_file = client.files.create(file=("batch.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", **kwargs)


def test_batch_end_to_end(client: openai.OpenAI, service: Service) -> None:
    content = batch_lines(10, prefix="e2e")
    requests = {json.loads(line)["custom_id"]: json.loads(line)["body"] for line in content.splitlines()}
    created = submit_batch(client, content, metadata={"run": "e2e"})
    assert isinstance(created, openai.types.Batch) and created.object == "batch"
    assert created.status in ("validating", "in_progress") and created.metadata == {"run": "e2e"}
    assert created.endpoint == "/v1/chat/completions" and created.completion_window == "24h"

    done = wait_batch(client, created.id)
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 10, "completed": 10, "failed": 0}
    assert done.error_file_id is None and done.output_file_id is not None
    assert done.created_at <= done.in_progress_at <= done.finalizing_at <= done.completed_at
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    lines = file_lines(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in lines) == sorted(requests)   # each exactly once
    completion_tokens = 0
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and isinstance(response["request_id"], str)
        body = openai.types.chat.ChatCompletion.model_validate(response["body"])
        assert body.usage.completion_tokens <= requests[line["custom_id"]]["max_tokens"]
        completion_tokens += body.usage.completion_tokens
    assert done.usage.output_tokens == completion_tokens

    # Greedy: a line's answer is what the synchronous endpoint answers to the same body.
    line = lines[3]
    sync = client.chat.completions.create(**requests[line["custom_id"]])
    assert sync.choices[0].message.content == line["response"]["body"]["choices"][0]["message"]["content"]

    assert created.id in [b.id for b in client.batches.list()]
    with make_client(service, service.keys["b"]) as other:
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            other.batches.cancel(created.id)
        with pytest.raises(openai.NotFoundError):
            other.files.content(done.output_file_id)
        assert created.id not in [b.id for b in other.batches.list()]


def test_batch_webhook_verified_by_the_client(client: openai.OpenAI, service: Service) -> None:
    """A batch's `batch.completed` reaches a real HTTP server, signed so that the client's
    `webhooks.unwrap` verifies it with the secret the admin route showed once."""
    from webhook_receiver import Receiver

    # Key "a"'s tenant, as run_service names it: e2e-<run id>-a (the run id is in the key prefix).
    tenant = service.env["REIN_REDIS_KEY_PREFIX"].removeprefix("rein_").replace("_", "-").rstrip(":") + "-a"
    admin = subprocess.run([*REIN, "keys", "create", "--name", "webhooks-admin", "--tenant", tenant, "--scopes",
                            "admin"], env=service.env, cwd=REPO, capture_output=True, text=True, timeout=120,
                           check=True).stdout.strip().splitlines()[-1]
    receiver = Receiver()
    try:
        with make_client(service, admin) as admin_client:
            endpoint = admin_client.put(f"/tenants/{tenant}/webhook_endpoint", cast_to=dict,
                                        body={"url": receiver.url})
        secret = endpoint["signing_secret"]
        created = submit_batch(client, batch_lines(2, prefix="hook"))
        done = wait_batch(client, created.id)
        assert done.status == "completed", done
        deadline = time.monotonic() + 30
        while not receiver.requests:
            assert time.monotonic() < deadline, "no webhook delivered"
            time.sleep(0.1)
        headers, body = receiver.requests[0]
        event = client.webhooks.unwrap(body, headers, secret=secret)
        assert isinstance(event, openai.types.webhooks.BatchCompletedWebhookEvent)
        assert event.data.id == created.id and event.created_at == done.completed_at
        assert headers["webhook-id"] == event.id
    finally:
        receiver.close()


def test_batch_with_a_bad_line_fails_validation(client: openai.OpenAI) -> None:
    good = batch_lines(2, prefix="ok").decode().splitlines()
    too_long = json.dumps({"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                    "max_tokens": MAX_MODEL_LEN + 1}})
    done = wait_batch(client, submit_batch(client, "\n".join([*good, too_long]).encode() + b"\n").id)
    assert done.status == "failed", done
    assert done.output_file_id is None
    [error] = done.errors.data
    assert error.line == 3 and error.code == "context_length_exceeded", error


def test_batch_cancel_answers_every_line_once(client: openai.OpenAI) -> None:
    content = batch_lines(24, prefix="cancel", max_tokens=300, ignore_eos=True)
    created = submit_batch(client, content)
    # Once validated (in_progress) its 24 requests exist; a batch cancelled while validating has none.
    deadline = time.monotonic() + BATCH_TIMEOUT
    while client.batches.retrieve(created.id).status == "validating":
        assert time.monotonic() < deadline, "the batch is still validating"
        time.sleep(0.05)
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling
    done = wait_batch(client, created.id)
    assert done.status == "cancelled", done
    assert done.cancelling_at is not None and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == 24 and counts.completed < 24
    # Completed requests are kept in the output; each dropped one is an error line.
    answered = file_lines(client, done.output_file_id) + file_lines(client, done.error_file_id)
    assert sorted(line["custom_id"] for line in answered) == sorted(f"cancel-{i}" for i in range(24))
    ok = [line for line in answered if line["response"] and line["response"]["status_code"] == 200]
    assert len(ok) == counts.completed
    cancelled_codes = {(line["error"] or {}).get("code") for line in answered if line not in ok}
    assert cancelled_codes <= {"batch_cancelled"}, cancelled_codes


# -- n > 1, logit_bias, echo and prompt logprobs (issue 14) ------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models("llama")))


def word_token(tokenizer) -> int:
    """A token that is a whole word (its text repeats cleanly), to force with logit_bias."""
    return next(i for i in range(100, len(tokenizer))
                if len(tokenizer.decode([i]).strip()) >= 2 and tokenizer.decode([i]).strip().isalpha())


def test_n_choices_share_one_prompt_in_usage(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(**CHAT)
    four = client.chat.completions.create(**{**CHAT, "max_tokens": 8, "temperature": 1.0}, n=4, seed=11,
                                          extra_body={"ignore_eos": True})
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in four.choices}) == 4      # sampled apart (seed + index)
    assert all(c.finish_reason == "length" for c in four.choices)
    assert four.usage.prompt_tokens == one.usage.prompt_tokens       # the prompt counts once
    assert four.usage.completion_tokens == 4 * 8
    again = client.chat.completions.create(**{**CHAT, "max_tokens": 8, "temperature": 1.0}, n=4, seed=11,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in four.choices]

    chunks = list(client.chat.completions.create(**{**CHAT, "max_tokens": 8, "temperature": 1.0}, n=4, seed=11,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in four.choices}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert chunks[-1].usage.completion_tokens == 32


def test_logit_bias_forces_a_token(client: openai.OpenAI, tokenizer) -> None:
    forced = word_token(tokenizer)
    completion = client.completions.create(**{**COMPLETION, "max_tokens": 6, "temperature": 1.0},
                                           logit_bias={str(forced): 100}, logprobs=0)
    assert completion.choices[0].logprobs.tokens == [tokenizer.decode([forced])] * 6
    assert completion.choices[0].text == tokenizer.decode([forced] * 6)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**COMPLETION, logit_bias={str(len(tokenizer)): 5})
    assert caught.value.param == "logit_bias"


def test_echo_with_prompt_logprobs(client: openai.OpenAI, tokenizer) -> None:
    prompt = tokenizer.encode(COMPLETION["prompt"], add_special_tokens=True)
    completion = client.completions.create(**{**COMPLETION, "max_tokens": 4}, echo=True, logprobs=1,
                                           extra_body={"prompt_logprobs": 2})
    [choice] = completion.choices
    plain = client.completions.create(**{**COMPLETION, "max_tokens": 4})
    assert choice.text == COMPLETION["prompt"] + plain.choices[0].text
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + completion.usage.completion_tokens
    assert logprobs.tokens[:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert completion.usage.prompt_tokens == len(prompt)
    entries = choice.model_extra["prompt_logprobs"]          # vLLM's field
    assert len(entries) == len(prompt) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert str(prompt[position]) in entry and 2 <= len(entry) <= 3
        # The same logprob as the echoed token's.
        assert entry[str(prompt[position])]["logprob"] == pytest.approx(logprobs.token_logprobs[position])


def test_choices_echo_and_bias_in_a_batch_file(client: openai.OpenAI, tokenizer) -> None:
    forced = word_token(tokenizer)
    bodies = {
        "n": {"n": 3, "temperature": 1.0, "seed": 5},
        "bias": {"logit_bias": {str(forced): 100}, "temperature": 1.0},
        "echo": {"echo": True, "logprobs": 1},
    }
    content = "".join(json.dumps({"custom_id": name, "method": "POST", "url": "/v1/completions",
                                  "body": {**COMPLETION, "max_tokens": 4, **body}}) + "\n"
                      for name, body in bodies.items()).encode()
    input_file = client.files.create(file=("choices.jsonl", content), purpose="batch")
    done = wait_batch(client, client.batches.create(input_file_id=input_file.id, endpoint="/v1/completions",
                                                    completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    lines = {line["custom_id"]: line["response"]["body"] for line in file_lines(client, done.output_file_id)}
    for name, body in bodies.items():
        # The same body as the synchronous endpoint's (all three are reproducible: seeded or forced).
        sync = client.completions.create(**{**COMPLETION, "max_tokens": 4, **body})
        # Plain dicts: the SDK's pydantic types would refuse echo's null first logprob (the SDK
        # itself builds responses without validating).
        batch = lines[name]
        assert [c["text"] for c in batch["choices"]] == [c.text for c in sync.choices], name
        assert (batch["usage"]["prompt_tokens"], batch["usage"]["completion_tokens"]) == (
            sync.usage.prompt_tokens, sync.usage.completion_tokens)
    assert len(lines["n"]["choices"]) == 3 and lines["n"]["usage"]["completion_tokens"] >= 3
    assert lines["bias"]["choices"][0]["text"] == tokenizer.decode([forced] * 4)
    assert lines["echo"]["choices"][0]["text"].startswith(COMPLETION["prompt"])
    assert lines["echo"]["choices"][0]["logprobs"]["token_logprobs"][0] is None


# -- tools ------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["unit"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]
TOOL_CHAT = {"model": MODEL, "messages": TOOL_HISTORY, "max_tokens": 6, "temperature": 0.0}


def test_tool_results_go_back_through_the_template(client: openai.OpenAI) -> None:
    """Assistant tool calls and role "tool" results render (the tiny model's template knows
    Qwen2.5's convention); the tools reach the prompt unless tool_choice is "none"."""
    plain = client.chat.completions.create(**TOOL_CHAT)
    with_tools = client.chat.completions.create(**TOOL_CHAT, tools=[WEATHER_TOOL])
    none = client.chat.completions.create(**TOOL_CHAT, tools=[WEATHER_TOOL], tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    # Random weights write no <tool_call>: a plain answer (rein.openai.tools' unit tests parse real ones).
    assert with_tools.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_answers_with_a_call_and_streams_it(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
               "tools": [WEATHER_TOOL], "tool_choice": NAMED, "max_tokens": 16, "temperature": 0.0}
    done = client.chat.completions.create(**request)
    [choice] = done.choices
    assert choice.message.content is None and choice.finish_reason in ("stop", "length")  # OpenAI: stop
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")

    ids, names, arguments, finish = set(), [], [], None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        assert not delta.content
        for part in delta.tool_calls or ():
            assert part.index == 0
            if part.id:
                ids.add(part.id)
            if part.function.name:
                names.append(part.function.name)
            arguments.append(part.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert len(ids) == 1 and ids.pop().startswith("call_") and names == ["get_weather"]   # another job: another id
    assert "".join(arguments) == call.function.arguments and finish == choice.finish_reason


def test_named_tool_choice_arguments_follow_the_schema(client: openai.OpenAI) -> None:
    """Needs the grammar engine (rein.engine.structured): the arguments are constrained to the function's
    parameters, so they parse and validate, and the answer ends (finish_reason "stop")."""
    pytest.importorskip("rein.engine.structured", reason="constrained decoding (issue 14's structured outputs)")
    done = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
        tool_choice=NAMED, max_tokens=200, temperature=0.8, seed=3)
    [choice] = done.choices
    assert choice.finish_reason == "stop", choice
    assert json.loads(choice.message.tool_calls[0].function.arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    required = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=3)
    # One call at most (maxItems 1): random weights would otherwise add calls until max_tokens.
    assert required.choices[0].finish_reason == "tool_calls", required
    [call] = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"unit"}


def test_bad_tools_are_bad_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**TOOL_CHAT, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert caught.value.param == "tool_choice.function.name" and "get_weather" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**TOOL_CHAT, tools=[{"type": "function", "function": {"name": "a b"}}])
    assert caught.value.param == "tools[0].function.name"


def test_batch_lines_with_tools(client: openai.OpenAI) -> None:
    lines = [{"custom_id": "tools-named", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL],
                       "tool_choice": NAMED, "max_tokens": 16, "temperature": 0.0}},
             {"custom_id": "tools-history", "method": "POST", "url": "/v1/chat/completions",
              "body": {**TOOL_CHAT, "tools": [WEATHER_TOOL]}}]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    done = wait_batch(client, submit_batch(client, content).id)
    assert done.status == "completed" and done.request_counts.completed == 2, done
    out = {line["custom_id"]: line["response"]["body"] for line in file_lines(client, done.output_file_id)}
    named = openai.types.chat.ChatCompletion.model_validate(out["tools-named"])
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].message.content is None
    # The line's answer is the synchronous one: same arguments (greedy), same kind of id.
    sync = client.chat.completions.create(**lines[0]["body"])
    assert sync.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert openai.types.chat.ChatCompletion.model_validate(out["tools-history"]).usage.prompt_tokens > 0


FORCED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "celsius"}}\n</tool_call>'


def test_auto_tool_calls_are_parsed_synchronous_streamed_and_batched(client: openai.OpenAI) -> None:
    """Random weights never write a <tool_call> on their own: vLLM's structured_outputs `choice`
    (needs rein.engine.structured) makes the model write one, which auto mode must parse."""
    pytest.importorskip("rein.engine.structured", reason="constrained decoding (issue 14's structured outputs)")
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL],
               "tool_choice": "auto", "max_tokens": 100, "temperature": 0.0}
    forced = {"structured_outputs": {"choice": [FORCED_CALL]}}
    done = client.chat.completions.create(**request, extra_body=forced)
    [choice] = done.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"unit": "celsius"}

    parts, finish = [], None
    for chunk in client.chat.completions.create(**request, extra_body=forced, stream=True):
        assert not chunk.choices[0].delta.content
        parts += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    [part] = parts
    assert finish == "tool_calls" and part.function.name == "get_weather"
    assert part.function.arguments == call.function.arguments

    line = {"custom_id": "auto-call", "method": "POST", "url": "/v1/chat/completions", "body": {**request, **forced}}
    batch = wait_batch(client, submit_batch(client, (json.dumps(line) + "\n").encode()).id)
    assert batch.status == "completed", batch
    [out] = file_lines(client, batch.output_file_id)
    body = openai.types.chat.ChatCompletion.model_validate(out["response"]["body"])
    assert body.choices[0].finish_reason == "tool_calls"
    assert body.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


# -- structured outputs ------------------------------------------------------------------------


class Visitor(pydantic.BaseModel):
    """Bounded fields: the random-weight model's constrained answer ends well within max_tokens."""

    name: str = pydantic.Field(max_length=10)
    age: int = pydantic.Field(ge=0, le=120)
    member: bool
    tier: Literal["gold", "silver"]


VISITOR_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10}, "visits": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["new", "vip"]}, "maxItems": 2}},
    "required": ["name", "visits"], "additionalProperties": False}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "visitor", "schema": VISITOR_SCHEMA}}
STRUCTURED_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a visitor."}],
                   "max_tokens": 120, "temperature": 1.0}


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    """The official client's parse(): it sends the model's strict JSON schema and validates the
    answer into the pydantic class (it raises if the text does not validate)."""
    for seed in range(3):
        completion = client.chat.completions.parse(**STRUCTURED_CHAT, response_format=Visitor, seed=seed)
        [choice] = completion.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Visitor)
        assert Visitor.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_schema_and_json_object_sync_streamed_and_n(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(**STRUCTURED_CHAT, response_format=JSON_SCHEMA_FORMAT, seed=3, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), VISITOR_SCHEMA)
    chunks = list(client.chat.completions.create(**STRUCTURED_CHAT, response_format=JSON_SCHEMA_FORMAT, seed=3,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == completion.choices[0].message.content   # choice 0 is seed 3, as the stream
    obj = client.chat.completions.create(**STRUCTURED_CHAT, response_format={"type": "json_object"}, seed=4)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:   # cut by max_tokens: still the start of a JSON object
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].message.content.startswith("{")


def test_unenforceable_schema_is_a_bad_request(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**STRUCTURED_CHAT, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert caught.value.param.startswith("response_format") and "uniqueItems" in caught.value.message


def test_structured_outputs_in_a_batch_file(client: openai.OpenAI) -> None:
    lines = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**STRUCTURED_CHAT, "seed": i, "response_format": JSON_SCHEMA_FORMAT}} for i in range(4)]
    lines.append({"custom_id": "choice", "method": "POST", "url": "/v1/chat/completions",
                  "body": {**STRUCTURED_CHAT, "structured_outputs": {"choice": ["yes", "no"]}}})
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    batch = wait_batch(client, submit_batch(client, content).id)
    assert batch.status == "completed" and batch.request_counts.completed == 5, batch
    bodies = {line["custom_id"]: line["response"]["body"] for line in file_lines(client, batch.output_file_id)}
    for i in range(4):
        [choice] = bodies[f"s{i}"]["choices"]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), VISITOR_SCHEMA)
    assert bodies["choice"]["choices"][0]["message"]["content"] in ("yes", "no")
    # A bad schema in a line fails validation, naming the line.
    bad = dict(lines[0], body={**lines[0]["body"], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}})
    refused = wait_batch(client, submit_batch(client, (json.dumps(bad) + "\n").encode()).id)
    assert refused.status == "failed", refused
    [error] = refused.errors.data
    assert error.line == 1 and error.param.endswith("schema") and "not" in error.message, error


# -- responses --------------------------------------------------------------------------------

RESPONSE = {"model": MODEL, "input": "Name three rivers.", "instructions": "Answer briefly.",
            "max_output_tokens": 12, "temperature": 0.0}
RESPONSES_WEATHER = {"type": "function", **WEATHER_TOOL["function"], "strict": True}


def test_responses_create(client: openai.OpenAI) -> None:
    response = client.responses.create(**RESPONSE, metadata={"run": "e2e"}, store=False)
    assert isinstance(response, openai.types.responses.Response)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status in ("completed", "incomplete") and response.metadata == {"run": "e2e"}
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text == message.content[0].text
    usage = response.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= RESPONSE["max_output_tokens"]
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert usage.output_tokens == RESPONSE["max_output_tokens"]
    # The same job through the chat endpoint: the same greedy answer.
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": RESPONSE["instructions"]},
                               {"role": "user", "content": RESPONSE["input"]}],
        max_tokens=RESPONSE["max_output_tokens"], temperature=0.0)
    assert chat.choices[0].message.content == response.output_text


def test_responses_stream_equals_non_stream(client: openai.OpenAI) -> None:
    expected = client.responses.create(**RESPONSE)
    events = list(client.responses.create(**RESPONSE, stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if expected.status == "completed" else "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == expected.output_text
    final = events[-1].response
    assert final.output_text == expected.output_text and final.usage.output_tokens == expected.usage.output_tokens
    with client.responses.stream(**RESPONSE) as stream:      # the SDK's helper reads the same events
        helper = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        if expected.status == "completed":   # its final response is only a response.completed's
            assert stream.get_final_response().output_text == expected.output_text
    assert helper == expected.output_text


def test_responses_json_schema(client: openai.OpenAI) -> None:
    pytest.importorskip("rein.engine.structured", reason="constrained decoding")
    response = client.responses.create(
        model=MODEL, input="Describe a visitor.", max_output_tokens=120, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "visitor", "schema": VISITOR_SCHEMA, "strict": True}})
    assert response.text.format.type == "json_schema"
    if response.status == "completed":
        jsonschema.validate(json.loads(response.output_text), VISITOR_SCHEMA)
    else:
        assert response.output_text.startswith("{")


def test_responses_forced_tool_call_and_its_answer(client: openai.OpenAI) -> None:
    request = {"model": MODEL, "input": "Weather in Paris?", "tools": [RESPONSES_WEATHER],
               "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
               "temperature": 0.0}
    response = client.responses.create(**request)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    if importlib_util.find_spec("rein.engine.structured") is not None and response.status == "completed":
        assert json.loads(call.arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    streamed = list(client.responses.create(**request, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    # The call and its output go back as input items, through the chat template.
    follow_up = client.responses.create(model=MODEL, max_output_tokens=8, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}])
    assert follow_up.output[0].type == "message"


def test_responses_refusals_are_bad_requests(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
    assert caught.value.code == "unsupported_parameter" and caught.value.param == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert "built-in tools" in caught.value.message


def test_responses_job_and_batch(client: openai.OpenAI, service: Service) -> None:
    """POST /v1/jobs with endpoint /v1/responses, and a batch of /v1/responses lines: both answer
    with the synchronous endpoint's body."""
    expected = client.responses.create(**RESPONSE)
    with httpx.Client(base_url=service.base_url, headers={"Authorization": f"Bearer {service.keys['a']}"},
                      timeout=TIMEOUT) as http:
        job = http.post("/v1/jobs", json={"endpoint": "/v1/responses", "body": RESPONSE}).json()
        deadline = time.monotonic() + TIMEOUT
        while (got := http.get(f"/v1/jobs/{job['id']}").json())["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
    body = openai.types.responses.Response.model_validate(got["response"]["body"])
    assert body.output_text == expected.output_text and body.id == "resp_" + job["id"]

    lines = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/responses",
              "body": {**RESPONSE, "input": f"Question {i}", "metadata": {"i": str(i)}}} for i in range(3)]
    input_file = client.files.create(file=("r.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()),
                                     purpose="batch")
    created = client.batches.create(input_file_id=input_file.id, endpoint="/v1/responses", completion_window="24h")
    assert created.endpoint == "/v1/responses"
    done = wait_batch(client, created.id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    output = {line["custom_id"]: line for line in file_lines(client, done.output_file_id)}
    assert sorted(output) == ["r-0", "r-1", "r-2"]
    for custom_id, line in output.items():
        answer = openai.types.responses.Response.model_validate(line["response"]["body"])
        assert answer.object == "response" and answer.metadata == {"i": custom_id[2:]}
        assert 0 < answer.usage.output_tokens <= RESPONSE["max_output_tokens"]
    sync = client.responses.create(**lines[1]["body"])
    assert sync.output_text == openai.types.responses.Response.model_validate(
        output["r-1"]["response"]["body"]).output_text
    # A chat line in a /v1/responses batch is refused at validation, naming the line.
    mixed = client.files.create(file=("m.jsonl", batch_lines(1)), purpose="batch")
    refused = wait_batch(client, client.batches.create(input_file_id=mixed.id, endpoint="/v1/responses",
                                                       completion_window="24h").id)
    assert refused.status == "failed" and refused.errors.data[0].code == "invalid_url"
