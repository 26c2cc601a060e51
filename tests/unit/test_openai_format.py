"""OpenAI request parsing, response shapes and batch lines (rein.openai.request)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from rein.engine.step_outputs import TokenLogprob
from rein.openai.batch_lines import batch_error_line, batch_output_line, parse_batch_line
from rein.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.request import parse_request
from rein.openai.response import build_response

MAX_LEN = 256
CHAT = [{"role": "user", "content": "Hello there"}]


def chat(tokenizer, **fields):
    return parse_request(CHAT_COMPLETIONS, {"messages": CHAT, **fields}, tokenizer, MAX_LEN)


def completion(tokenizer, **fields):
    return parse_request(COMPLETIONS, {"prompt": "def f(x):", **fields}, tokenizer, MAX_LEN)


def error_of(endpoint, body, tokenizer, max_len=MAX_LEN) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_request(endpoint, body, tokenizer, max_len)
    return info.value


# -- parsing --------------------------------------------------------------------------------


def test_chat_uses_the_template_and_fills_the_context_by_default(tokenizer):
    parsed = chat(tokenizer)
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert parsed.prompt_token_ids == list(expected["input_ids"])
    assert all(type(t) is int for t in parsed.prompt_token_ids)
    assert parsed.params.max_tokens == MAX_LEN - len(parsed.prompt_token_ids)
    assert parsed.params.temperature == 1.0
    assert parsed.logprobs_mode is None and parsed.params.logprobs is None
    assert parsed.model is None


def test_chat_fields_map_onto_sampling_params(tokenizer):
    parsed = chat(tokenizer, model="m", max_tokens=7, temperature=0, top_p=0.5, stop="END", seed=3,
                  presence_penalty=0.5, frequency_penalty=-0.5, top_k=40, min_p=0.1, repetition_penalty=1.2,
                  ignore_eos=True, stop_token_ids=[5, 6], logprobs=True, top_logprobs=3)
    p = parsed.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (7, 0.0, 0.5, ["END"], 3)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.ignore_eos, p.stop_token_ids) == (40, 0.1, 1.2, True, [5, 6])
    assert parsed.logprobs_mode == 3 and p.logprobs == 3
    assert parsed.model == "m"
    assert chat(tokenizer, logprobs=True).logprobs_mode == 0


def test_max_completion_tokens_wins_and_text_parts_join(tokenizer):
    assert chat(tokenizer, max_tokens=9, max_completion_tokens=4).params.max_tokens == 4
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    joined = parse_request(CHAT_COMPLETIONS, {"messages": parts}, tokenizer, MAX_LEN)
    assert joined.prompt_token_ids == chat(tokenizer).prompt_token_ids


def test_completion_prompts_and_defaults(tokenizer):
    parsed = completion(tokenizer)
    assert parsed.prompt_token_ids == tokenizer.encode("def f(x):", add_special_tokens=True)
    assert parsed.params.max_tokens == 16
    assert completion(tokenizer, prompt=[5, 6, 7]).prompt_token_ids == [5, 6, 7]
    assert completion(tokenizer, prompt=[[5, 6]]).prompt_token_ids == [5, 6]
    assert completion(tokenizer, prompt=["def f(x):"]).prompt_token_ids == parsed.prompt_token_ids
    assert completion(tokenizer, logprobs=2).logprobs_mode == 2
    assert completion(tokenizer, logprobs=0).params.logprobs == 0


@pytest.mark.parametrize("endpoint, body, param", [
    (CHAT_COMPLETIONS, {}, "messages"),
    (CHAT_COMPLETIONS, {"messages": "hi"}, "messages"),
    (CHAT_COMPLETIONS, {"messages": []}, "messages"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages[0].content[0].type"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "temperature": "hot"}, "temperature"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "temperature": 3}, "temperature"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "top_p": 0}, "top_p"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "presence_penalty": 9}, "presence_penalty"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "n": 0}, "n"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "n": 129}, "n"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "max_tokens": True}, "max_tokens"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "stop": [1]}, "stop"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "logprobs": 3}, "logprobs"),
    (CHAT_COMPLETIONS, {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": 5}, "prompt"),
    (COMPLETIONS, {"prompt": ["one", "two"]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, -2]}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "echo": "yes"}, "echo"),
    (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 6}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "logprobs": True}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "seed": 1.5}, "seed"),
])
def test_bad_requests_name_the_param(tokenizer, endpoint, body, param):
    err = error_of(endpoint, body, tokenizer)
    assert err.param == param
    assert err.code == "invalid_request_error"
    assert err.to_dict()["error"]["type"] == "invalid_request_error"


def test_several_prompts_say_so(tokenizer):
    assert "one prompt per request" in error_of(COMPLETIONS, {"prompt": ["a", "b"]}, tokenizer).message


@pytest.mark.parametrize("endpoint,field,value", [
    (CHAT_COMPLETIONS, "guided_json", {"type": "object", "not": {}}),   # a keyword llguidance cannot enforce
    (CHAT_COMPLETIONS, "structured_outputs", {"choice": ["a"], "regex": "b"}),
    (CHAT_COMPLETIONS, "guided_decoding_backend", "outlines"),
    (CHAT_COMPLETIONS, "min_tokens", False),          # same value as 0, not the same thing
    (CHAT_COMPLETIONS, "echo", True),                 # echo and best_of are the completions endpoint's
    (CHAT_COMPLETIONS, "best_of", 3),
    (CHAT_COMPLETIONS, "use_beam_search", True),
    (CHAT_COMPLETIONS, "tool_choice", "required"),
    (CHAT_COMPLETIONS, "temprature", 0),              # a misspelt field is not ignored either
    (COMPLETIONS, "messages", CHAT),                  # a chat field on the completions endpoint
])
def test_fields_rein_would_ignore_are_refused_by_name(tokenizer, endpoint, field, value):
    base = {"messages": CHAT} if endpoint == CHAT_COMPLETIONS else {"prompt": "x"}
    err = error_of(endpoint, {**base, field: value}, tokenizer)
    assert err.param == field and field in err.message


def test_neutral_and_bookkeeping_fields_are_accepted(tokenizer):
    parsed = chat(tokenizer, user="u-1", store=False, metadata={"k": "v"}, service_tier="auto",
                  min_tokens=0, add_generation_prompt=True, include_stop_str_in_output=False,
                  tool_choice="none", parallel_tool_calls=True, temperature=0)
    assert parsed.params.temperature == 0
    assert completion(tokenizer, best_of=1, echo=False, suffix=None).params.max_tokens == 16


def test_chat_template_kwargs_reach_the_template(tokenizer):
    templated = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    templated.chat_template = ("{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }}"
                               "{% endfor %}")
    plain = parse_request(CHAT_COMPLETIONS, {"messages": CHAT}, templated, MAX_LEN).prompt_token_ids
    loud = parse_request(CHAT_COMPLETIONS, {"messages": CHAT, "chat_template_kwargs": {"shout": True}},
                         templated, MAX_LEN).prompt_token_ids
    assert loud != plain and templated.decode(loud).startswith("LOUD")
    err = error_of(CHAT_COMPLETIONS, {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}, templated)
    assert err.param == "chat_template_kwargs.tokenize"


def test_chat_template_kwargs_count_in_the_prompt_size_cap(tokenizer, monkeypatch):
    """The template may write every variable into the prompt: a huge one is refused before the
    template (or the tokenizer) sees it, as long messages are."""
    from rein.openai.limits import MAX_CHARS_PER_TOKEN

    templated = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    templated.chat_template = "{{ blob }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    body = {"messages": CHAT, "chat_template_kwargs": {"blob": "x" * (MAX_LEN * MAX_CHARS_PER_TOKEN)}}
    monkeypatch.setattr(templated, "apply_chat_template", lambda *a, **k: pytest.fail("templated a huge prompt"))
    err = error_of(CHAT_COMPLETIONS, body, templated)
    assert err.code == "context_length_exceeded" and err.param == "messages" and "characters" in err.message
    monkeypatch.undo()
    small = {"messages": CHAT, "chat_template_kwargs": {"blob": "x" * 100}}
    parse_request(CHAT_COMPLETIONS, small, templated, MAX_LEN)
    assert small["chat_template_kwargs"] == {"blob": "x" * 100}   # the body is not changed


def test_streamed_logprobs_are_refused_not_nulled(tokenizer):
    err = error_of(CHAT_COMPLETIONS, {"messages": CHAT, "stream": True, "logprobs": True}, tokenizer)
    assert err.param == "logprobs" and "not streamed" in err.message
    assert error_of(COMPLETIONS, {"prompt": "x", "stream": True, "logprobs": 2}, tokenizer).param == "logprobs"


def test_context_length_in_openai_wording(tokenizer):
    prompt_len = len(chat(tokenizer).prompt_token_ids)
    err = error_of(CHAT_COMPLETIONS, {"messages": CHAT, "max_tokens": MAX_LEN}, tokenizer)
    assert err.code == "context_length_exceeded" and err.param == "messages"
    assert err.message == (
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
        f"{prompt_len + MAX_LEN} tokens ({prompt_len} in the messages, {MAX_LEN} in the completion). "
        f"Please reduce the length of the messages or completion.")
    err = error_of(COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": MAX_LEN - 2}, tokenizer)
    assert err.code == "context_length_exceeded" and err.param == "prompt"
    assert f"requested {MAX_LEN + 1} tokens (3 in your prompt, {MAX_LEN - 2} in the completion)" in err.message
    # exactly max_model_len is fine
    assert completion(tokenizer, prompt=[1, 2, 3], max_tokens=MAX_LEN - 3).params.max_tokens == MAX_LEN - 3

    # a prompt that fills the context leaves no room even for the default
    err = error_of(CHAT_COMPLETIONS, {"messages": CHAT}, tokenizer, max_len=prompt_len)
    assert err.code == "context_length_exceeded"


def test_the_engine_refuses_in_the_same_words():
    """The engine's refusal (rein.engine.errors) reads on the wire as the API's own
    (rein.openai.engine_errors): OpenAI's words, param and code."""
    from rein.engine.errors import ContextLengthExceeded, EngineRequestError
    from rein.openai.engine_errors import job_error_code, request_error

    refused = ContextLengthExceeded(512, 500, 20)
    assert refused.param == "max_tokens" and not hasattr(refused, "code")
    assert str(refused) == (
        "This model's maximum context length is 512 tokens. However, you requested 520 tokens "
        "(500 in the prompt, 20 in the completion). Please reduce the length of the prompt or completion.")
    answer = request_error(refused)
    assert answer.to_dict() == {"error": {"message": str(refused), "type": "invalid_request_error",
                                          "param": "max_tokens", "code": "context_length_exceeded"}}
    assert job_error_code(refused) == "context_length_exceeded"

    other = EngineRequestError("the prompt is empty: give at least one token", param="prompt")
    assert request_error(other).to_dict()["error"] == {
        "message": "the prompt is empty: give at least one token", "type": "invalid_request_error",
        "param": "prompt", "code": "invalid_request_error"}
    assert job_error_code(other) == "invalid_request"       # a job's error has always said so
    assert job_error_code(RuntimeError("not the engine's refusal")) is None


# -- responses ------------------------------------------------------------------------------


def test_chat_response_shape(tokenizer):
    ids = tokenizer.encode(" hello world", add_special_tokens=False)
    body = build_response(CHAT_COMPLETIONS, "abc", "tiny", 12, " hello world", ids, "stop", None, tokenizer,
                          None, created=1700000000, cached_tokens=8)
    assert body == {
        "id": "chatcmpl-abc", "object": "chat.completion", "created": 1700000000, "model": "tiny",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " hello world"},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 12, "completion_tokens": len(ids), "total_tokens": 12 + len(ids),
                  "prompt_tokens_details": {"cached_tokens": 8}},
    }
    json.dumps(body)


def test_chat_logprobs_shape(tokenizer):
    ids = tokenizer.encode(" hello world", add_special_tokens=False)
    lps = [TokenLogprob(t, -0.5, [(t, -0.5), (7, -1.5)]) for t in ids]
    body = build_response(CHAT_COMPLETIONS, "abc", "tiny", 3, " hello world", ids, "length", lps, tokenizer, 2)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids)
    assert "".join(e["token"] for e in content) == " hello world"
    first = content[0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["bytes"] == list(first["token"].encode())
    assert first["top_logprobs"][1] == {"token": tokenizer.decode([7]), "logprob": -1.5,
                                        "bytes": list(tokenizer.decode([7]).encode())}
    assert body["choices"][0]["finish_reason"] == "length"


def test_partial_utf8_token_keeps_its_bytes(tokenizer):
    # byte-level BPE: the single-byte token for 0xE4 (first byte of many CJK characters)
    token_id = tokenizer.convert_tokens_to_ids("\u00e4")
    body = build_response(CHAT_COMPLETIONS, "x", "m", 1, "", [token_id], "length",
                          [TokenLogprob(token_id, -1.0, [])], tokenizer, 0)
    assert body["choices"][0]["logprobs"]["content"][0]["bytes"] == [0xE4]


def test_completion_response_and_logprobs(tokenizer):
    ids = tokenizer.encode(" hello world", add_special_tokens=False)
    lps = [TokenLogprob(t, -0.25, [(7, -0.1)]) for t in ids]
    body = build_response(COMPLETIONS, "cmpl-q", "tiny", 4, " hello world", ids, "abort", lps, tokenizer, 1,
                          created=5)
    assert body["id"] == "cmpl-q" and body["object"] == "text_completion" and body["created"] == 5
    choice = body["choices"][0]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert choice["finish_reason"] == "length"  # "abort" is not an OpenAI value
    lp = choice["logprobs"]
    tokens = [tokenizer.decode([t]) for t in ids]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [-0.25] * len(ids)
    # the chosen token is always among the top ones (OpenAI: up to logprobs + 1 entries)
    assert lp["top_logprobs"][0] == {tokenizer.decode([7]): -0.1, tokens[0]: -0.25}
    assert lp["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert body["usage"]["completion_tokens"] == len(ids)
    no_lp = build_response(COMPLETIONS, "q", "tiny", 4, "x", ids, "stop", None, tokenizer, None)
    assert no_lp["choices"][0]["logprobs"] is None and no_lp["id"] == "cmpl-q"


# -- batch lines ----------------------------------------------------------------------------


def line(**fields) -> str:
    obj = {"custom_id": "a", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "x"}, **fields}
    return json.dumps({k: v for k, v in obj.items() if v is not None})


def test_parse_batch_line():
    parsed = parse_batch_line(line(), 1)
    assert (parsed.custom_id, parsed.method, parsed.url, parsed.body) == ("a", "POST", COMPLETIONS, {"prompt": "x"})


@pytest.mark.parametrize("text, words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (line(custom_id=None), "custom_id"),
    (line(custom_id=7), "custom_id"),
    (line(method="GET"), "method"),
    (line(url="/v1/rerank"), "url"),
    (line(body="x"), "body"),
])
def test_bad_batch_lines_name_line_and_problem(text, words):
    with pytest.raises(RequestError) as info:
        parse_batch_line(text, 42)
    assert info.value.message.startswith("line 42:")
    assert words in info.value.message


def test_batch_output_and_error_lines():
    out = batch_output_line("c1", "req1", {"x": 1})
    assert out["id"].startswith("batch_req_")
    assert out["custom_id"] == "c1" and out["error"] is None
    assert out["response"] == {"status_code": 200, "request_id": "req1", "body": {"x": 1}}
    err = batch_error_line(None, 7, "invalid_json_line", "not valid JSON")
    assert err["id"].startswith("batch_req_") and err["custom_id"] is None and err["response"] is None
    assert err["error"] == {"code": "invalid_json_line", "message": "line 7: not valid JSON"}
    assert batch_error_line("c", 7, "x", "line 7: said already")["error"]["message"] == "line 7: said already"


@pytest.mark.parametrize("name", ["eos_token", "bos_token", "raise_exception", "_private"])
def test_chat_template_kwargs_cannot_set_what_the_template_takes_from_the_model(tokenizer, name):
    with pytest.raises(RequestError) as caught:
        chat(tokenizer, chat_template_kwargs={name: "x"})
    assert caught.value.param == f"chat_template_kwargs.{name}"
    assert "from the model" in caught.value.message or "apply_chat_template" in caught.value.message
    chat(tokenizer, chat_template_kwargs={"enable_thinking": False})   # a template's own variable is fine


def test_responses_that_would_repeat_the_prompt_too_often_are_refused(tokenizer):
    def request(endpoint, **fields):
        base = {"messages": CHAT} if endpoint == CHAT_COMPLETIONS else {"prompt": list(range(10, 1034))}
        return parse_request(endpoint, {**base, **fields}, tokenizer, 8192)

    # The shape that made 6.7 MB of JSON (n=4, 1,024 tokens, prompt_logprobs=20) is within the cap; 16x it is not.
    request(COMPLETIONS, n=4, prompt_logprobs=20, max_tokens=4)
    with pytest.raises(RequestError) as caught:
        request(COMPLETIONS, n=64, prompt_logprobs=20, max_tokens=4)
    assert caught.value.param == "prompt_logprobs" and "cap of 262144" in caught.value.message
    with pytest.raises(RequestError) as caught:
        request(COMPLETIONS, n=128, echo=True, logprobs=5, max_tokens=4)
    assert caught.value.param == "echo"
    with pytest.raises(RequestError) as caught:
        request(CHAT_COMPLETIONS, n=128, logprobs=True, top_logprobs=20, max_tokens=1000)
    assert caught.value.param == "top_logprobs" and "lower n, max_tokens or top_logprobs" in caught.value.message
