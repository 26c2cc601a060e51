"""IncrementalDetokenizer: streamed deltas must add up to the full decode of the output ids.

Most tests run twice: on the tiny model's byte-level tokenizer as is (the O(1) byte path)
and on a copy whose decoder is wrapped in a Sequence, which sends it down the generic
window path while decoding to exactly the same text.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rein.engine.detokenizer import _VOCAB_CACHE, IncrementalDetokenizer, _ByteStream, _WindowStream

CHINESE = "你好，世界！这是一个测试。"
EMOJI = "😀🎉👨‍👩‍👧 ok"
CODE = "def foo(self):\n    return self.bar(1) + 2\n\nprint(foo)\n"


@pytest.fixture(scope="module")
def byte_level_tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models("llama"))


@pytest.fixture(scope="module")
def window_tokenizer(byte_level_tokenizer):
    backend = Tokenizer.from_str(byte_level_tokenizer.backend_tokenizer.to_str())
    backend.decoder = decoders.Sequence([decoders.ByteLevel()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=byte_level_tokenizer.eos_token,
        bos_token=byte_level_tokenizer.bos_token,
    )


@pytest.fixture(params=["byte_level", "window"])
def tok(request, byte_level_tokenizer, window_tokenizer):
    tokenizer = byte_level_tokenizer if request.param == "byte_level" else window_tokenizer
    stream_type = _ByteStream if request.param == "byte_level" else _WindowStream
    assert isinstance(IncrementalDetokenizer(tokenizer, [])._stream, stream_type)
    return tokenizer


def run(tokenizer, ids, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ids one at a time; return every delta (finish()'s last) and the detokenizer."""
    det = IncrementalDetokenizer(tokenizer, [1, 2, 3], **kwargs)
    deltas = []
    for token_id in ids:
        deltas.append(det.add_token(token_id))
        assert det.text == "".join(deltas)
    deltas.append(det.finish())
    assert det.text == "".join(deltas)
    return deltas, det


def full_decode(tokenizer, ids, skip_special_tokens=True) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def reference_cut(text: str, stops) -> tuple[str, str | None]:
    """The documented stop rule on the whole text: the first stop string to complete wins."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not matches:
        return text, None
    _, start, stop = min(matches)
    return text[:start], stop


# --- UTF-8 safety ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [CHINESE, EMOJI, "mixed: " + CHINESE + " and " + EMOJI + "!"],
    ids=["zh", "emoji", "mixed"],
)
def test_multibyte_chars_are_never_emitted_as_replacement(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # characters really are split across tokens
    deltas, det = run(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == det.text == full_decode(tok, ids) == text
    assert not det.stopped


def test_complete_chars_are_emitted_without_waiting_for_finish(tok):
    # Held back only until the character is complete, not until the end.
    ids = tok.encode(CHINESE, add_special_tokens=False)
    deltas, _ = run(tok, ids)
    assert deltas[-1] == ""
    assert sum(1 for d in deltas if d) == len(CHINESE)


def test_incomplete_char_at_the_end_is_flushed_by_finish(tok):
    ids = tok.encode("a你", add_special_tokens=False)[:-1]  # drop the last byte of 你
    deltas, det = run(tok, ids)
    assert deltas[0] == "a"
    assert all(d == "" for d in deltas[1:-1])
    assert deltas[-1] == "\ufffd"
    assert det.text == full_decode(tok, ids) == "a\ufffd"


def test_random_ids_match_full_decode(tok):
    rng = random.Random(1234)
    backend = tok.backend_tokenizer
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    # Tokens holding non-ASCII bytes (lead and continuation bytes in every mix) make most
    # random sequences invalid UTF-8; the rest add ASCII and special tokens.
    high = [i for i in range(vocab_size) if any(ord(c) > 0x7E for c in backend.id_to_token(i))]
    assert len(high) > 100
    for _ in range(400):
        ids = [
            rng.choice(high) if rng.random() < 0.7 else rng.randrange(vocab_size)
            for _ in range(rng.randint(0, 24))
        ]
        skip = rng.random() < 0.5
        deltas, det = run(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == det.text == full_decode(tok, ids, skip), ids


def test_long_ascii_output_keeps_the_window_short(window_tokenizer):
    ids = window_tokenizer.encode(CODE * 50, add_special_tokens=False)
    det = IncrementalDetokenizer(window_tokenizer, [])
    for token_id in ids:
        det.add_token(token_id)
        assert len(det._stream._ids) <= 4
    det.finish()
    assert det.text == CODE * 50


def test_metaspace_tokenizer_drops_the_leading_space_like_the_full_decode():
    # A SentencePiece-style tokenizer: its decoder strips the first token's "▁", so the
    # window path must keep context and not strip it again mid-output.
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = ["Hello world, hello again.", "The quick brown fox jumps over the lazy dog."] * 10
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"])
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    ids = tokenizer.encode("Hello world, the lazy fox jumps.") + [tokenizer.eos_token_id]
    for start in range(len(ids)):
        deltas, det = run(tokenizer, ids[start:])
        assert isinstance(det._stream, _WindowStream)
        assert "".join(deltas) == det.text == full_decode(tokenizer, ids[start:])
    assert det.text == ""  # the eos token alone
    deltas, _ = run(tokenizer, ids, stop=["lazy"])
    assert "".join(deltas) == "Hello world, the "


# --- special tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    eos = tok.eos_token_id
    ids = tok.encode("hi", add_special_tokens=False) + [eos]
    ids += tok.encode(" there", add_special_tokens=False) + [eos]
    deltas, det = run(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == det.text == full_decode(tok, ids, skip)
    if skip:
        assert det.text == "hi there"
        assert deltas[ids.index(eos)] == ""
    else:
        assert det.text == f"hi{tok.eos_token} there{tok.eos_token}"


def test_requests_skipping_and_keeping_special_tokens_share_the_vocabulary_table(tok):
    # Both read one lazily filled table per tokenizer; a token first looked up by either must
    # read right for both, a special token in the middle of a split character included.
    eos = tok.eos_token_id
    split = tok.encode(EMOJI, add_special_tokens=False)
    ids = tok.encode("hi", add_special_tokens=False) + [eos] + split[:1] + [eos] + split[1:] + [eos]
    for skipping_first in (True, False):
        _VOCAB_CACHE.pop(tok, None)   # every token looked up afresh
        skipping = IncrementalDetokenizer(tok, [])
        keeping = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
        for token_id in ids:
            for det in (skipping, keeping) if skipping_first else (keeping, skipping):
                det.add_token(token_id)
        skipping.finish(), keeping.finish()
        assert skipping.text == full_decode(tok, ids, True)
        assert keeping.text == full_decode(tok, ids, False)
        assert tok.eos_token in keeping.text and tok.eos_token not in skipping.text


def test_stop_string_in_a_special_token_counts_only_when_it_is_printed(tok):
    ids = tok.encode("answer", add_special_tokens=False) + [tok.eos_token_id]
    ids += tok.encode(" more", add_special_tokens=False)
    _, det = run(tok, ids, skip_special_tokens=False, stop=[tok.eos_token])
    assert det.stopped and det.text == "answer"
    _, det = run(tok, ids, skip_special_tokens=True, stop=[tok.eos_token])
    assert not det.stopped and det.text == "answer more"


# --- stop strings --------------------------------------------------------------------------


def stream_with_stop(tokenizer, text, stops):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, det = run(tokenizer, ids, stop=stops)
    expected, stop_string = reference_cut(full_decode(tokenizer, ids), stops)
    assert "".join(deltas) == det.text == expected
    assert det.stopped == (stop_string is not None)
    assert det.stop_string == stop_string
    return ids, deltas, det


def test_single_token_stop(tok):
    ids = tok.encode(CODE, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # A token of a few characters, not the first one, where its text first occurs.
    k = next(
        k
        for k in range(1, len(ids))
        if len(pieces[k]) > 2 and CODE.find(pieces[k]) == len("".join(pieces[:k]))
    )
    _, deltas, det = stream_with_stop(tok, CODE, [pieces[k]])
    assert det.text == "".join(pieces[:k]) != ""
    assert all(d == "" for d in deltas[k + 1 :])  # nothing after the stop


def test_multi_token_stop(tok):
    stop = "return self"
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    _, _, det = stream_with_stop(tok, CODE, [stop])
    assert det.text == "def foo(self):\n    "


def test_stop_spanning_a_token_boundary(tok):
    ids = tok.encode(CODE, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    # The end of one multi-character token plus the start of the next one.
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) > 1 and len(pieces[i + 1]) > 1)
    stop = pieces[k][-2:] + pieces[k + 1][:1]
    _, _, det = stream_with_stop(tok, CODE, [stop])
    assert det.stopped and stop not in det.text
    assert det.text == CODE[: CODE.find(stop)]


def test_stop_at_the_very_start_gives_empty_output(tok):
    ids, deltas, det = stream_with_stop(tok, CODE, ["def"])
    assert det.stopped and det.text == "" and all(d == "" for d in deltas)
    # Further tokens (the engine may already have scheduled one) stay silent.
    assert det.add_token(ids[0]) == "" and det.finish() == "" and det.text == ""


@pytest.mark.parametrize("stops", [["bar", "foo"], ["foo", "bar"], ["print", "foo", "zzz"]])
def test_earliest_stop_string_wins(tok, stops):
    _, _, det = stream_with_stop(tok, CODE, stops)
    assert det.text == "def " and det.stop_string == "foo"


def test_stop_in_multibyte_text(tok):
    _, deltas, det = stream_with_stop(tok, CHINESE, ["世界"])
    assert det.text == "你好，" and not any("\ufffd" in d for d in deltas)


def test_partial_stop_is_held_back_and_released_when_text_diverges(tok):
    stop = "self.bar(2"  # CODE has "self.bar(1": matches up to the last character
    ids = tok.encode(CODE, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [], stop=[stop])
    emitted = ""
    saw_partial = False
    for k, token_id in enumerate(ids):
        emitted += det.add_token(token_id)
        decoded = tok.decode(ids[: k + 1])
        # Everything but the last len(stop) - 1 characters is out, and no more.
        assert emitted == decoded[: max(len(decoded) - (len(stop) - 1), 0)]
        if decoded.endswith("self.bar("):
            saw_partial = True
            assert emitted == "def foo(self):\n    return "
    assert saw_partial
    emitted += det.finish()
    assert emitted == det.text == CODE and not det.stopped


def test_overlapping_stops_the_first_to_complete_wins(tok):
    # "self" completes before "foo(self)" does, so the text is cut before "self", however
    # the text is split into tokens (the engine would have stopped generating there).
    _, _, det = stream_with_stop(tok, CODE, ["foo(self)", "self"])
    assert det.text == "def foo(" and det.stop_string == "self"
    # The same when both complete within one token ("(self"): "(s" completes first.
    _, _, det = stream_with_stop(tok, CODE, ["oo(self", "(s"])
    assert det.text == "def foo" and det.stop_string == "(s"
    # Completing on the same character: the one starting earlier wins.
    _, _, det = stream_with_stop(tok, CODE, ["bar", "self.bar"])
    assert det.text == "def foo(self):\n    return " and det.stop_string == "self.bar"


def test_empty_stop_strings_are_ignored(tok):
    _, _, det = stream_with_stop(tok, CODE, ["", "zzz"])
    assert det.text == CODE and not det.stopped


def test_random_stop_strings_match_the_reference(tok):
    rng = random.Random(99)
    text = CODE + CHINESE + EMOJI + CODE
    for _ in range(150):
        stops = []
        for _ in range(rng.randint(1, 3)):
            start = rng.randrange(len(text))
            stops.append(text[start : start + rng.randint(1, 8)])
        if rng.random() < 0.3:
            stops.append("never there")
        stream_with_stop(tok, text, stops)


def test_add_token_after_finish_is_ignored(tok):
    ids = tok.encode("hello", add_special_tokens=False)
    deltas, det = run(tok, ids)
    assert det.add_token(ids[0]) == "" and det.finish() == "" and det.text == "hello"
