"""rein.model.tokenizer_files.lean_tokenizer: tokenizer.json loaded once into the Rust tokenizer
behaves as AutoTokenizer's tokenizer of the same directory, and directories where it might not
are left to AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rein.fixtures.tiny_gguf import write_gguf
from rein.model.files import resolve_model
from rein.model.tokenizer_files import lean_tokenizer, load_tokenizer

TEXTS = [
    "Hello world",
    "  leading spaces\tand tabs\n\nnewlines ",
    "émoji 🤖, 中文字符 and the ﬁ ligature",                    # multi-byte: byte-level pieces
    "<|begin_of_text|>x<|end_of_text|> <|im_start|>user\nhi<|im_end|>",   # special tokens in text
    "<|im_start|><|im_start|>glued<|pad|>",
    "\x00\x01 control bytes \u200b zero-width",
    "",
]


def behaviour(tokenizer) -> dict:
    """What rein's callers use of a tokenizer, as plain data to compare."""
    size = len(tokenizer)
    ids = list(range(min(size, 300))) + list(range(max(0, size - 12), size))
    return {
        "class": type(tokenizer).__name__,
        "encode": [tokenizer.encode(t) for t in TEXTS],
        "encode_bare": [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS],
        "call": [tokenizer(t)["input_ids"] for t in TEXTS],
        "decode": tokenizer.decode(ids),
        "decode_skip": tokenizer.decode(ids, skip_special_tokens=True),
        "pieces": tokenizer.convert_ids_to_tokens(ids),
        "each": [tokenizer.decode([i]) for i in ids],
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id,
                    tokenizer.all_special_ids, tokenizer.all_special_tokens],
        "sizes": [size, tokenizer.vocab_size, len(tokenizer.get_vocab())],
        "added": {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()},
        "options": [tokenizer.padding_side, tokenizer.truncation_side, tokenizer.model_max_length,
                    tokenizer.clean_up_tokenization_spaces, tokenizer.chat_template],
        "chat": tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                              add_generation_prompt=True) if tokenizer.chat_template else None,
    }


def assert_same_as_auto(directory: Path) -> None:
    lean = lean_tokenizer(directory)
    assert lean is not None, f"{directory} was left to AutoTokenizer"
    assert behaviour(lean) == behaviour(AutoTokenizer.from_pretrained(str(directory)))


@pytest.mark.parametrize("thinking", [False, True])
def test_a_generic_tokenizer_loads_as_autotokenizer_loads_it(tiny_models, thinking):
    assert_same_as_auto(tiny_models(thinking=thinking))


def test_an_embedding_tokenizers_appended_eos_is_kept(tiny_models):
    """Its tokenizer.json's post-processor appends EOS (last-token pooling reads it) while
    tokenizer_config.json says add_eos_token false: the file wins, as with AutoTokenizer."""
    directory = tiny_models(embedding="last")
    assert_same_as_auto(directory)
    lean = lean_tokenizer(directory)
    assert lean.encode("hello world")[-1] == lean.eos_token_id


def test_a_gguf_files_tokenizer_loads_as_autotokenizer_loads_it(tiny_models, tmp_path, monkeypatch):
    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path / "cache"))
    from rein.core.settings import get_settings

    get_settings.cache_clear()
    try:
        path = write_gguf(tiny_models(), tmp_path / "tiny.gguf", "Q8_0")
        view = resolve_model(str(path)).directory
    finally:
        get_settings.cache_clear()
    assert_same_as_auto(view)


def test_a_gguf_views_model_class_is_kept_without_its_constructor(tiny_models, tmp_path):
    """A GGUF view naming a model's class (GemmaTokenizer for Gemma's files): the object is of
    that class (its class defaults, padding on the left) though built by the generic constructor."""
    view = tmp_path / "view"
    shutil.copytree(tiny_models(), view)
    config = json.loads((view / "config.json").read_text())
    (view / "config.json").write_text(json.dumps({**config, "rein_gguf_source": "/models/x.gguf"}))
    tokenizer_config = json.loads((view / "tokenizer_config.json").read_text())
    (view / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "tokenizer_class": "GemmaTokenizer"}))
    lean = lean_tokenizer(view)
    assert type(lean).__name__ == "GemmaTokenizer" and lean.padding_side == "left"
    generic = AutoTokenizer.from_pretrained(str(tiny_models()))
    assert lean.encode(TEXTS[3]) == generic.encode(TEXTS[3]) and lean.decode(range(300)) == generic.decode(range(300))


def rewrite_config(directory: Path, **changes) -> None:
    path = directory / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("case", ["model_class_outside_a_gguf_view", "remote_code", "chat_template_json",
                                  "legacy_map", "no_tokenizer_json"])
def test_directories_that_could_differ_are_left_to_autotokenizer(tiny_models, tmp_path, case):
    directory = tmp_path / "tok"
    shutil.copytree(tiny_models(), directory)
    if case == "model_class_outside_a_gguf_view":
        # Gemma's constructor rebuilds the pipeline from the vocabulary: only AutoTokenizer knows what it makes.
        rewrite_config(directory, tokenizer_class="GemmaTokenizer")
    elif case == "remote_code":
        rewrite_config(directory, auto_map={"AutoTokenizer": ["tok.MyTokenizer", None]})
    elif case == "chat_template_json":
        (directory / "chat_template.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    elif case == "legacy_map":
        # Read by AutoTokenizer only where tokenizer_config.json has no added_tokens_decoder.
        config = json.loads((directory / "tokenizer_config.json").read_text())
        del config["added_tokens_decoder"]
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        assert (directory / "special_tokens_map.json").is_file()
    else:
        (directory / "tokenizer.json").unlink()
    assert lean_tokenizer(directory) is None


def test_load_tokenizer_applies_the_chat_template_given_to_the_lean_tokenizer(tiny_models):
    from rein.model.tokenizer_files import TokenizerOptions

    tokenizer = load_tokenizer(tiny_models(), TokenizerOptions(chat_template="{{ messages[0]['content'] }}!"))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi!"
