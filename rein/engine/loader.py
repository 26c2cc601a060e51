"""Find a model's files and load them: a local Hugging Face directory or a hub id.

A hub id is downloaded (config, tokenizer and safetensors only) when the hub is
reachable; otherwise the error says so and how to point at a local directory instead.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from rein.engine.model_spec import ModelSpec
from rein.engine.models.llama import LlamaFamilyModel

log = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; anything else is tried as a Hugging Face hub id."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{model} is a file; --model takes a model directory or a hub id")
    looks_local = str(model).startswith((".", "/", "~")) or str(model).count("/") > 1
    if looks_local:
        raise ModelNotFoundError(f"model directory {model} does not exist")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            str(model), allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
    except Exception as exc:  # the hub raises many kinds (offline, 404, auth)
        raise ModelNotFoundError(
            f"{model} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). Download it elsewhere and pass its directory to --model, "
            f"or build a test model with `rein make-tiny-model DIR`."
        ) from exc


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{model_dir} has no *.safetensors weights (rein loads safetensors only)")
    return files


def load_model(model_dir: Path, spec: ModelSpec, max_positions: int, dtype: torch.dtype,
               device: torch.device) -> LlamaFamilyModel:
    """Build the native model on `device` in `dtype` and fill it from the safetensors files."""
    with torch.device("meta"):
        model = LlamaFamilyModel(spec, max_positions)
    # Real storage straight on the target device, in the target dtype; no random init.
    model = model.to_empty(device=device).to(dtype=dtype)
    model.rope.build_table()  # the rope table stays fp32
    with ExitStack() as stack:
        where: dict[str, object] = {}
        for file in safetensors_files(model_dir):
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                where[name] = handle

        def get(name: str) -> torch.Tensor | None:
            handle = where.get(name)
            return None if handle is None else handle.get_tensor(name)

        model.load_hf_weights(get)
    model.eval()
    return model
