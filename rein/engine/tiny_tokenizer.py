"""The tiny models' tokenizer: a byte-level BPE trained locally (on the standard library's own
sources, so no download), its special tokens and a ChatML chat template with Qwen2.5's tool
convention, written as the files AutoTokenizer reads (rein.engine.tiny_model builds the rest).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Appended after the BPE vocabulary, in this order (the last five ids of the vocabulary).
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

# Pre-tokenization split (the Qwen2 one: letters, single digits, punctuation runs, spaces).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, with Qwen2.5's tool convention (rein.openai.tool_parsers parses it): the tools listed in the system
# turn, calls as <tool_call> JSON blocks, results as <tool_response> in a user turn. Without
# tools or tool messages it renders plain ChatML.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- ('\\n' if message['content'] or not loop.first else '') + '<tool_call>\\n{\"name\": \"' + call.name"
    " + '\", \"arguments\": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Tokenizer training corpus: top-level stdlib modules, sorted, whole files until the cap.
_CORPUS_MAX_BYTES = 3_000_000
_CORPUS_MIN_BYTES = 200_000



def _corpus_files() -> list[Path]:
    stdlib = Path(os.__file__).parent
    files: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total >= _CORPUS_MAX_BYTES:
            break
    if total < _CORPUS_MIN_BYTES:
        raise RuntimeError(
            f"found only {total} bytes of Python sources under {stdlib}; "
            "cannot train the tiny tokenizer"
        )
    return files


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """Train the byte-level BPE and return its tokenizer.json text (cached per process)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in _corpus_files()]
    # The exact pipeline transformers' Qwen2Tokenizer hard-codes (it rebuilds the pipeline
    # from vocab/merges, ignoring tokenizer.json's, for every model_type "qwen2" checkpoint).
    # Using it for every arch keeps AutoTokenizer and a bare `tokenizers.Tokenizer` on
    # tokenizer.json in agreement whatever the arch.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tokenizer training gave {tok.get_vocab_size()} tokens, expected {vocab_size}"
        )
    return tok.to_str(pretty=True)


def special_token_ids(tokenizer_json: str) -> dict[str, int]:
    added = json.loads(tokenizer_json)["added_tokens"]
    by_content = {t["content"]: t["id"] for t in added}
    return {token: by_content[token] for token in SPECIAL_TOKENS}


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(
    out: Path, tokenizer_json: str, ids: dict[str, int], model_max_length: int
) -> None:
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    added_tokens_decoder = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    write_json(
        out / "tokenizer_config.json",
        {
            # The generic fast tokenizer: AutoTokenizer must not swap in an arch-specific
            # class that rebuilds the pipeline (transformers 5 aliases this name to
            # TokenizersBackend; transformers 4 knows it too).
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            # Explicitly none: Qwen2Tokenizer would otherwise add "<|endoftext|>" as unk,
            # a token outside the model's vocabulary.
            "unk_token": None,
            "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        },
    )
