"""validate_lines without services: what it hands on, what it reports, with the tiny model's tokenizer;
lines read under the length cap (read_lines), and the memory a long line costs."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest

from rein.batches.validation import MAX_REPORTED_ERRORS, validate_lines
from rein.core.settings import Settings
from rein.jobs.registry import ModelRegistry
from rein.openai.batch_lines import OversizedLine, read_lines


@pytest.fixture(scope="module")
def registry(tiny_models) -> ModelRegistry:
    model = tiny_models("llama")
    return ModelRegistry.load(Settings(models=f"tiny={model}@256,other={model}@256"))


def raw(*lines: dict | str | bytes) -> list[bytes]:
    return [x if isinstance(x, bytes) else ((x if isinstance(x, str) else json.dumps(x)) + "\n").encode()
            for x in lines]


def chat(custom_id: str, model: str = "tiny", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}}


def test_good_lines_are_handed_on_with_their_jobs(registry):
    handed = []
    result = validate_lines(raw(chat("a"), "   ", chat("b", temperature=0.0)), "/v1/chat/completions", registry,
                            10, on_valid=handed.append)
    assert result.ok and result.valid == result.requests == 2 and result.model == "tiny"
    assert [(v.line, v.custom_id) for v in handed] == [(1, "a"), (3, "b")]
    values = handed[1].job_values()
    assert values["model"] == "tiny" and values["custom_id"] == "b" and values["batch_line"] == 3
    assert values["params"]["sampling"]["temperature"] == 0.0 and values["params"]["sampling"]["max_tokens"] == 4
    assert values["prompt_tokens"] == len(values["prompt_token_ids"]) > 0


def test_nothing_is_handed_on_after_a_bad_line(registry):
    handed = []
    result = validate_lines(raw(chat("a"), chat("b", model="other"), chat("c"), b"\xff\xfe\n"),
                            "/v1/chat/completions", registry, 10, on_valid=handed.append)
    assert [v.custom_id for v in handed] == ["a"]
    assert [(e["line"], e["code"], e["param"]) for e in result.errors] == [
        (2, "mismatched_model", "body.model"), (4, "invalid_json_line", None)]


def test_sampling_and_context_errors_name_the_body_field(registry):
    result = validate_lines(raw(chat("a", temperature="hot"), chat("b", max_tokens=300)), "/v1/chat/completions",
                            registry, 10)
    assert [(e["line"], e["param"]) for e in result.errors] == [(1, "body.temperature"), (2, "body.messages")]
    assert result.errors[1]["code"] == "context_length_exceeded"


def test_reported_errors_are_capped(registry):
    result = validate_lines(raw(*["{"] * (MAX_REPORTED_ERRORS + 5)), "/v1/chat/completions", registry, 10**6)
    assert len(result.errors) == MAX_REPORTED_ERRORS and result.requests == MAX_REPORTED_ERRORS + 5


def test_a_grammar_that_crashes_the_compiler_fails_its_line_only(registry, monkeypatch):
    from rein.engine.structured import limits

    monkeypatch.setattr(limits, "MAX_GRAMMAR_RULES", 10_000)   # past the cap, into a validator process
    bomb = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3500)) + 'r3500: "a"\n'
    result = validate_lines(raw(chat("a"), chat("bomb", guided_grammar=bomb), chat("c")),
                            "/v1/chat/completions", registry, 10, on_valid=lambda line: None)
    assert [(e["line"], e["param"]) for e in result.errors] == [(2, "body.guided_grammar")]
    assert "crashed rein's grammar compiler" in result.errors[0]["message"]


def test_before_line_runs_for_every_line_and_can_stop_it(registry):
    """The manager's deadline check runs before each line, after a bad one too (it used to run
    only when a valid line was stored, so a file whose first line was bad ran to its end)."""
    seen = []

    class Deadline(Exception):
        pass

    def before_line(number):
        seen.append(number)
        if number == 4:
            raise Deadline

    lines = raw(chat("a", model="nope"), *(chat(f"x{i}") for i in range(10)))
    with pytest.raises(Deadline):
        validate_lines(lines, "/v1/chat/completions", registry, 100, before_line=before_line)
    assert seen == [1, 2, 3, 4]


# -- lines under the length cap (rein.openai.batch_lines.read_lines) ------------------------------


class Unseekable(io.RawIOBase):
    """A stream that cannot seek (as an object store's download might be)."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._data.readinto(buffer)


@pytest.mark.parametrize("seekable", [True, False])
def test_a_line_past_the_cap_comes_as_its_size_and_the_others_as_they_are(seekable):
    cap = 200_000
    long_ok = b"L" * 150_000 + b"\n"             # longer than a read chunk, within the cap
    content = (b"a" * cap + b"\n" + b"b" * (cap + 1) + b"\n" + b"c\n" + long_ok + b"d" * 1_000_000 + b"\n\n"
               + b"e" * (cap + 1))
    source = io.BytesIO(content) if seekable else io.BufferedReader(Unseekable(content))
    assert source.seekable() is seekable
    lines = list(read_lines(source, cap))
    assert lines == [b"a" * cap + b"\n", OversizedLine(cap + 1, cap), b"c\n", long_ok, OversizedLine(1_000_000, cap),
                     b"\n", OversizedLine(cap + 1, cap)]
    assert list(read_lines(io.BytesIO(b"x\ny"), cap)) == [b"x\n", b"y"]   # as iterating the file gives them
    assert list(read_lines(io.BytesIO(b"x" * 10 + b"\n"), 9)) == [OversizedLine(10, 9)]


def test_a_line_past_the_cap_is_that_lines_error_and_the_others_are_checked(registry):
    cap = 1024
    lines = read_lines(io.BytesIO(b"".join(raw(chat("a"), {**chat("big"), "pad": "x" * 5000}, chat("c", model="nope"),
                                               chat("d")))), cap)
    handed = []
    result = validate_lines(lines, "/v1/chat/completions", registry, 10, on_valid=handed.append)
    assert result.requests == 4 and [v.custom_id for v in handed] == ["a"]
    assert [(e["line"], e["code"]) for e in result.errors] == [(2, "line_too_large"), (3, "model_not_found")]
    message = result.errors[0]["message"]
    size = len(json.dumps({**chat("big"), "pad": "x" * 5000}))
    assert message.startswith("line 2: ") and f"{size} bytes" in message and f"limit of {cap} bytes" in message
    assert "REIN_MAX_REQUEST_BYTES" in message and "smaller" in message


def test_validating_a_long_line_holds_a_bounded_amount_of_memory(registry, tmp_path):
    """A 20 MB line under the default 16 MiB cap: measured a chunk at a time, skipped, never
    parsed, so the validation's peak of Python allocations is a small fraction of the line (which
    json.loads would need about 25 times of), and of the cap too."""
    cap = Settings.model_fields["max_request_bytes"].default
    path = tmp_path / "in.jsonl"
    long_line = json.dumps({**chat("long"), "pad": "x" * 20_000_000}).encode()   # a string: cheap to parse
    path.write_bytes(b"".join(raw(chat("a"))) + long_line + b"\n" + b"".join(raw(chat("b"))))
    del long_line
    handed = []
    tracemalloc.start()
    try:
        with open(path, "rb") as source:
            result = validate_lines(read_lines(source, cap), "/v1/chat/completions", registry, 10,
                                    on_valid=handed.append)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"peak {peak / 2**20:.2f} MiB")
    assert peak < 2 * 2**20, f"peak {peak / 2**20:.1f} MiB for a 20 MB line under a {cap / 2**20:.0f} MiB cap"
    assert [(e["line"], e["code"]) for e in result.errors] == [(2, "line_too_large")]
    assert [v.custom_id for v in handed] == ["a"]


def test_run_batch_answers_a_line_past_the_cap_with_an_error_line(tiny_models, tmp_path):
    """`rein run-batch` reads its input under the same cap: the long line gets an error line
    naming it, and the lines around it are answered."""
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    from rein.offline.run_batch import run_batch

    engine = LLMEngine(EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="64MiB", max_num_seqs=2,
                                    max_model_len=256))
    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    long_line = json.dumps({**chat("long"), "pad": "x" * 50_000})
    src.write_bytes(b"".join(raw(chat("a"), long_line, chat("b"))))
    summary = run_batch(engine, src, out, error_path=err, progress=False, max_line_bytes=10_000)
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == ["a", "b"]
    [error] = [json.loads(x) for x in err.read_text().splitlines()]
    assert error["error"]["code"] == "line_too_large" and error["custom_id"] is None
    assert error["error"]["message"].startswith(f"line 2: the line is {len(long_line)} bytes")
    assert (summary.requests_ok, summary.requests_failed) == (2, 1)


def embed(custom_id: str, given) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": given}}


@pytest.mark.parametrize(("cap", "failing_line"), [(7, None), (6, 4), (4, 3), (3, 2), (None, None)])
def test_embedding_inputs_are_counted_across_lines_and_capped(tiny_models, cap, failing_line):
    """OpenAI's count: a string is 1 input, a list of strings or of token-id lists one per item, a
    single token-id list 1. Past the cap the batch fails at the line that passed it."""
    registry = ModelRegistry.load(Settings(models=f"emb={tiny_models('qwen3', embedding='last')}@256"))
    lines = raw(embed("a", "x"), embed("b", ["a", "b", "c"]), embed("c", [1, 2, 3]), embed("d", [[1, 2], [3]]))
    handed = []
    result = validate_lines(lines, "/v1/embeddings", registry, 10, on_valid=handed.append,
                            max_embedding_inputs=cap)
    if failing_line is None:
        assert result.ok and result.embedding_inputs == 7 and len(handed) == 4
        return
    [error] = result.errors
    assert (error["code"], error["line"], error["param"]) == ("too_many_embedding_inputs", failing_line, "body.input")
    assert str(cap) in error["message"] and "REIN_BATCH_MAX_EMBEDDING_INPUTS" in error["message"]
    assert len(handed) == failing_line - 1
