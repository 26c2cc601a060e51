"""Load a model's weights into rein's native model: safetensors, or a GGUF file dequantized
one tensor at a time to the engine's dtype. Finding the files is `rein.engine.model_files`.

Under tensor parallelism (a `group` of several ranks) each rank builds its 1/N-wide model and
reads only its shard of each tensor: a slice of the safetensors file, or of a GGUF tensor
right after dequantizing it (quantized blocks cannot be sliced before)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from rein.engine.model_files import TENSOR_INDEX, ModelFiles, ModelNotFoundError, require_gguf
from rein.engine.model_impl import TRANSFORMERS_FAMILY
from rein.engine.model_spec import ModelSpec
from rein.engine.models import native_model_class
from rein.engine.models.rope import RotaryEmbedding
from rein.engine.models.weights import Shard, TensorGetter
from rein.engine.parallel.group import SINGLE_RANK, ParallelGroup


@contextmanager
def gguf_tensors(gguf_path: Path, directory: Path, dtype: torch.dtype) -> Iterator[TensorGetter]:
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

    def get(hf_name: str, shard: Shard | None = None) -> torch.Tensor | None:
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
        if shard is not None:
            weights = weights[shard.slices(weights.shape, hf_name)]   # copied below: only the shard stays
        return torch.from_numpy(np.array(weights, copy=True)).to(dtype)

    yield get


@contextmanager
def safetensors_tensors(directory: Path) -> Iterator[TensorGetter]:
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

        def get(name: str, shard: Shard | None = None) -> torch.Tensor | None:
            handle = where.get(name)
            if handle is None:
                return None
            if shard is None:
                return handle.get_tensor(name)
            part = handle.get_slice(name)   # reads only the shard's bytes
            return part[shard.slices(part.get_shape(), name)]

        yield get


def load_model(files: ModelFiles, spec: ModelSpec, max_positions: int, dtype: torch.dtype,
               device: torch.device, trust_remote_code: bool = False, group: ParallelGroup = SINGLE_RANK):
    """Build the native model on `device` in `dtype` and fill it from the checkpoint (or, for
    the "transformers" family, the model transformers builds, from the repository's own code
    under `trust_remote_code`: rein.engine.models.transformers_backend). With a `group` of
    several ranks, this rank's shard of it (rein.engine.parallel)."""
    if spec.family == TRANSFORMERS_FAMILY:
        if group.world_size > 1:
            raise ValueError(f"tensor parallelism (size {group.world_size}) needs one of rein's native models; "
                             f"{spec.architecture} runs on the Transformers backend, which has none: use size 1")
        from rein.engine.models.transformers_backend import load_transformers_model

        model = load_transformers_model(files, spec, dtype, device, trust_remote_code)
        if device.type == "cpu":
            model.pack_cpu_weights()
        return model

    with torch.device("meta"):
        model = native_model_class(spec)(spec, max_positions, group)
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


def _base_model_names(get: TensorGetter) -> TensorGetter:
    """A getter that also finds `model.X` saved as plain `X`: checkpoints saved from the base
    model (transformers' AutoModel, as sentence-transformers and Qwen3-Embedding ship them)
    lack the causal LM's `model.` prefix, which transformers itself tolerates."""

    def lookup(name: str, shard: Shard | None = None) -> torch.Tensor | None:
        tensor = get(name, shard)
        if tensor is None and name.startswith("model."):
            tensor = get(name.removeprefix("model."), shard)
        return tensor

    return lookup
