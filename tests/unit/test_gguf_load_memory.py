"""A GGUF file's quantized matrices are repacked a few rows at a time (rein.model.quant.
gguf_blocks.repack_rows), so a load never holds a large matrix's file bytes beside its repacked
form (Gemma 3's 178 MiB Q8_0 embedding was read whole, then copied: its load peaked there):
chunked and whole repacking give the same weight for every type, and the loader's reads of a
quantized tensor stay within a chunk."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_gguf_blocks import FP16_FIELDS, random_blocks

gguf = pytest.importorskip("gguf")

from rein.model import loader  # noqa: E402
from rein.model.files import TENSOR_INDEX, gguf_tensor_index  # noqa: E402
from rein.model.quant import gguf_blocks  # noqa: E402
from rein.model.quant.gguf_blocks import ROW_FIELDS, repack, repack_rows  # noqa: E402

EMBEDDING = "token_embd.weight"


@pytest.mark.parametrize("name", sorted(FP16_FIELDS))
def test_chunked_repacking_is_whole_repacking(name):
    rows, cols = 11, 512
    raw = random_blocks(name, rows, cols, seed=2)
    reads = []

    def read_rows(start, stop):
        reads.append(stop - start)
        return raw[start:stop]

    whole = repack(raw, name, rows, cols)
    chunked = repack_rows(read_rows, name, rows, cols, raw.shape[1], chunk_bytes=4 * raw.shape[1])
    assert reads == [4, 4, 3]
    assert (chunked.rows, chunked.cols, chunked.bits, chunked.source) == (whole.rows, whole.cols, whole.bits, name)
    for field in ROW_FIELDS:
        a, b = getattr(chunked, field), getattr(whole, field)
        assert (a is None and b is None) or torch.equal(a, b), field


def test_a_type_without_a_kernel_is_not_read():
    def read_rows(start, stop):
        raise AssertionError("read")

    assert repack_rows(read_rows, "Q2_K", 4, 256, 84) is None


def test_the_loader_reads_a_quantized_matrix_a_chunk_at_a_time(tmp_path, monkeypatch):
    rows, cols = 64, 256
    weights = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor(EMBEDDING, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    view = tmp_path / "view"
    view.mkdir()
    (view / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "model_type": "llama"}))
    (view / TENSOR_INDEX).write_text(json.dumps(gguf_tensor_index(path)))
    row_bytes = blocks.shape[1]
    monkeypatch.setattr(gguf_blocks, "CHUNK_BYTES", 10 * row_bytes)
    sizes = []
    pread = loader.os.pread

    def counted(fd, size, offset):
        sizes.append(size)
        return pread(fd, size, offset)

    monkeypatch.setattr(loader.os, "pread", counted)
    with loader.gguf_tensors(path, view, torch.float32) as get:
        weight = get("model.embed_tokens.weight", quantized=True)
        assert sizes == [10 * row_bytes] * 6 + [4 * row_bytes]
        dense = get("model.embed_tokens.weight")
    assert weight.source == "Q8_0" and weight.shape == (rows, cols)
    assert torch.equal(weight.dequantize(), dense)
