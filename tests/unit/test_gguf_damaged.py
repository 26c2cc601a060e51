"""A GGUF file whose header does not fit the file is refused with the tensor named, before any
reader maps data past its end (rein.model.files.checked_gguf_reader) and again when a
tensor is read (rein.model.loader.gguf_tensors). The files are small ones written here with
gguf's own writer, then truncated or given a corrupt offset."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from rein.model.files import (  # noqa: E402
    TENSOR_INDEX,
    DamagedGGUFFile,
    checked_gguf_reader,
    gguf_tensor_index,
    gguf_view,
)
from rein.model.loader import gguf_tensors  # noqa: E402

EMBEDDING = "token_embd.weight"
NORM = "output_norm.weight"


def write_gguf(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor(EMBEDDING, np.arange(32 * 16, dtype=np.float32).reshape(32, 16))
    writer.add_tensor(NORM, np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    write_gguf(path)
    return path


def set_offset(path, tensor: str, offset: int) -> None:
    """Overwrite the data offset in `tensor`'s header entry: after its name come n_dims (u32),
    the dims (u64 each), the type (u32), then the offset (u64)."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, offset)
    path.write_bytes(bytes(data))


def test_a_whole_file_reads(small_gguf):
    index = gguf_tensor_index(small_gguf)
    assert index["architecture"] == "llama"
    assert index["tensors"][EMBEDDING]["bytes"] == 32 * 16 * 4 and index["tensors"][NORM]["bytes"] == 16 * 4


def test_a_truncated_file_is_refused_naming_the_tensor(small_gguf):
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data[:-20])          # the last tensor (the norm) is cut short
    with pytest.raises(DamagedGGUFFile, match=rf"tensor '{NORM}' lies at bytes \d+\.\.\d+, past the end of the "
                                              rf"file \({len(data) - 20} bytes\): the file is truncated"):
        checked_gguf_reader(small_gguf)
    with pytest.raises(DamagedGGUFFile, match=NORM):
        gguf_view(small_gguf)                    # before transformers reads the file


@pytest.mark.parametrize("offset", [1 << 20, 2**64 - 64])   # past the end; so large it would wrap in 64 bits
def test_a_corrupt_offset_is_refused_naming_the_tensor(small_gguf, offset):
    set_offset(small_gguf, EMBEDDING, offset)
    with pytest.raises(DamagedGGUFFile, match=rf"tensor '{EMBEDDING}' lies at bytes \d+\.\.\d+, past the end"):
        checked_gguf_reader(small_gguf)


def test_a_file_truncated_after_its_index_was_written_fails_the_read(small_gguf, tmp_path):
    view = tmp_path / "view"
    view.mkdir()
    (view / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "model_type": "llama"}))
    (view / TENSOR_INDEX).write_text(json.dumps(gguf_tensor_index(small_gguf)))
    with gguf_tensors(small_gguf, view, torch.float32) as get:
        assert torch.equal(get("model.norm.weight"), torch.ones(16))
    small_gguf.write_bytes(small_gguf.read_bytes()[:-20])
    with gguf_tensors(small_gguf, view, torch.float32) as get, \
            pytest.raises(DamagedGGUFFile, match=f"tensor '{NORM}' lies at bytes .* past the end of the file"):
        get("model.norm.weight")
