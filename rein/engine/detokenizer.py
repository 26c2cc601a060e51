"""Incremental, UTF-8-safe detokenization with stop strings, for one request.

The engine calls `IncrementalDetokenizer.add_token` once per generated token (up to a few
hundred requests per step), so the per-token cost must stay small and must not grow with
the length of the output: nothing here ever re-decodes the whole output.

Guarantees, for the output token ids fed in (the prompt is never part of the text):

* Concatenating every delta returned by `add_token` and `finish` gives exactly `text`.
* Without a stop string, after `finish`, `text` equals
  `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`.
  The clean-up is left out because it rewrites spaces before punctuation, which cannot be
  done incrementally; transformers already skips it for BPE tokenizers, so for those this is
  the plain `tokenizer.decode(output_ids, skip_special_tokens=...)`.
* A character whose UTF-8 bytes are split across tokens is held back until it is complete,
  so no delta carries a U+FFFD that the full decode would not have. What is still held when
  the request ends is flushed by `finish` (an incomplete character then becomes U+FFFD,
  exactly as in the full decode).
* Stop strings follow OpenAI semantics: the text is cut right before the stop string, which
  is never returned, and nothing after it is ever returned. The last `max(len(stop)) - 1`
  characters are held back so a partial match is never emitted; they are released as soon
  as the text moves past them (or by `finish`). When several stop strings are present, the
  first one to complete, reading the text left to right, wins (ties: the one starting
  earliest). That is the earliest occurrence except when stop strings overlap, and it does
  not depend on how the text happens to be split into tokens.

Two ways to turn token ids into text, picked per tokenizer:

* Byte-level BPE (GPT-2 style: the tiny test model, Llama 3, Qwen, ...): every token is a
  fixed byte string, so the bytes are decoded as a UTF-8 stream, keeping only the bytes of
  an incomplete trailing character between calls. That is O(1) per token and exact: it
  never waits longer than the character is incomplete, and replaces invalid bytes the way
  the Rust decoder does (substitution of maximal subparts).
* Any other tokenizer (Metaspace/SentencePiece, WordPiece, ...): the vLLM/TGI window. A few
  already-emitted tokens are kept as context, the window is decoded, and the context's text
  is cut off the front; while the window's text ends with U+FFFD it may still be an
  incomplete character, so that tail waits. The context is what keeps decoder rules that
  look at the first token (such as Metaspace dropping a leading space) from firing in the
  middle of the output.
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer, decoders

_REPLACEMENT = "\ufffd"


def _byte_level_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode`: the byte each vocabulary character stands for."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {chr(b): b for b in printable}
    # The other bytes (controls, space, ...) are moved up past U+00FF, in byte order.
    taken = set(printable)
    others = [b for b in range(256) if b not in taken]
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


_CHAR_TO_BYTE = _byte_level_char_to_byte()


class _ByteLevelVocab:
    """Token id -> text or bytes for one byte-level tokenizer, shared by all its requests.

    A token whose bytes are valid UTF-8 on their own is stored as its text, so the common
    case (no partial character pending) costs one dict lookup and no decoding; any other
    token is stored as bytes for the UTF-8 decoder. Two tables, filled lazily together (a
    request only pays for ids not seen before, and the vocabulary is never walked as a
    whole): `entries` for every token, and `entries_skipping`, where the special tokens are
    "" (skip_special_tokens), so that skipping them costs no lookup of its own.
    """

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self.size = backend.get_vocab_size(with_added_tokens=True)
        # The Rust decoder drops exactly the added tokens flagged `special` when asked to
        # skip special tokens, so that is the set to skip here too.
        self.special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.entries: dict[int, str | bytes] = {}
        self.entries_skipping: dict[int, str | bytes] = {}

    def table(self, skip_special_tokens: bool) -> dict[int, str | bytes]:
        """The table of a stream that skips special tokens or keeps them."""
        return self.entries_skipping if skip_special_tokens else self.entries

    def lookup(self, token_id: int, skip_special_tokens: bool) -> str | bytes:
        """A token not in the tables yet: its entry, now in both."""
        data = self._token_bytes(token_id)
        try:
            entry: str | bytes = data.decode("utf-8")
        except UnicodeDecodeError:
            entry = data
        self.entries[token_id] = entry
        self.entries_skipping[token_id] = "" if token_id in self.special_ids else entry
        return self.table(skip_special_tokens)[token_id]

    def _token_bytes(self, token_id: int) -> bytes:
        token = self.backend.id_to_token(token_id)
        if token is None:  # out of range: the Rust decoder silently drops it
            return b""
        # Same rule as the Rust ByteLevel decoder: a token made only of byte-level
        # characters stands for those bytes; any other token (an added token such as
        # "<|im start|>" with a real space, or "你好") stands for its own UTF-8.
        try:
            return bytes(_CHAR_TO_BYTE[c] for c in token)
        except KeyError:
            return token.encode("utf-8")


# Keyed by the tokenizer object the engine passes in; weak so a dropped tokenizer's table
# goes with it.
_VOCAB_CACHE: weakref.WeakKeyDictionary[Any, _ByteLevelVocab] = weakref.WeakKeyDictionary()


def _byte_level_vocab(tokenizer: Any, backend: Tokenizer) -> _ByteLevelVocab:
    try:
        vocab = _VOCAB_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable: build one for this request only
        return _ByteLevelVocab(backend)
    # Tokens added to the tokenizer since the table was built would be missing from it.
    if (
        vocab is None
        or vocab.backend is not backend
        or vocab.size != backend.get_vocab_size(with_added_tokens=True)
    ):
        vocab = _VOCAB_CACHE[tokenizer] = _ByteLevelVocab(backend)
    return vocab


def _backend_of(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    for attr in ("backend_tokenizer", "_tokenizer"):
        backend = getattr(tokenizer, attr, None)
        if isinstance(backend, Tokenizer):
            return backend
    return None


class _ByteStream:
    """Byte-level tokenizers: token bytes through an incremental UTF-8 decoder.

    `pending` holds the bytes of an incomplete trailing character. The decoding is
    `codecs.utf_8_decode` with errors="replace", which substitutes maximal invalid
    subparts like Rust's `String::from_utf8_lossy` that tokenizers uses, so even the number
    of U+FFFD matches the full decode. (It is what the codecs incremental decoder does,
    without that wrapper's Python-level overhead.)
    """

    __slots__ = ("entries", "_vocab", "_skip", "pending")

    def __init__(self, vocab: _ByteLevelVocab, skip_special_tokens: bool) -> None:
        # Token id -> its text, or its bytes when they are no UTF-8 of their own; a skipped
        # special token's text is "" (_ByteLevelVocab.table).
        self.entries = vocab.table(skip_special_tokens)
        self._vocab = vocab
        self._skip = skip_special_tokens
        self.pending = b""

    def push(self, token_id: int) -> str:
        entry = self.entries.get(token_id)
        if entry is None:
            entry = self._vocab.lookup(token_id, self._skip)
        if not entry:   # a skipped special token (or an id out of range): no bytes at all
            return ""
        if not self.pending:
            if type(entry) is str:  # the common case: nothing to decode
                return entry
            data = entry
        else:
            data = self.pending + (entry.encode("utf-8") if type(entry) is str else entry)
        text, consumed = codecs.utf_8_decode(data, "replace", False)
        self.pending = data[consumed:]
        return text

    def flush(self) -> str:
        text, _ = codecs.utf_8_decode(self.pending, "replace", True)
        self.pending = b""
        return text


class _WindowStream:
    """Any tokenizer: decode a short window of ids (the vLLM/TGI approach).

    `_ids[:_read]` is the context: tokens whose text is fully emitted, and whose decode is
    `_prefix_len` characters long. `_ids[_read:]` is pending. `_sent` counts characters
    past the context that were already returned (the stable part before a trailing
    U+FFFD), so a run of pending tokens does not delay text that is already final.
    """

    __slots__ = ("_decode", "_ids", "_read", "_prefix_len", "_sent")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._read = 0
        self._prefix_len = 0
        self._sent = 0

    def push(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids)
        start = self._prefix_len + self._sent
        if text.endswith(_REPLACEMENT):
            # Maybe an incomplete character that the next token completes: everything
            # before the trailing U+FFFD run is final, the run itself waits. (A window
            # whose text keeps ending in U+FFFD keeps growing; the byte-level path, which
            # covers the common tokenizers, has no such case.)
            end = len(text.rstrip(_REPLACEMENT))
            if end <= start:
                return ""
            self._sent = end - self._prefix_len
            return text[start:end]
        # Clean boundary: emit the rest, and keep the tokens just emitted as the context
        # for the next window, dropping the older context so the window stays short.
        delta = text[start:]
        del ids[: self._read]
        self._read = len(ids)
        self._prefix_len = len(self._decode(ids))
        self._sent = 0
        return delta

    def flush(self) -> str:
        if len(self._ids) == self._read:
            return ""
        return self._decode(self._ids)[self._prefix_len + self._sent :]


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, honouring stop strings.

    `prompt_token_ids` is accepted for the engine's convenience but not used: the text is
    the decode of the output ids alone (OpenAI completions return only generated text), and
    seeding the window with prompt tokens would change the first token's text for some
    tokenizers (e.g. keep a leading space that the plain decode of the output drops).
    """

    __slots__ = (
        "stopped",
        "stop_string",
        "_stream",
        "_stops",
        "_hold",
        "_held",
        "_pieces",
        "_text",
        "_finished",
        "_unchecked",
        "_table",
        "_plain",
    )

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
    ) -> None:
        del prompt_token_ids  # see the class docstring
        self.stopped = False
        self.stop_string: str | None = None
        backend = _backend_of(tokenizer)
        self._stream: _ByteStream | _WindowStream
        if backend is not None and isinstance(backend.decoder, decoders.ByteLevel):
            self._stream = _ByteStream(_byte_level_vocab(tokenizer, backend), skip_special_tokens)
        elif backend is not None:
            # The Rust decode directly: it is what tokenizer.decode calls, minus the
            # Python-side clean-up, which is left out on purpose (see the module docstring).
            def decode(ids: list[int]) -> str:
                return backend.decode(ids, skip_special_tokens=skip_special_tokens)

            self._stream = _WindowStream(decode)
        else:  # a slow (pure Python) tokenizer

            def decode(ids: list[int]) -> str:
                return tokenizer.decode(
                    ids,
                    skip_special_tokens=skip_special_tokens,
                    clean_up_tokenization_spaces=False,
                )

            self._stream = _WindowStream(decode)
        # An empty stop string would match everywhere; OpenAI ignores it, and so do we.
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._hold = max(map(len, self._stops), default=1) - 1
        self._held = ""  # decoded text not yet emitted (at most `_hold` characters)
        self._pieces: list[str] = []  # emitted deltas; joined lazily by `text`
        self._text: str | None = ""
        self._finished = False
        # SamplingParams.min_tokens: the text of the first `min_tokens` tokens is emitted
        # without looking for stop strings (vLLM's rule), so a stop string cannot end the
        # request before min_tokens either.
        self._unchecked = min_tokens if self._stops else 0
        # The engine feeds every request's token through `add_token` each step, so its common
        # case is read inline: `_plain` is the byte-level stream's table while a token whose
        # entry is text gives that text and nothing else (no partial character pending, not
        # finished), None otherwise; `_table` the same table whenever that can be, for a
        # request without stop strings (None: never).
        stream = self._stream
        self._table = stream.entries if type(stream) is _ByteStream and not self._stops else None
        self._plain = self._table

    @property
    def text(self) -> str:
        """The text emitted so far: after `finish` (or a stop), the final output text."""
        if self._text is None:
            self._text = "".join(self._pieces)
            self._pieces = [self._text]
        return self._text

    def add_token(self, token_id: int) -> str:
        """Feed one generated token; return the new text delta ('' while holding back)."""
        plain = self._plain
        if plain is not None:
            piece = plain.get(token_id)
            if type(piece) is str:   # `_ByteStream.push` and `_emit`, inline (see `__init__`)
                if piece:
                    self._pieces.append(piece)
                    self._text = None
                return piece
        if self.stopped or self._finished:
            return ""
        stream = self._stream
        piece = stream.push(token_id)
        if self._table is not None:   # a partial character may be pending now, or complete
            self._plain = None if stream.pending else self._table
        if self._unchecked:   # counted per token, whether it completed any text or not
            self._unchecked -= 1
            return self._emit(piece)
        if not piece:
            return ""
        if not self._stops:   # the common case, `_emit` inline: this runs for every token
            self._pieces.append(piece)
            self._text = None
            return piece
        return self._scan(piece, final=False)

    def finish(self) -> str:
        """Flush everything held back; call when the request ends other than by a stop.

        Returns the last delta. The flushed text is still checked for stop strings, so the
        guarantees hold; should one complete here, `stopped` becomes True as well.
        """
        if self.stopped or self._finished:
            return ""
        self._finished = True
        self._plain = None
        piece = self._stream.flush()
        if not self._stops:
            return self._emit(piece)
        return self._scan(piece, final=True)

    def _scan(self, piece: str, *, final: bool) -> str:
        # Only the held tail plus the new piece is searched. The tail was searched as part
        # of the previous buffer, so a new match ends inside the piece; being at most
        # `_hold + 1` characters long, it starts inside this buffer. Earlier text was
        # searched on earlier calls.
        buf = self._held + piece
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                cand = (start + len(stop), start, stop)
                if best is None or cand < best:
                    best = cand
        if best is not None:
            _, start, stop = best
            self.stopped = True
            self.stop_string = stop
            self._held = ""
            return self._emit(buf[:start])
        if final:
            self._held = ""
            return self._emit(buf)
        cut = max(len(buf) - self._hold, 0)
        self._held = buf[cut:]
        return self._emit(buf[:cut])

    def _emit(self, delta: str) -> str:
        if delta:
            self._pieces.append(delta)
            self._text = None
        return delta
