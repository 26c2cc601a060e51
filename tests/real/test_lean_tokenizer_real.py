"""The packaged GGUF models' tokenizers loaded by rein (tokenizer.json straight into the Rust
tokenizer, rein.model.tokenizer_files.lean_tokenizer) against AutoTokenizer's of the same view:
SmolLM2's byte-level BPE and Gemma 3's 262k-token SentencePiece BPE with byte fallback and
6k added tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rein.model.files import resolve_model
from rein.model.tokenizer_files import lean_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,\ttabs\n\nand blank lines  ",
    "émoji 🤖🦀, 中文字符, ελληνικά, עברית and the ﬁ ligature",
    "\x00\x01\x7f control bytes, \u200b zero-width, \U0001f9ec rare",     # byte fallback for Gemma
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n<eos>",
    "<|im_start|>system\nYou are helpful<|im_end|><|endoftext|>",
    "<unused5> <mask> <pad><pad>",
    "",
]


@pytest.fixture(params=["gguf_path", "gemma_path"])
def view(request) -> Path:
    return resolve_model(str(request.getfixturevalue(request.param))).directory


def test_the_lean_tokenizer_encodes_and_decodes_as_autotokenizer(view: Path):
    lean, auto = lean_tokenizer(view), AutoTokenizer.from_pretrained(str(view))
    assert lean is not None and type(lean) is type(auto)
    for text in TEXTS:
        assert lean.encode(text) == auto.encode(text), text
        assert lean.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False), text
    size = len(auto)
    assert len(lean) == size and lean.vocab_size == auto.vocab_size
    for start in range(0, size, size // 16):
        ids = list(range(start, min(size, start + 700)))
        assert lean.decode(ids) == auto.decode(ids)
        assert lean.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
        assert lean.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert (lean.bos_token_id, lean.eos_token_id, lean.pad_token_id, lean.all_special_ids) == \
        (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, auto.all_special_ids)
    assert lean.added_tokens_decoder == auto.added_tokens_decoder
    assert lean.chat_template == auto.chat_template and lean.padding_side == auto.padding_side
