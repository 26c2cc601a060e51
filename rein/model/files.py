"""Find a model's files: a Hugging Face directory, a GGUF file, or a hub id.

No torch here: the API resolves models too. `resolve_model` turns what the user typed after `--model` into `ModelFiles`: a directory
holding `config.json` and the tokenizer (everything but the weights is read from there),
and where the weights are (safetensors in that directory, or a GGUF file).

A GGUF file carries its config, tokenizer and chat template in its metadata. transformers
reads them (slowly: parsing the vocabulary takes seconds), so the first load writes them
as an ordinary Hugging Face directory into rein's cache (`REIN_CACHE_DIR`, by default
`~/.cache/rein`), keyed by the file's path, size and modification time; every later load,
the API's included, reads that directory. A mixture-of-experts file's expert sizes (and
Mixtral, which llama.cpp writes as "llama" with experts) are completed from its metadata
(`moe_config`). The weights are always read from the GGUF itself, one tensor at a time
(`rein.model.loader`: kept in their quantized blocks, or dequantized to the engine's dtype).

A hub id is downloaded (config, tokenizer and safetensors only, at `--revision` when given)
when the hub is reachable; otherwise the error names the three ways to give a model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from struct import error as struct_error
from typing import TYPE_CHECKING, Any

from rein.core.settings import cache_root

if TYPE_CHECKING:
    from rein.model.spec import ModelSpec
    from rein.model.tokenizer_files import TokenizerOptions

log = logging.getLogger(__name__)

WAYS_TO_GIVE_A_MODEL = (
    "give --model a local Hugging Face model directory (config.json, tokenizer, *.safetensors), "
    "a GGUF file (or a directory holding one), or a hub id such as Qwen/Qwen2.5-0.5B-Instruct "
    "where huggingface.co is reachable"
)
GGUF_EXTRA_HINT = "loading a GGUF file needs the gguf package: pip install 'rein[gguf]'"
TENSOR_INDEX = "gguf_tensors.json"
# Part of a GGUF view's cache key: raised when what a view holds changes, so views written by
# an older rein are written again (2: MoE files' expert sizes and Mixtral read from the metadata).
VIEW_VERSION = 2
# GGUF metadata keys (after "<architecture>.") of a mixture-of-experts model, kept in the tensor
# index for `moe_config`: transformers' GGUF config mapping reads some of them for some
# architectures only.
EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length",
               "expert_shared_feed_forward_length")


class ModelNotFoundError(FileNotFoundError):
    pass


class GGUFSupportMissing(ValueError):
    """A GGUF file was given but the gguf package is not installed (the `rein[gguf]` extra)."""


class DamagedGGUFFile(ValueError):
    """A GGUF file whose header does not fit the file: a tensor past its end (a truncated
    download), an impossible size or type. The message names the file and the tensor."""


@dataclass(frozen=True)
class ModelFiles:
    """A model on disk. `directory` holds config.json and the tokenizer; the weights are
    `directory`'s safetensors, or `gguf` when that is set."""

    directory: Path
    gguf: Path | None = None

    @property
    def spec(self) -> ModelSpec:
        from rein.model.spec import ModelSpec

        return ModelSpec.from_dir(self.directory)

    def load_tokenizer(self, options: TokenizerOptions | None = None):
        """The model's tokenizer, or the one `options` choose, with their chat template
        (rein.model.tokenizer_files)."""
        from rein.model.tokenizer_files import TokenizerOptions, load_tokenizer

        return load_tokenizer(self.directory, options or TokenizerOptions())


def resolve_model(model: str | Path, *, weights: bool = True, revision: str | None = None) -> ModelFiles:
    """What `--model` names, as files. weights=False (the API) fetches no weights for a hub id;
    `revision` (--revision) is the hub revision of a hub id (a local model has none)."""
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{model} is a file but not a GGUF file (*.gguf); {WAYS_TO_GIVE_A_MODEL}")
        return ModelFiles(gguf_view(path), gguf=path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelFiles(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelFiles(gguf_view(ggufs[0]), gguf=ggufs[0])
        if len(ggufs) > 1:
            raise ModelNotFoundError(
                f"{model} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs)}): "
                f"give --model the one to load")
        raise ModelNotFoundError(f"{model} has neither config.json nor a GGUF file; {WAYS_TO_GIVE_A_MODEL}")
    if looks_local(str(model)):
        raise ModelNotFoundError(f"{model} does not exist; {WAYS_TO_GIVE_A_MODEL}")
    return ModelFiles(download_from_hub(str(model), weights, revision))


def looks_local(name: str) -> bool:
    """A name that can only be a path (a hub id is `owner/name` or `name`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or name.lower().endswith(".gguf")


def download_from_hub(hub_id: str, weights: bool, revision: str | None = None) -> Path:
    """The snapshot directory of `hub_id` at `revision` (None: the default branch): its config,
    tokenizer, chat template, code and, with `weights`, safetensors files."""
    # The repository's *.py too: small, and run only under --trust-remote-code (rein.model.tokenizer_files).
    patterns = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.py"]
    if weights:
        patterns.append("*.safetensors")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(hub_id, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # the hub raises many kinds (offline, 404, auth)
        raise ModelNotFoundError(
            f"{hub_id} is not a local path and could not be fetched from the Hugging Face hub"
            f"{f' at revision {revision}' if revision else ''} "
            f"({type(exc).__name__}: {exc}); instead, {WAYS_TO_GIVE_A_MODEL} "
            f"(`rein make-tiny-model DIR` builds a random-weight test model)"
        ) from exc


# -- GGUF -------------------------------------------------------------------------------------


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise GGUFSupportMissing(GGUF_EXTRA_HINT) from exc


def gguf_view(gguf_path: Path) -> Path:
    """The cached Hugging Face directory (config, generation config, tokenizer) of a GGUF file,
    written on first use."""
    gguf_path = gguf_path.resolve()
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{VIEW_VERSION}".encode()).hexdigest()[:16]
    view = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (view / "config.json").is_file():
        return view
    require_gguf()
    log.info("reading the config and tokenizer of %s (once; cached in %s)", gguf_path, view)
    view.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=view.name + ".", dir=view.parent))
    try:
        _write_view(gguf_path, staging)
        try:
            staging.rename(view)
        except OSError:  # another process wrote it first: theirs is as good as ours
            if not (view / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return view


def _write_view(gguf_path: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    index = gguf_tensor_index(gguf_path)   # first: a damaged file is refused before anything else reads it
    folder, name = str(gguf_path.parent), gguf_path.name
    config = moe_config(AutoConfig.from_pretrained(folder, gguf_file=name).to_dict(), index)
    config["rein_gguf_source"] = str(gguf_path)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(str(out))
    (out / TENSOR_INDEX).write_text(json.dumps(index))


def moe_config(config: dict, index: dict) -> dict:
    """transformers' config of a GGUF file completed with its experts' metadata (`index`'s
    "experts"), which transformers 5's GGUF mapping leaves out: Qwen2-MoE's and Qwen3-MoE's
    expert widths (expert_feed_forward_length, expert_shared_feed_forward_length; it would
    keep its config class's defaults, Qwen2-MoE's 1408 and 5632), and Mixtral, which llama.cpp
    writes as architecture "llama" with expert_count > 0 (transformers reads a dense Llama)."""
    experts = index.get("experts") or {}
    count = experts.get("expert_count", 0)
    if not count:
        return config
    config = dict(config)
    model_type = config.get("model_type")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        config["num_experts"] = count
        config["num_experts_per_tok"] = experts.get("expert_used_count", config.get("num_experts_per_tok"))
        if "expert_feed_forward_length" in experts:
            config["moe_intermediate_size"] = experts["expert_feed_forward_length"]
        if model_type == "qwen2_moe":
            config["shared_expert_intermediate_size"] = experts.get("expert_shared_feed_forward_length", 0)
        # llama.cpp's Qwen MoE graphs route every layer through the experts.
        config["mlp_only_layers"], config["decoder_sparse_step"] = [], 1
    elif model_type in ("llama", "mistral"):
        # llama.cpp's llama graph with experts is Mixtral's: every layer sparse, the experts
        # feed_forward_length wide, the top-k weights renormalised.
        config.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=count,
                      num_experts_per_tok=experts.get("expert_used_count", 2))
    return config


def gguf_tensor_index(gguf_path: Path) -> dict:
    """Where each tensor lies in the file (offset and bytes), so a load need not parse the
    metadata again (gguf's reader takes seconds over a large vocabulary). DamagedGGUFFile
    when the header does not fit the file (`checked_gguf_reader`)."""
    reader = checked_gguf_reader(gguf_path)
    try:
        architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    except (KeyError, IndexError, UnicodeDecodeError) as exc:
        raise DamagedGGUFFile(f"{gguf_path}: the GGUF header names no general.architecture ({exc})") from None
    experts = {}
    for key in EXPERT_KEYS:
        field = reader.fields.get(f"{architecture}.{key}")
        if field is not None and field.data:
            experts[key] = int(field.parts[field.data[0]][0])
    return {
        "architecture": architecture,
        "experts": experts,
        "tensors": {t.name: {"type": int(t.tensor_type), "offset": int(t.data_offset), "bytes": int(t.n_bytes),
                             "dtype": t.data.dtype.str, "shape": list(t.data.shape)}
                    for t in reader.tensors},
    }


def checked_gguf_reader(gguf_path: Path) -> Any:
    """gguf's GGUFReader over the file, once every tensor's data is known to lie inside it:
    its offset plus its size (computed in Python integers, so a huge dimension cannot wrap
    around) within the file's length, its type one gguf knows, its elements whole blocks.
    gguf's own reader maps the file and would slice past its end without a word (a
    truncated download read as a shorter tensor, or failing later in a reshape)."""
    require_gguf()
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class CheckedReader(GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_type, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                where = f"{gguf_path}: tensor {name!r}"
                try:
                    kind = GGMLQuantizationType(int(raw_type[0]))
                    block, type_bytes = GGML_QUANT_SIZES[kind]
                except (ValueError, KeyError):
                    raise DamagedGGUFFile(f"{where} has type {int(raw_type[0])}, which no GGUF type is") from None
                elements = math.prod(int(d) for d in dims)
                if elements % block:
                    raise DamagedGGUFFile(f"{where} holds {elements} values, not whole blocks of {block} "
                                          f"({kind.name})")
                start = int(start_offs) + int(offset[0])
                end = start + elements // block * type_bytes
                if end > size:
                    raise DamagedGGUFFile(
                        f"{where} lies at bytes {start}..{end}, past the end of the file ({size} bytes): the file is "
                        f"truncated or damaged; fetch it again")
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(gguf_path))
    except DamagedGGUFFile:
        raise
    except (ValueError, IndexError, KeyError, OverflowError, struct_error) as exc:
        raise DamagedGGUFFile(f"{gguf_path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None
