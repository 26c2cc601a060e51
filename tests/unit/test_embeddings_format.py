"""/v1/embeddings requests and responses (rein.openai.embeddings), the pooling config read
from a model's files (rein.model.pooling_config) and the pooling math (rein.engine.pooler)."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from rein.engine.pooler import finish_vector, gather
from rein.model.pooling_config import (
    PoolingConfig,
    PoolingError,
    PoolingParams,
    read_pooling_config,
)
from rein.openai.batch_lines import parse_batch_line
from rein.openai.embeddings import (
    MAX_EMBEDDING_VALUES,
    MAX_INPUTS,
    MAX_TOTAL_TOKENS,
    embeddings_body,
    encode_vector,
    job_embeddings_body,
    parse_embeddings_request,
    split_inputs,
    stored_response,
)
from rein.openai.errors import RequestError
from rein.store.messages import JobMessage

MATRYOSHKA = PoolingConfig(hidden_size=64, is_matryoshka=True)


class Tokenizer:
    """Characters as token ids, plus an end-of-text id 99 appended with special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 90 for c in text] + ([99] if add_special_tokens else [])

    def __len__(self) -> int:
        return 100


def parse(body, max_model_len=32, pooling=MATRYOSHKA):
    return parse_embeddings_request(body, Tokenizer(), max_model_len, pooling)


def refused(body, **kwargs) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(body, **kwargs)
    return info.value


# -- requests ---------------------------------------------------------------------------------


def test_input_forms():
    assert parse({"input": "ab"}).inputs == [[7, 8, 99]]          # special tokens added, as vLLM
    assert parse({"input": ["a", "bc"]}).inputs == [[7, 99], [8, 9, 99]]
    assert parse({"input": [1, 2, 3]}).inputs == [[1, 2, 3]]      # one input of token ids
    parsed = parse({"input": [[1, 2], [3]], "model": "m", "dimensions": 8, "encoding_format": "base64",
                    "user": "u"})
    assert parsed.inputs == [[1, 2], [3]] and parsed.input_lengths == [2, 1]
    assert parsed.prompt_token_ids == [1, 2, 3] and parsed.model == "m"
    assert parsed.params == PoolingParams(dimensions=8) and parsed.encoding_format == "base64"
    assert parse({"input": "a"}).encoding_format == "float"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({}, "input", "'input' is a required property"),
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "empty list"),
    ({"input": ["a", ""]}, "input", "input[1] is an empty string"),
    ({"input": [[1], []]}, "input", "input[1] is an empty list"),
    ({"input": ["a", [1]]}, "input", "not a mix"),
    ({"input": 5}, "input", "got a number"),
    ({"input": [[1, "x"]]}, "input", "input[0] must be a list of token ids"),
    ({"input": [[1, 100]]}, "input[0]", "input[0][1] is 100, not a token id"),
    ({"input": [1, -1]}, "input", "is -1, not a token id"),
    ({"input": "a", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": "a", "dimensions": True}, "dimensions", "positive integer"),
    ({"input": "a", "dimensions": 65}, "dimensions", "at most 64"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "\"float\" or \"base64\""),
    ({"input": "a", "user": 3}, "user", "user must be a string"),
    ({"input": "a", "model": 3}, "model", "model must be a string"),
    ({"input": "a", "temperature": 1}, "temperature", "Unrecognized request argument supplied: temperature"),
])
def test_refusals_name_the_parameter(body, param, words):
    error = refused(body)
    assert error.param == param and words in error.message, error.message


def test_limits():
    error = refused({"input": ["a"] * (MAX_INPUTS + 1)})
    assert f"at most {MAX_INPUTS}" in error.message
    assert len(parse({"input": ["a"] * MAX_INPUTS}).inputs) == MAX_INPUTS
    error = refused({"input": list(range(33))})
    assert error.code == "context_length_exceeded" and "maximum context length is 32" in error.message
    error = refused({"input": "x" * (32 * 64 + 1)})     # refused before tokenizing
    assert error.code == "context_length_exceeded"
    many = [[1] * 160] * (MAX_TOTAL_TOKENS // 160 + 1)   # within the input count, past the total
    error = refused({"input": many}, max_model_len=200)
    assert f"more than {MAX_TOTAL_TOKENS} tokens" in error.message


def test_inputs_times_dimensions_are_capped():
    """2,048 inputs of a 4,096-wide model would store ~170 MB of JSON: refused up front, with
    how many inputs fit; `dimensions` counts rather than the model's width."""
    wide = PoolingConfig(hidden_size=4096, is_matryoshka=True)
    error = refused({"input": ["a"] * 2048}, pooling=wide)
    assert error.param == "input" and f"cap of {MAX_EMBEDDING_VALUES}" in error.message
    assert "at most 1024 inputs" in error.message and "fewer dimensions" in error.message
    assert len(parse({"input": ["a"] * 1024}, pooling=wide).inputs) == 1024
    assert len(parse({"input": ["a"] * 2048, "dimensions": 256}, pooling=wide).inputs) == 2048
    assert len(parse({"input": ["a"] * 2048}, pooling=PoolingConfig()).inputs) == 2048   # width unknown


def test_dimensions_need_a_matryoshka_model():
    error = refused({"input": "a", "dimensions": 8, "model": "plain"}, pooling=PoolingConfig(hidden_size=64))
    assert error.param == "dimensions" and "does not support matryoshka representation" in error.message
    listed = PoolingConfig(hidden_size=64, is_matryoshka=True, matryoshka_dimensions=(16, 32))
    assert parse({"input": "a", "dimensions": 16}, pooling=listed).params.dimensions == 16
    error = refused({"input": "a", "dimensions": 8}, pooling=listed)
    assert "supports dimensions 16, 32 only" in error.message


def test_batch_lines_take_embeddings():
    line = parse_batch_line(json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                                        "body": {"input": "hi"}}), 1)
    assert line.url == "/v1/embeddings"
    with pytest.raises(RequestError, match="/v1/embeddings"):
        parse_batch_line(json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/rerank", "body": {}}), 2)


def test_job_message_rebuilds_the_inputs():
    parsed = parse({"input": [[1, 2], [3], [4, 5, 6]]})

    class Row:
        id, model, endpoint, priority, tenant, key_id = "job_1", "m", "/v1/embeddings", 0, "t", "k"
        prompt_token_ids = parsed.prompt_token_ids
        params = {"sampling": {"dimensions": None, "normalize": None}, "input_lengths": parsed.input_lengths}

    message = JobMessage.from_dict(JobMessage.for_job(Row()).to_dict())
    assert split_inputs(message.prompt_token_ids, message.input_lengths) == [[1, 2], [3], [4, 5, 6]]
    with pytest.raises(ValueError, match="add up to 5"):
        split_inputs([1, 2, 3], [2, 3])


# -- responses --------------------------------------------------------------------------------


def test_base64_is_little_endian_float32():
    vector = [0.5, -1.25, 3.0e-8]
    encoded = encode_vector(vector, "base64")
    raw = base64.b64decode(encoded)
    assert len(raw) == 12 and list(struct.unpack("<3f", raw)) == pytest.approx(vector, rel=1e-6)
    assert encode_vector(vector, "float") is vector


def test_bodies():
    body = embeddings_body("m", [[1.0, 0.0], [0.0, 1.0]], 7)
    assert body == {"object": "list", "model": "m", "usage": {"prompt_tokens": 7, "total_tokens": 7},
                    "data": [{"object": "embedding", "index": 0, "embedding": [1.0, 0.0]},
                             {"object": "embedding", "index": 1, "embedding": [0.0, 1.0]}]}

    class Job:
        model, prompt_tokens = "m", 7
        params = {"body": {"input": ["a", "b"], "encoding_format": "base64"}}

    stored = json.loads(json.dumps(stored_response([[1.0, 0.0], [0.0, 1.0]])))   # as JSONB keeps it
    rebuilt = job_embeddings_body(Job(), stored)
    assert [d["embedding"] for d in rebuilt["data"]] == [encode_vector([1.0, 0.0], "base64"),
                                                        encode_vector([0.0, 1.0], "base64")]


# -- pooling config and math ------------------------------------------------------------------


def write_st_files(directory, mode: str, normalize: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **flags}))


@pytest.mark.parametrize(("mode", "expected"), [("lasttoken", "last"), ("mean_tokens", "mean"),
                                                ("cls_token", "cls")])
def test_pooling_read_from_sentence_transformers_files(tmp_path, mode, expected):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "matryoshka_dimensions": [4, 8]}))
    write_st_files(tmp_path, mode, normalize=mode != "cls_token")
    config = read_pooling_config(tmp_path)
    assert config.pooling_type == expected and config.normalize == (mode != "cls_token")
    assert config.hidden_size == 8 and config.is_matryoshka and config.matryoshka_dimensions == (4, 8)


def test_unsupported_sentence_transformers_pooling_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    write_st_files(tmp_path, "max_tokens")
    config = read_pooling_config(tmp_path)
    with pytest.raises(PoolingError, match="pooling_mode_max_tokens"):
        config.check(PoolingParams())


def test_defaults_without_sentence_transformers_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    config = read_pooling_config(tmp_path)
    assert (config.pooling_type, config.normalize, config.is_matryoshka) == ("last", True, False)


def test_finish_vector_cuts_then_normalizes():
    vector = torch.tensor([3.0, 4.0, 12.0])
    assert torch.allclose(finish_vector(vector, True, None), vector / 13.0)
    assert torch.allclose(finish_vector(vector, True, 2), torch.tensor([0.6, 0.8]))
    assert torch.equal(finish_vector(vector, False, 2), torch.tensor([3.0, 4.0]))


def test_gather_pools_across_chunks():
    """Mean pooling sums chunk by chunk; a chunk from position 0 (recompute) starts over."""
    from rein.engine.pooler import PoolingState
    from rein.engine.request import Request
    from rein.engine.sampling_params import SamplingParams

    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)   # one step's hidden states

    def request(kind: str, length: int) -> Request:
        r = Request("r", list(range(length)), SamplingParams())
        r.pooling = PoolingState(kind, normalize=False, dimensions=None)
        return r

    mean = request("mean", 8)
    assert gather(rows, [(mean, 0, 3, 0, 3)]) == []              # positions 0..2: rows 0..2
    assert gather(rows, [(mean, 0, 6, 0, 6)]) == []              # preempted, recomputed: starts over
    [(_, pooled)] = gather(rows, [(mean, 4, 6, 6, 8)])           # positions 6..7: rows 4..5
    assert torch.allclose(pooled, (rows.sum(0) + rows[4:6].sum(0)) / 8)
    last, cls = request("last", 5), request("cls", 5)
    [(_, a), (_, b)] = gather(rows, [(last, 1, 6, 0, 5), (cls, 1, 6, 0, 5)])
    assert torch.equal(a, rows[5]) and torch.equal(b, rows[1])
