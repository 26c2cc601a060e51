"""n > 1, best_of, echo, prompt logprobs, logit_bias and min_tokens through the service's
pieces, fed hand-built engine outputs: request parsing (rein.openai.request), gathering per
choice (rein.openai.response_shape, the runner's CollectingStream, the offline driver), response bodies
(rein.openai.choices_response, the recorder's merge), the publisher's token events and the OpenAI
chunk stream (rein.api.streams)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from rein.engine.client import CollectingStream
from rein.engine.request_result import RequestResult
from rein.engine.step_outputs import RequestOutput, TokenLogprob
from rein.openai.choices_response import full_response, response_extra
from rein.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.request import parse_request
from rein.openai.response import build_response
from rein.openai.response_shape import ResponseShape, returned_choices
from rein.store.messages import JobMessage, TokenEvent
from rein.store.redis_keys import RedisKeys

MAX_LEN = 256
CHAT = [{"role": "user", "content": "Hello there"}]


def parse(tokenizer, endpoint=COMPLETIONS, **fields):
    base = {"messages": CHAT} if endpoint == CHAT_COMPLETIONS else {"prompt": "def f(x):"}
    return parse_request(endpoint, {**base, **fields}, tokenizer, MAX_LEN)


def refused(tokenizer, endpoint=COMPLETIONS, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(tokenizer, endpoint, **fields)
    return info.value


def out(index, ids, text, *, finish=None, finished=False, prompt=5, lps=None, prompt_lps=None, cached=0):
    return RequestOutput("r", ids, text, finished=finished, finish_reason=finish, num_prompt_tokens=prompt,
                         num_output_tokens=0, logprobs=lps, num_cached_tokens=cached, index=index,
                         prompt_logprobs=prompt_lps)


def numbered(outputs):
    """Each output's num_output_tokens: its choice's count so far (as the engine sets it)."""
    counts: dict[int, int] = {}
    for o in outputs:
        counts[o.index] = counts.get(o.index, 0) + len(o.new_token_ids)
        o.num_output_tokens = counts[o.index]
    return outputs


def two_choices():
    """n=2: choice 1 ends first (stop), choice 0 ends the request (length)."""
    return numbered([
        out(0, [10], "a"), out(1, [20], "x"),
        out(0, [11], "b"), out(1, [21], "y", finish="stop"),
        out(0, [12], "c", finish="length", finished=True),
    ])


# -- parsing --------------------------------------------------------------------------------


def test_n_and_stream_with_n(tokenizer):
    parsed = parse(tokenizer, CHAT_COMPLETIONS, n=4, max_tokens=5)
    assert parsed.params.n == 4 and parsed.shape.n == 4 and not parsed.shape.plain
    assert parse(tokenizer, CHAT_COMPLETIONS, n=128, stream=True, max_tokens=5).params.n == 128
    assert parse(tokenizer).shape.plain and parse(tokenizer).shape.to_dict() is None
    assert refused(tokenizer, CHAT_COMPLETIONS, n=129).param == "n"
    assert refused(tokenizer, n=True).param == "n"


def test_context_length_counts_max_tokens_once_per_choice(tokenizer):
    prompt = len(parse(tokenizer).prompt_token_ids)
    # Each choice has its own max_tokens beside the shared prompt (vLLM): n does not multiply it.
    assert parse(tokenizer, n=8, max_tokens=MAX_LEN - prompt).params.max_tokens == MAX_LEN - prompt
    assert refused(tokenizer, n=8, max_tokens=MAX_LEN - prompt + 1).code == "context_length_exceeded"


def test_best_of_generates_more_and_ranks_by_logprob(tokenizer):
    parsed = parse(tokenizer, n=2, best_of=5)
    assert parsed.params.n == 5 and parsed.shape.n == 2 and parsed.shape.best_of == 5
    assert parsed.params.logprobs == 0 and parsed.logprobs_mode is None   # ranked, not returned
    assert parse(tokenizer, best_of=3, logprobs=2).params.logprobs == 2
    assert refused(tokenizer, n=3, best_of=2).param == "best_of"
    assert refused(tokenizer, best_of=200).param == "best_of"
    err = refused(tokenizer, best_of=3, stream=True)
    assert err.param == "best_of" and "stream" in err.message
    assert parse(tokenizer, n=2, best_of=2, stream=True).params.n == 2      # best_of == n streams


def test_logit_bias(tokenizer):
    parsed = parse(tokenizer, logit_bias={"5": 100, "7": -100.0, "9": 0.5})
    assert parsed.params.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}
    vocab = len(tokenizer)
    err = refused(tokenizer, logit_bias={str(vocab): 1})
    assert err.param == "logit_bias" and str(vocab) in err.message and f"0 to {vocab - 1}" in err.message
    for bad_key in ("-1", "x", "1.5", ""):
        assert refused(tokenizer, logit_bias={bad_key: 1}).param == "logit_bias"
    err = refused(tokenizer, logit_bias={"5": 101})
    assert err.param == "logit_bias" and "-100 and 100" in err.message and "101" in err.message
    assert refused(tokenizer, logit_bias={"5": "high"}).param == "logit_bias"
    assert refused(tokenizer, logit_bias={"5": True}).param == "logit_bias"
    assert refused(tokenizer, logit_bias=[5]).param == "logit_bias"
    assert parse(tokenizer, logit_bias={}).params.logit_bias is None
    # It survives the queue message's JSON (keys become strings again).
    sampling = json.loads(json.dumps({"logit_bias": parsed.params.logit_bias, "max_tokens": 3}))
    from rein.engine.sampling_params import SamplingParams
    assert SamplingParams(**sampling).logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}


def test_min_tokens(tokenizer):
    assert parse(tokenizer, CHAT_COMPLETIONS, min_tokens=3, max_tokens=5).params.min_tokens == 3
    assert parse(tokenizer, min_tokens=0).params.min_tokens == 0
    err = refused(tokenizer, min_tokens=6, max_tokens=5)
    assert err.param == "min_tokens" and "max_tokens (5)" in err.message
    assert refused(tokenizer, min_tokens=-1).param == "min_tokens"


def test_echo_and_prompt_logprobs(tokenizer):
    parsed = parse(tokenizer, echo=True)
    assert parsed.shape.echo == "def f(x):" and parsed.params.prompt_logprobs is None
    with_logprobs = parse(tokenizer, echo=True, logprobs=2)
    assert with_logprobs.params.prompt_logprobs == 2 and with_logprobs.shape.prompt_logprobs is None
    ids = parse(tokenizer, prompt=[5, 6, 7], echo=True)
    assert ids.shape.echo == tokenizer.decode([5, 6, 7])
    assert parse(tokenizer, echo=False).shape.plain
    both = parse(tokenizer, echo=True, logprobs=1, prompt_logprobs=3)
    assert both.params.prompt_logprobs == 3 and both.shape.prompt_logprobs == 3
    assert parse(tokenizer, CHAT_COMPLETIONS, prompt_logprobs=0).params.prompt_logprobs == 0
    assert refused(tokenizer, prompt_logprobs=21).param == "prompt_logprobs"
    assert refused(tokenizer, prompt_logprobs=2, stream=True).param == "prompt_logprobs"
    assert refused(tokenizer, CHAT_COMPLETIONS, echo=True).param == "echo"


def test_shape_round_trips_through_the_queue_message():
    shape = ResponseShape(n=2, echo="hi", prompt_logprobs=1, best_of=4)
    message = JobMessage(job_id="j", model="m", endpoint=COMPLETIONS, prompt_token_ids=[1], sampling={},
                         shape=shape.to_dict())
    again = JobMessage.from_dict(json.loads(json.dumps(message.to_dict())))
    assert ResponseShape.from_dict(again.shape) == shape
    job = SimpleNamespace(id="j", model="m", endpoint=COMPLETIONS, prompt_token_ids=[1], priority=0, tenant="t",
                          key_id="k", params={"sampling": {}, "shape": shape.to_dict()})
    assert JobMessage.for_job(job).shape == shape.to_dict()


# -- gathering ------------------------------------------------------------------------------


def test_gatherer_and_collecting_stream_keep_choices_apart():
    stream = CollectingStream("r", runner=None)   # the runner is only needed to abort
    for output in two_choices():
        stream._put(output)
    assert stream.wait(0)
    collected = stream.collected
    assert collected.text == "abc" and collected.token_ids == [10, 11, 12]     # choice 0
    choices = collected.ordered()
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in choices] == [
        (0, "abc", [10, 11, 12], "length"), (1, "xy", [20, 21], "stop")]
    assert collected.completion_tokens == 5 and collected.final.finished


def test_an_abort_ends_every_choice():
    gathered = RequestResult()
    for output in numbered([out(0, [1], "a"), out(1, [2], "b"), out(0, [], "", finish="abort", finished=True)]):
        gathered.add(output)
    assert [c.finish_reason for c in gathered.ordered()] == ["abort", "abort"]


def test_best_of_returns_the_likeliest_renumbered():
    gathered = RequestResult()
    for index, logprob in enumerate([-3.0, -0.5, -2.0]):
        gathered.add(out(index, [index], str(index), finish="stop", finished=index == 2,
                         lps=[TokenLogprob(index, logprob)]))
    kept = returned_choices(gathered.ordered(), ResponseShape(n=2, best_of=3))
    assert [(c.index, c.text) for c in kept] == [(0, "1"), (1, "2")]
    assert returned_choices(gathered.ordered(), ResponseShape(n=3)) == gathered.ordered()


# -- bodies ---------------------------------------------------------------------------------


def gathered_of(outputs) -> RequestResult:
    gathered = RequestResult()
    for output in outputs:
        gathered.add(output)
    return gathered


def test_n_choices_body_counts_the_prompt_once(tokenizer):
    gathered = gathered_of(two_choices())
    body = full_response(CHAT_COMPLETIONS, "j1", "tiny", gathered, [1, 2, 3, 4, 5], tokenizer, None,
                         ResponseShape(n=2), created=7)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in body["choices"]] == ["abc", "xy"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    # Each choice is shaped exactly as the plain body's one choice.
    plain = build_response(CHAT_COMPLETIONS, "j1", "tiny", 5, "xy", [20, 21], "stop", None, tokenizer, None)
    assert body["choices"][1] == {**plain["choices"][0], "index": 1}
    assert body["id"] == "chatcmpl-j1" and body["created"] == 7
    completion = full_response(COMPLETIONS, "j1", "tiny", gathered, [1, 2, 3, 4, 5], tokenizer, None,
                               ResponseShape(n=2))
    assert [c["text"] for c in completion["choices"]] == ["abc", "xy"]


def test_a_plain_request_stores_nothing_more(tokenizer):
    gathered = gathered_of(numbered([out(0, [1], "a", finish="stop", finished=True)]))
    assert response_extra(CHAT_COMPLETIONS, gathered, [1, 2], tokenizer, None, ResponseShape()) is None


def test_echo_with_logprobs_is_the_legacy_completions_shape(tokenizer):
    prompt = tokenizer.encode("def f(x):", add_special_tokens=True)
    prompt_lps = [None] + [TokenLogprob(t, -1.0 - i, [(t, -1.0 - i), (9, -4.0)]) for i, t in enumerate(prompt[1:])]
    generated = tokenizer.encode(" return", add_special_tokens=False)
    gathered = gathered_of(numbered([
        out(0, generated, " return", finish="length", finished=True, prompt=len(prompt), prompt_lps=prompt_lps,
            lps=[TokenLogprob(t, -0.5, [(t, -0.5)]) for t in generated])]))
    shape = ResponseShape(echo="def f(x):")
    body = full_response(COMPLETIONS, "c", "tiny", gathered, prompt, tokenizer, 1, shape)
    choice = body["choices"][0]
    assert choice["text"] == "def f(x): return"
    logprobs = choice["logprobs"]
    n_prompt = len(prompt)
    assert len(logprobs["tokens"]) == n_prompt + len(generated)
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt + generated]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1] == -1.0 and logprobs["token_logprobs"][n_prompt:] == [-0.5] * len(generated)
    # logprobs=1: the top alternative and the token itself.
    assert logprobs["top_logprobs"][1] == {tokenizer.decode([prompt[1]]): -1.0}
    assert logprobs["text_offset"][0] == 0
    offsets = logprobs["text_offset"]
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False))
    assert body["usage"]["prompt_tokens"] == n_prompt and body["usage"]["completion_tokens"] == len(generated)
    # Echo without logprobs: the text only.
    plain = full_response(COMPLETIONS, "c", "tiny", gathered, prompt, tokenizer, None, shape)
    assert plain["choices"][0]["text"] == "def f(x): return" and plain["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_shape(tokenizer):
    prompt = [1, 5, 6]
    prompt_lps = [None, TokenLogprob(5, -2.0, [(7, -0.5), (5, -2.0)]), TokenLogprob(6, float("-inf"), [(8, -0.1)])]
    gathered = gathered_of(numbered([out(0, [9], "z", finish="stop", finished=True, prompt=3,
                                         prompt_lps=prompt_lps)]))
    body = full_response(COMPLETIONS, "c", "tiny", gathered, prompt, tokenizer, None, ResponseShape(prompt_logprobs=1))
    entries = body["choices"][0]["prompt_logprobs"]
    assert entries[0] is None
    assert entries[1] == {"5": {"logprob": -2.0, "rank": None, "decoded_token": tokenizer.decode([5])},
                          "7": {"logprob": -0.5, "rank": 1, "decoded_token": tokenizer.decode([7])}}
    assert entries[2]["6"]["logprob"] == -9999.0     # -inf clamped, as vLLM does
    json.loads(json.dumps(body, allow_nan=False))
    chat = full_response(CHAT_COMPLETIONS, "c", "tiny", gathered, prompt, tokenizer, None,
                         ResponseShape(prompt_logprobs=1))
    assert chat["prompt_logprobs"] == entries and "prompt_logprobs" not in chat["choices"][0]


def test_recorder_merges_the_stored_choices(tokenizer):
    from datetime import UTC, datetime

    from rein.jobs.results import response_body
    gathered = gathered_of(two_choices())
    extra = response_extra(COMPLETIONS, gathered, [1, 2, 3, 4, 5], tokenizer, None, ResponseShape(n=2))
    job = SimpleNamespace(endpoint=COMPLETIONS, id="job_1", model="tiny", prompt_tokens=5, params={}, priority=0,
                          finished_at=datetime(2024, 1, 1, tzinfo=UTC))
    result = SimpleNamespace(text="abc", token_ids=[10, 11, 12], finish_reason="length", logprobs=None,
                             response=extra, created_at=None)
    body = response_body(job, result)
    assert [c["text"] for c in body["choices"]] == ["abc", "xy"]
    assert body["usage"]["completion_tokens"] == 5 and body["id"] == "cmpl-job_1"
    result.response = None
    assert [c["text"] for c in response_body(job, result)["choices"]] == ["abc"]


def test_worker_job_record_of_several_choices(tokenizer):
    from rein.engine.sampling_params import SamplingParams
    from rein.worker.tasks import job_record
    stream = CollectingStream("r", runner=None)
    for output in two_choices():
        stream._put(output)
    message = JobMessage(job_id="j", model="m", endpoint=CHAT_COMPLETIONS, prompt_token_ids=[1, 2, 3, 4, 5],
                         sampling={}, shape=ResponseShape(n=2).to_dict())
    record = job_record(message, CHAT_COMPLETIONS, stream.collected, SamplingParams(n=2), tokenizer)
    assert (record.text, record.token_ids, record.finish_reason) == ("abc", [10, 11, 12], "length")
    assert record.prompt_tokens == 5 and record.completion_tokens == 5
    assert [c["message"]["content"] for c in record.response["choices"]] == ["abc", "xy"]
    plain = JobMessage(job_id="j", model="m", endpoint=CHAT_COMPLETIONS, prompt_token_ids=[1, 2], sampling={})
    one = CollectingStream("r", runner=None)
    one._put(numbered([out(0, [4], "q", finish="stop", finished=True, prompt=2)])[0])
    record = job_record(plain, CHAT_COMPLETIONS, one.collected, SamplingParams(), tokenizer)
    assert record.response is None and record.text == "q" and record.completion_tokens == 1


# -- events and streams ---------------------------------------------------------------------


class _Pipe:
    def __init__(self, sent):
        self.sent = sent

    def xadd(self, stream, fields, **kwargs):
        self.sent.append(TokenEvent.from_json(fields["data"]))

    def publish(self, *args):
        pass

    def expire(self, *args):
        pass

    def delete(self, *args):
        pass

    def execute(self, raise_on_error=False):
        return []


class _Redis:
    def __init__(self):
        self.sent: list[TokenEvent] = []

    def pipeline(self, transaction=False):
        return _Pipe(self.sent)

    def evalsha(self, sha, numkeys, *keys_and_args):
        """The publisher's script: after 5 fixed ARGV, (seq, final, json) per event."""
        self.sent += [TokenEvent.from_json(data) for data in keys_and_args[numkeys + 7::3]]
        return []


def test_publisher_events_carry_the_choice_index():
    from rein.worker.publisher import TokenPublisher
    redis = _Redis()
    publisher = TokenPublisher(redis, RedisKeys("unit:"), 1000, 60, 600)
    publisher.begin("r")
    outputs = two_choices()
    for step in (outputs[:2], outputs[2:4], outputs[4:]):
        publisher.publish_step(step)
    events = redis.sent
    assert [(e.seq, e.index, e.text) for e in events] == [(1, 0, "a"), (2, 1, "x"), (3, 0, "b"), (4, 1, "y"),
                                                          (5, 0, "c")]
    assert events[3].choice_finish_reason == "stop" and events[3].finish_reason is None and not events[3].final
    last = events[4]
    assert last.final and last.finish_reason == "length" and last.choice_finish_reason == "length"
    assert last.usage["completion_tokens"] == 5 and last.usage["prompt_tokens"] == 5
    # A plain request's events are as before: no index, no choice_finish_reason.
    publisher.begin("r")
    publisher.publish_step(numbered([out(0, [1], "a"), ])[:1])
    publisher.publish_step([RequestOutput("r", [2], "b", True, "stop", num_prompt_tokens=5, num_output_tokens=2)])
    plain = [json.loads(e.to_json()) for e in redis.sent[5:]]
    assert all("index" not in e and "choice_finish_reason" not in e for e in plain)
    assert plain[-1]["usage"]["completion_tokens"] == 2


def _chunks(data_events, **kwargs) -> list:
    from rein.api.streams import StreamEvent, openai_chunk_stream

    async def events():
        for seq, data in enumerate(data_events, start=1):
            yield StreamEvent(seq, {"seq": seq, **data})

    async def run():
        return [piece async for piece in openai_chunk_stream(events(), job_id="j", model="m", prompt_tokens=5,
                                                              **kwargs)]

    pieces = asyncio.run(run())
    assert pieces[-1] == "data: [DONE]\n\n"
    return [json.loads(p.removeprefix("data: ")) for p in pieces[:-1]]


def _events_of(outputs):
    redis = _Redis()
    from rein.worker.publisher import TokenPublisher
    publisher = TokenPublisher(redis, RedisKeys("unit:"), 1000, 60, 600)
    publisher.begin("r")
    publisher.publish_step(outputs)
    return [json.loads(e.to_json()) for e in redis.sent]


def test_chunk_stream_interleaves_choices_each_with_its_finish():
    chunks = _chunks(_events_of(two_choices()), endpoint=CHAT_COMPLETIONS, include_usage=True, n=2)
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    text = {0: "", 1: ""}
    finishes = {}
    for c in chunks[:-1]:
        choice = c["choices"][0]
        text[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            assert choice["index"] not in finishes
            finishes[choice["index"]] = choice["finish_reason"]
    assert text == {0: "abc", 1: "xy"} and finishes == {0: "length", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_chunk_stream_echoes_and_finishes_aborted_choices():
    events = _events_of(numbered([out(0, [1], "a"), out(1, [2], "b"),
                                  out(0, [], "", finish="abort", finished=True)]))
    chunks = _chunks(events, endpoint=COMPLETIONS, include_usage=False, n=2, echo="P:")
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        choice = c["choices"][0]
        by_index[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert by_index == {0: "P:a", 1: "P:b"} and finishes == {0: "length", 1: "length"}


def test_a_plain_chunk_stream_is_unchanged():
    events = _events_of(numbered([out(0, [1], "a"), out(0, [2], "b", finish="stop", finished=True)]))
    chunks = _chunks(events, endpoint=COMPLETIONS, include_usage=False)
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [("a", None),
                                                                                             ("b", "stop")]


def test_replay_of_several_choices_sends_each_once():
    from rein.api.streams import replay_events
    extra = {"choices": [{"index": 0, "text": "P:abc", "finish_reason": "length"},
                         {"index": 1, "text": "P:xy", "finish_reason": "stop"}]}
    job = SimpleNamespace(status="succeeded", params={"shape": {"n": 2, "echo": "P:"}}, prompt_tokens=5,
                          result=SimpleNamespace(text="abc", token_ids=[10, 11, 12], finish_reason="length",
                                                 response=extra),
                          usage=SimpleNamespace(prompt_tokens=5, completion_tokens=5, cached_tokens=0), error=None)
    events = replay_events(job, 3, {0: [1, 1]})
    assert [(e.seq, e.data["index"], e.data["text"]) for e in events] == [(3, 0, "bc"), (4, 1, "xy")]
    assert events[0].data["token_ids"] == [11, 12] and not events[0].final
    assert events[1].final and events[1].data["usage"]["completion_tokens"] == 5


def test_tpm_charges_every_generated_choice(tokenizer):
    from rein.jobs.prepare import Prepared
    body = {"prompt": "def f(x):", "max_tokens": 10, "n": 3, "best_of": 4}
    parsed = parse_request(COMPLETIONS, body, tokenizer, MAX_LEN)
    prepared = Prepared(None, COMPLETIONS, body, parsed)
    prompt = len(parsed.prompt_token_ids)
    assert prepared.charged_tokens(500) == prompt + 4 * 10 == prepared.requested_tokens
    unbounded = {"prompt": "def f(x):", "n": 2}
    assert Prepared(None, COMPLETIONS, unbounded, parse_request(COMPLETIONS, unbounded, tokenizer, MAX_LEN)
                    ).charged_tokens(8) == prompt + 2 * 8
