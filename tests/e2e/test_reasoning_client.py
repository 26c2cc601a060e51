"""A reasoning model served with a reasoning parser, through the official `openai` client.

Its own stack (the shared one of test_openai_client.py serves a model without think tokens, and a
parser there would change every other test's answers): a tiny random-weight model with <think>
tokens and a Qwen3-style template (rein.fixtures.tiny_tokenizer), served with
REIN_REASONING_PARSER=deepseek_r1. A logit bias on </think> makes the random model end its
thinking after a few tokens, so the split, the counts and the schema applied after the thinking
are all visible through the client: `reasoning_content` is a field the SDK does not declare,
kept on its models (attribute access, `model_extra`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from e2e_support import MODEL, Service, run_service

pytestmark = pytest.mark.slow

TIMEOUT = 120.0
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "classify this"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("reasoning-client")
    with run_service(tmp, tiny_models("qwen3", thinking=True), scopes="inference,batch,usage",
                     extra_env={"REIN_REASONING_PARSER": "deepseek_r1", "REIN_FILES_DIR": str(tmp / "files"),
                                "REIN_BATCH_POLL_SECONDS": "0.2"}) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.keys["a"], max_retries=0,
                       timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def end_id(service: Service) -> int:
    with service.client("a") as http:
        response = http.post("/tokenize", json={"model": MODEL, "prompt": "</think>", "add_special_tokens": False})
    [token] = response.json()["tokens"]
    return token


def ask(client: openai.OpenAI, **fields):
    return client.chat.completions.create(**{"model": MODEL, "messages": MESSAGES, "max_tokens": 40,
                                             "temperature": 0.0, **fields})


@pytest.fixture(scope="module")
def bias(client: openai.OpenAI, end_id: int) -> dict[str, int]:
    """A logit bias on </think> under which the model thinks a few tokens, then answers."""
    for value in (2, 3, 4, 5, 6, 7, 8):
        answer = ask(client, logit_bias={str(end_id): value}).choices[0].message
        if answer.reasoning_content and answer.content:
            return {str(end_id): value}
    pytest.fail("no bias on </think> made the tiny model think a few tokens first")


def test_reasoning_content_and_tokens(client: openai.OpenAI, bias: dict[str, int]) -> None:
    completion = ask(client, logit_bias=bias)
    message = completion.choices[0].message
    assert isinstance(message.reasoning_content, str) and message.reasoning_content
    assert message.model_extra["reasoning_content"] == message.reasoning_content
    assert "</think>" not in message.reasoning_content    # split at the first one (the bias brings more later)
    details = completion.usage.completion_tokens_details
    assert details is not None and 0 < details.reasoning_tokens < completion.usage.completion_tokens


def test_streamed_reasoning_deltas_add_up_to_the_answer(client: openai.OpenAI, bias: dict[str, int]) -> None:
    expected = ask(client, logit_bias=bias)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.0,
                                                 logit_bias=bias, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (thinking, content) == (expected.choices[0].message.reasoning_content, expected.choices[0].message.content)
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not getattr(d, "reasoning_content", None) for d in deltas[first_content:])   # thinking first
    assert chunks[-1].usage.model_dump() == expected.usage.model_dump()


def test_the_schema_applies_after_the_thinking(client: openai.OpenAI, bias: dict[str, int], service: Service) -> None:
    free = ask(client, logit_bias=bias).choices[0].message
    schema_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    completion = ask(client, logit_bias=bias, response_format=schema_format, max_tokens=80)
    message = completion.choices[0].message
    assert message.reasoning_content == free.reasoning_content      # the thinking was not constrained
    jsonschema.validate(json.loads(message.content), SCHEMA)        # the answer was
    # The same body from Postgres, as GET /v1/jobs/{id} returns it.
    with service.client("a") as http:
        job = http.get(f"/v1/jobs/{completion.id.removeprefix('chatcmpl-')}").json()
    stored = job["response"]["body"]
    assert stored["choices"][0]["message"]["reasoning_content"] == message.reasoning_content
    assert stored["usage"] == completion.usage.model_dump(exclude_none=True)
    details = completion.usage.completion_tokens_details
    assert job["usage"]["reasoning_tokens"] == details.reasoning_tokens > 0


def test_enable_thinking_false_leaves_no_thinking(client: openai.OpenAI, bias: dict[str, int]) -> None:
    completion = ask(client, logit_bias=bias, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = completion.choices[0].message
    assert message.reasoning_content is None and message.content
    assert completion.usage.completion_tokens_details.reasoning_tokens == 0


def test_n_choices_count_every_choice(client: openai.OpenAI, bias: dict[str, int], service: Service) -> None:
    completion = ask(client, logit_bias=bias, n=2, temperature=1.0, seed=3)
    counted = completion.usage.completion_tokens_details.reasoning_tokens
    assert all(c.message.reasoning_content for c in completion.choices)
    with service.client("a") as http:
        job = http.get(f"/v1/jobs/{completion.id.removeprefix('chatcmpl-')}").json()
    assert job["usage"]["reasoning_tokens"] == counted >= 2       # the worker counted both choices


def test_a_batch_carries_reasoning_in_its_lines_and_usage(client: openai.OpenAI, bias: dict[str, int]) -> None:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 0.0,
                       "logit_bias": bias, "seed": i}} for i in range(3)]
    source = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + TIMEOUT
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.25)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines() if x.strip()]
    bodies = [openai.types.chat.ChatCompletion.model_validate(x["response"]["body"]) for x in output]
    assert all(b.choices[0].message.reasoning_content for b in bodies)
    counts = [b.usage.completion_tokens_details.reasoning_tokens for b in bodies]
    assert all(c > 0 for c in counts)
    assert batch.usage.output_tokens_details.reasoning_tokens == sum(counts)
