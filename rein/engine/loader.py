"""Load a model's weights into rein's native model: safetensors, or a GGUF file dequantized
one tensor at a time to the engine's dtype. Finding the files is `rein.engine.model_files`."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from rein.engine.model_files import TENSOR_INDEX, ModelFiles, ModelNotFoundError, require_gguf
from rein.engine.model_spec import TRANSFORMERS_FAMILY, ModelSpec
from rein.engine.models import native_model_class
from rein.engine.models.rope import RotaryEmbedding


@contextmanager
def gguf_tensors(gguf_path: Path, directory: Path, dtype: torch.dtype) -> Iterator[Callable[[str], torch.Tensor | None]]:
    """A getter of Hugging Face-named tensors, each dequantized from the GGUF file when asked
    for, so the whole checkpoint is never held in memory next to the model.

    Names are mapped with gguf's own tensor-name table and the tensors undone the way
    transformers does (its tensor processors reverse llama.cpp's q/k permutation)."""
    require_gguf()
    import numpy as np
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / TENSOR_INDEX).read_text())
    architecture = index["architecture"]
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelNotFoundError(f"{gguf_path}: GGUF architecture {architecture!r} is unknown to the gguf package")
    names = get_tensor_name_map(arch, config["num_hidden_layers"])
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    tensors = index["tensors"]
    mapped = np.memmap(gguf_path, dtype=np.uint8, mode="r")

    def get(hf_name: str) -> torch.Tensor | None:
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(stem)}.{suffix}"
        entry = tensors.get(gguf_name)
        if entry is None:
            return None
        item = np.dtype(entry["dtype"])
        count = int(np.prod(entry["shape"]))
        data = np.frombuffer(mapped, dtype=item, count=count, offset=entry["offset"]).reshape(entry["shape"])
        weights = dequantize(data, GGMLQuantizationType(entry["type"]))
        weights = processor.process(weights=weights, name=gguf_name).weights
        return torch.from_numpy(np.array(weights, copy=True)).to(dtype)

    yield get


@contextmanager
def safetensors_tensors(directory: Path) -> Iterator[Callable[[str], torch.Tensor | None]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(
            f"{directory} has no *.safetensors weights (rein loads safetensors and GGUF)")
    with ExitStack() as stack:
        where: dict[str, object] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for name in handle.keys():
                where[name] = handle

        def get(name: str) -> torch.Tensor | None:
            handle = where.get(name)
            return None if handle is None else handle.get_tensor(name)

        yield get


def load_model(files: ModelFiles, spec: ModelSpec, max_positions: int, dtype: torch.dtype,
               device: torch.device, trust_remote_code: bool = False):
    """Build the native model on `device` in `dtype` and fill it from the checkpoint (or, for
    the "transformers" family, the model transformers builds, from the repository's own code
    under `trust_remote_code`: rein.engine.models.transformers_backend)."""
    if spec.family == TRANSFORMERS_FAMILY:
        from rein.engine.models.transformers_backend import load_transformers_model

        model = load_transformers_model(files, spec, dtype, device, trust_remote_code)
        if device.type == "cpu":
            model.pack_cpu_weights()
        return model

    with torch.device("meta"):
        model = native_model_class(spec)(spec, max_positions)
    # Real storage straight on the target device, in the target dtype; no random init.
    model = model.to_empty(device=device).to(dtype=dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_table()  # rope tables stay fp32
    weights = gguf_tensors(files.gguf, files.directory, dtype) if files.gguf is not None \
        else safetensors_tensors(files.directory)
    with weights as get:
        model.load_hf_weights(_base_model_names(get))
    model.eval()
    if device.type == "cpu":
        model.pack_cpu_weights()   # oneDNN's blocked layout, once (rein.engine.models.linear)
    return model


def _base_model_names(get: Callable[[str], torch.Tensor | None]) -> Callable[[str], torch.Tensor | None]:
    """A getter that also finds `model.X` saved as plain `X`: checkpoints saved from the base
    model (transformers' AutoModel, as sentence-transformers and Qwen3-Embedding ship them)
    lack the causal LM's `model.` prefix, which transformers itself tolerates."""

    def lookup(name: str) -> torch.Tensor | None:
        tensor = get(name)
        if tensor is None and name.startswith("model."):
            tensor = get(name.removeprefix("model."))
        return tensor

    return lookup
