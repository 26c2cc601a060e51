"""A model's tokenizer as the user chose it: `--tokenizer`, `--chat-template`, `--trust-remote-code`.

The API and the engine both load tokenizers through `load_tokenizer` (no torch here), so a
request is encoded, and its chat prompt built, with the same tokenizer and template by the
API and by `rein generate`, `rein run-batch` and `rein.LLM`. The chat template given replaces
the tokenizer's own on the tokenizer object, so every path that applies a template uses it.

Remote code: a config whose `auto_map` names Python files of the repository runs them when
transformers loads it. rein refuses such a tokenizer or model unless `--trust-remote-code` is
set, with a message that says so, and always passes transformers an explicit
`trust_remote_code` (left unset, transformers would ask on the terminal and wait).

Memory: `AutoTokenizer.from_pretrained` parses tokenizer.json in Python (for its added tokens),
and a class with a constructor of its own (GemmaTokenizer, LlamaTokenizer) parses it again and
rebuilds the Rust tokenizer from the vocabulary and merges. For Gemma 3's 262k tokens that
leaves about 265 MiB resident where the Rust tokenizer alone holds about 97 MiB. Where
tokenizer.json is already what that constructor builds -- a GGUF file's tokenizer, which rein
wrote with transformers' `save_pretrained` (rein.model.files) -- or the class is transformers'
generic one (which loads the file as it is), `load_tokenizer` loads the file straight into
the Rust tokenizer, once, inside an object of the same class (`lean_tokenizer`). Parsing
Gemma 3's 33 MB tokenizer.json frees about 195 MiB of the 290 MiB it touched, which glibc keeps
in the heap: `load_tokenizer` hands it back (malloc_trim, rein.model.cpu_allocator), so the
process holds 97 MiB for it, not 290, until something reuses the pages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rein.model.cpu_allocator import release_free_memory, return_freed_memory
from rein.model.files import ModelNotFoundError, download_from_hub, looks_local

REMOTE_CODE_HINT = ("rein runs it only with --trust-remote-code (REIN_TRUST_REMOTE_CODE=true, "
                    "rein.LLM(trust_remote_code=True)), which lets that code run with this process's rights: "
                    "read it first")
# Files besides tokenizer.json, tokenizer_config.json and chat_template.jinja that AutoTokenizer
# reads: a directory holding one is left to it (`lean_tokenizer`); the legacy ones only where
# tokenizer_config.json has no added_tokens_decoder (transformers reads them only then).
OTHER_TOKENIZER_FILES = ("chat_template.json", "chat_templates")
LEGACY_TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json")
TEMPLATE_MARKS = ("{{", "{%", "\n")   # text holding one of these is a template, not a file name


class RemoteCodeRequired(ValueError):
    """A tokenizer or model needs the repository's own Python code and --trust-remote-code is off."""


class ChatTemplateError(ValueError):
    """--chat-template names no readable file, or its template does not compile."""


@dataclass(frozen=True)
class TokenizerOptions:
    """The options that choose the tokenizer (EngineConfig's and Settings' fields of these names)."""

    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    chat_template: str | None = None
    trust_remote_code: bool = False

    @classmethod
    def of(cls, values: Any) -> TokenizerOptions:
        """From an EngineConfig or a Settings."""
        return cls(values.tokenizer, values.tokenizer_revision, values.chat_template, values.trust_remote_code)


def load_tokenizer(model_directory: Path, options: TokenizerOptions = TokenizerOptions()) -> Any:
    """The tokenizer of the model in `model_directory`, or `options.tokenizer`'s, with the chat
    template of `options.chat_template` in place of its own. ValueError (RemoteCodeRequired,
    ChatTemplateError, ModelNotFoundError) saying what to change."""
    from transformers import AutoTokenizer

    # Read before loading the tokenizer, so a bad template fails fast, whatever the tokenizer costs.
    template = read_chat_template(options.chat_template) if options.chat_template is not None else None
    directory = tokenizer_directory(options) if options.tokenizer is not None else model_directory
    check_tokenizer_code(directory, options.trust_remote_code)
    return_freed_memory()   # the parse's large buffers back as they are freed (rein.model.cpu_allocator)
    tokenizer = lean_tokenizer(directory)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=options.trust_remote_code)
    if template is not None:
        tokenizer.chat_template = template
    release_free_memory()   # the parse's freed buffers (see the module docstring)
    return tokenizer


def lean_tokenizer(directory: Path) -> Any:
    """The tokenizer in `directory` with tokenizer.json loaded once, straight into the Rust
    tokenizer, as an object of the class tokenizer_config.json names; None where that could
    differ from what AutoTokenizer loads (then it loads it)."""
    config_path, tokenizer_json = directory / "tokenizer_config.json", directory / "tokenizer.json"
    if not (config_path.is_file() and tokenizer_json.is_file()):
        return None
    config = json.loads(config_path.read_text())
    others = OTHER_TOKENIZER_FILES + (() if "added_tokens_decoder" in config else LEGACY_TOKENIZER_FILES)
    if any((directory / other).exists() for other in others):
        return None   # files that AutoTokenizer merges in; this loader reads none of them
    if config.get("auto_map"):
        return None
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = config.get("tokenizer_class")
    cls = tokenizer_class_from_name(name) if name else None
    if cls is None or not issubclass(cls, TokenizersBackend):
        return None
    if cls is not TokenizersBackend:
        if not is_gguf_view(directory):
            return None   # its constructor may build something other than the file (transformers' fixes)
        if any(callable(value) for key, value in vars(cls).items() if key not in ("__init__", "model")):
            return None   # a class with behaviour of its own beyond building the tokenizer
    # Left out: what describes the files, and the added tokens, which tokenizer.json holds already;
    # add_bos_token / add_eos_token too, as transformers drops them where there is a tokenizer.json
    # (given, they would rebuild its post-processor: an embedding model's appended EOS lost).
    for key in ("tokenizer_class", "added_tokens_decoder", "is_local", "local_files_only", "backend",
                "add_bos_token", "add_eos_token"):
        config.pop(key, None)
    template = directory / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    tokenizer = cls.__new__(cls)
    # The generic constructor, which loads tokenizer.json as it is; the class's own would rebuild it.
    TokenizersBackend.__init__(tokenizer, tokenizer_file=str(tokenizer_json), name_or_path=str(directory), **config)
    return tokenizer


def is_gguf_view(directory: Path) -> bool:
    """A GGUF file's config and tokenizer as rein wrote them (rein.model.files.gguf_view)."""
    config = directory / "config.json"
    return config.is_file() and "rein_gguf_source" in json.loads(config.read_text())


def tokenizer_directory(options: TokenizerOptions) -> Path:
    """--tokenizer as a directory: a local one as given, a hub id downloaded (tokenizer files
    only) at --tokenizer-revision."""
    path = Path(options.tokenizer).expanduser()
    if path.is_dir():
        return path
    if path.exists() or looks_local(options.tokenizer):
        raise ModelNotFoundError(f"--tokenizer {options.tokenizer}: not a directory; give a tokenizer "
                                 f"directory (tokenizer.json or tokenizer_config.json) or a hub id")
    return download_from_hub(options.tokenizer, weights=False, revision=options.tokenizer_revision)


def read_chat_template(value: str) -> str:
    """--chat-template's template: the file it names, or the text itself when it holds Jinja
    (`{{`, `{%`) or a newline. ChatTemplateError for a missing file or a template that does not compile."""
    path = Path(value).expanduser()
    if path.is_file():
        template, where = path.read_text(), f"file {path}"
    elif any(mark in value for mark in TEMPLATE_MARKS):
        template, where = value, "inline template"
    else:
        raise ChatTemplateError(f"--chat-template {value!r} is neither a file nor a Jinja template (no {{{{ or "
                                f"{{% in it): give the path of a template file or the template itself")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        # transformers' own environment, so what compiles here compiles when a prompt is built.
        _compile_jinja_template(template)
    except TemplateError as exc:
        line = f" (line {exc.lineno})" if getattr(exc, "lineno", None) else ""
        raise ChatTemplateError(f"--chat-template ({where}) is not a valid Jinja template{line}: {exc}") from None
    return template


def check_tokenizer_code(directory: Path, trust_remote_code: bool) -> None:
    """RemoteCodeRequired when the tokenizer in `directory` is a class of the repository's own
    code (tokenizer_config.json's auto_map names it and transformers has no class of that name)."""
    config_path = directory / "tokenizer_config.json"
    if trust_remote_code or not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    reference = (config.get("auto_map") or {}).get("AutoTokenizer")
    if not reference:
        return
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    name = config.get("tokenizer_class")
    if name and tokenizer_class_from_name(name) is not None:
        return   # transformers has the class itself and loads it without the repository's code
    code = ", ".join(r for r in reference if r) if isinstance(reference, list) else reference
    raise RemoteCodeRequired(f"the tokenizer in {directory} is the repository's own code ({code}, "
                             f"tokenizer_config.json's auto_map); {REMOTE_CODE_HINT}")
