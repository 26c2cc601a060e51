"""Load a model's weights into rein's native model: safetensors (float, or AWQ / GPTQ 4-bit), or
a GGUF file. Finding the files is `rein.model.files`.

A GGUF file's projection and embedding weights stay in their quantized blocks, repacked for
rein's kernels (rein.model.quant.gguf_blocks), and so do a MoE layer's stacked experts (3-D
`ffn_*_exps` tensors, as rein.kernels.quantized_experts.QuantizedExperts); its other tensors, types rein has no kernel
for, and everything under `--quantization none` are dequantized one tensor at a time to the
engine's dtype. AWQ / GPTQ projections stay 4-bit the same way, and `--quantization int8 |
int4` quantizes a float checkpoint's projections as they are read (rein.model.quant).

Under tensor parallelism (a `group` of several ranks) each rank builds its 1/N-wide model and
reads only its shard of each tensor: a slice of the safetensors file, or of a GGUF tensor
(whole groups of a quantized one; a cut through a group dequantizes it first)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from rein.model.architectures import native_model_class
from rein.model.architectures.rope import RotaryEmbedding
from rein.model.architectures.weights import Shard, TensorGetter
from rein.model.cpu_allocator import release_free_memory, return_freed_memory
from rein.model.files import (
    TENSOR_INDEX,
    DamagedGGUFFile,
    ModelFiles,
    ModelNotFoundError,
    require_gguf,
)
from rein.model.implementation import TRANSFORMERS_FAMILY, check_shardable
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.quant.checkpoint import (
    LoadReport,
    packed_checkpoint,
    quantized_at_load,
    resident_bytes,
    shard_of,
)
from rein.model.quant.methods import read_quantization_config
from rein.model.quant.names import CHECKPOINT_METHODS
from rein.model.spec import ModelSpec

log = logging.getLogger(__name__)


@contextmanager
def gguf_tensors(gguf_path: Path, directory: Path, dtype: torch.dtype, keep_quantized: bool = True,
                 report: LoadReport | None = None) -> Iterator[TensorGetter]:
    """A getter of Hugging Face-named tensors read from the GGUF file when asked for, so the
    whole checkpoint is never held in memory next to the model: repacked quantized where the
    caller takes that (and `keep_quantized`), else dequantized to `dtype`.

    Names are mapped with gguf's own tensor-name table and the tensors undone the way
    transformers does (its tensor processors reverse llama.cpp's q/k permutation: a reordering
    of rows, which a quantized weight takes as it is)."""
    require_gguf()
    import numpy as np
    from gguf import (
        GGML_QUANT_SIZES,
        MODEL_ARCH_NAMES,
        GGMLQuantizationType,
        dequantize,
        get_tensor_name_map,
    )
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from rein.kernels.quantized_experts import QuantizedExperts
    from rein.model.quant.gguf_blocks import repack, repack_rows

    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / TENSOR_INDEX).read_text())
    architecture = index["architecture"]
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelNotFoundError(f"{gguf_path}: GGUF architecture {architecture!r} is unknown to the gguf package")
    names = get_tensor_name_map(arch, config["num_hidden_layers"])
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    tensors = index["tensors"]
    # Read (pread) one tensor at a time rather than mapping the file: the pages of a mapping
    # count in this process's RSS while it lives, the file's size on top of the model's.
    file = open(gguf_path, "rb")  # noqa: SIM115  (closed when the getter's context ends)
    file_bytes = os.fstat(file.fileno()).st_size
    report = LoadReport() if report is None else report
    # Types stored as blocks (not F32 / F16 / BF16 / integers): candidates to keep quantized.
    block_types = {int(t) for t, (block, _) in GGML_QUANT_SIZES.items() if block > 1}

    def row_order(gguf_name: str, rows: int) -> tuple[bool, torch.Tensor | None]:
        """What the tensor processor does to a matrix's rows: (True, None) nothing, (True,
        order) a reordering, (False, None) something else (the tensor is dequantized)."""
        probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
        order = np.asarray(processor.process(weights=probe, name=gguf_name).weights).reshape(-1)
        if order.shape != (rows,) or not np.array_equal(np.sort(order), probe[:, 0]):
            return False, None
        if np.array_equal(order, probe[:, 0]):
            return True, None
        return True, torch.from_numpy(order.astype(np.int64))

    def quantized_weight(gguf_name: str, entry: dict, read_rows, shard: Shard | None, hf_name: str):
        """A 2-D tensor repacked a few rows at a time (rein.model.quant.gguf_blocks.repack_rows),
        so its file bytes are never all held next to it; None to dequantize it."""
        qtype = GGMLQuantizationType(entry["type"])
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        rows, row_bytes = (int(n) for n in entry["shape"])
        weight = repack_rows(read_rows, qtype.name, rows, row_bytes // type_bytes * block, row_bytes)
        reorder, order = row_order(gguf_name, rows) if weight is not None else (False, None)
        if weight is not None and reorder:
            if order is not None:
                weight = weight.permute_rows(order)
            weight = shard_of(weight, shard, hf_name)
            if weight is not None:
                report.quantized[qtype.name] += 1
                return weight
        report.dequantized[qtype.name] += 1
        return None

    def quantized_experts(gguf_name: str, entry: dict, data, shard: Shard | None, hf_name: str):
        """A stacked [n_expert, rows, cols] tensor (`blk.N.ffn_gate_exps.weight`) as
        QuantizedExperts, each expert repacked and cut to `shard` (a shard of dimension 1 or
        2 of the 3-D tensor is one of dimension 0 or 1 of each expert); None to dequantize."""
        qtype = GGMLQuantizationType(entry["type"])
        block, type_bytes = GGML_QUANT_SIZES[qtype]
        count, rows, row_bytes = data.shape
        cols = row_bytes // type_bytes * block
        reorder, order = row_order(gguf_name, rows)
        cut = None if shard is None else Shard(shard.dim - 1, shard.index, shard.count, shard.uneven)
        experts = []
        for e in range(count):
            weight = repack(data[e], qtype.name, rows, cols)
            if weight is None or not reorder or (shard is not None and shard.dim == 0):
                break
            if order is not None:
                weight = weight.permute_rows(order)
            weight = shard_of(weight, cut, hf_name)
            if weight is None:
                break
            experts.append(weight)
        if len(experts) < count:
            report.dequantized[qtype.name] += 1
            return None
        report.experts[qtype.name] += 1
        return QuantizedExperts.of(experts)

    def get(hf_name: str, shard: Shard | None = None, quantized: bool = False) -> torch.Tensor | None:
        stem, _, suffix = hf_name.rpartition(".")
        gguf_name = f"{names.get_name(stem) or legacy_expert_name(stem)}.{suffix}"
        entry = tensors.get(gguf_name)
        if entry is None:
            return None
        item = np.dtype(entry["dtype"])
        length = math.prod(int(n) for n in entry["shape"]) * item.itemsize   # Python integers: no wrap-around
        start = int(entry["offset"])
        # The index was checked against the file when it was written (rein.model.files);
        # the file may have changed since (truncated under the same name).
        if start < 0 or start + length > file_bytes:
            raise DamagedGGUFFile(f"{gguf_path}: tensor {gguf_name!r} lies at bytes {start}..{start + length}, past "
                                  f"the end of the file ({file_bytes} bytes): the file is truncated or damaged")

        def read(offset: int, size: int) -> bytes:
            raw = os.pread(file.fileno(), size, start + offset)
            if len(raw) != size:
                raise DamagedGGUFFile(f"{gguf_path}: tensor {gguf_name!r}: read {len(raw)} of {size} bytes at "
                                      f"{start + offset}: the file is truncated or damaged")
            return raw

        if quantized and keep_quantized and entry["type"] in block_types and len(entry["shape"]) == 2:
            row_bytes = int(entry["shape"][1]) * item.itemsize

            def read_rows(first: int, stop: int) -> np.ndarray:
                raw = read(first * row_bytes, (stop - first) * row_bytes)
                return np.frombuffer(raw, dtype=item).reshape(stop - first, -1)

            weight = quantized_weight(gguf_name, entry, read_rows, shard, hf_name)
            if weight is not None:
                return weight
        data = np.frombuffer(read(0, length), dtype=item).reshape(entry["shape"])
        if quantized and keep_quantized and entry["type"] in block_types and data.ndim == 3:
            experts = quantized_experts(gguf_name, entry, data, shard, hf_name)
            if experts is not None:
                return experts
        weights = dequantize(data, GGMLQuantizationType(entry["type"]))
        weights = processor.process(weights=weights, name=gguf_name).weights
        if shard is not None:
            weights = weights[shard.slices(weights.shape, hf_name)]   # copied below: only the shard stays
        return torch.from_numpy(np.array(weights, copy=True)).to(dtype)

    try:
        yield get
    finally:
        file.close()


# One expert's projection, as a checkpoint names it, and llama.cpp's per-expert tensor of it.
_EXPERT_STEM = re.compile(r"(?:model\.)?layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                          r"(w1|w3|w2|gate_proj|up_proj|down_proj)")
_LEGACY_EXPERT = {"w1": "ffn_gate", "gate_proj": "ffn_gate", "w3": "ffn_up", "up_proj": "ffn_up",
                  "w2": "ffn_down", "down_proj": "ffn_down"}


def legacy_expert_name(stem: str) -> str | None:
    """llama.cpp's name for one expert's projection in files written before the experts were
    stacked (early 2024 Mixtral GGUFs: `blk.N.ffn_gate.E`); None for any other stem."""
    match = _EXPERT_STEM.fullmatch(stem)
    if match is None:
        return None
    layer, expert, projection = match.groups()
    return f"blk.{layer}.{_LEGACY_EXPERT[projection]}.{expert}"


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

        def get(name: str, shard: Shard | None = None, quantized: bool = False) -> torch.Tensor | None:
            handle = where.get(name)
            if handle is None:
                return None
            if shard is None:
                return handle.get_tensor(name)
            part = handle.get_slice(name)   # reads only the shard's bytes
            return part[shard.slices(part.get_shape(), name)]

        yield get


def load_model(files: ModelFiles, spec: ModelSpec, max_positions: int, dtype: torch.dtype,
               device: torch.device, trust_remote_code: bool = False, group: ParallelGroup = SINGLE_RANK,
               quantization: str = "auto"):
    """Build the native model on `device` in `dtype` and fill it from the checkpoint (or, for
    the "transformers" family, the model transformers builds, from the repository's own code
    under `trust_remote_code`: rein.model.architectures.transformers_backend). With a `group` of
    several ranks, this rank's shard of it (rein.model.parallel). `quantization`: see
    rein.model.quant.checkpoint."""
    if device.type == "cpu":
        return_freed_memory()   # one-off buffers back to the system as they are freed (rein.model.cpu_allocator)
    if spec.family == TRANSFORMERS_FAMILY:
        check_shardable(spec, group.world_size)
        if quantization not in ("auto", "none") or read_quantization_config(_config(files)) is not None:
            raise ValueError(f"{spec.architecture} runs on the Transformers backend, which rein does not "
                             f"quantize: use one of rein's native architectures or --quantization auto "
                             f"with a float checkpoint")
        from rein.model.architectures.transformers_backend import load_transformers_model

        model = load_transformers_model(files, spec, dtype, device, trust_remote_code)
        if device.type == "cpu":
            model.pack_cpu_weights()
        return model

    with torch.device("meta"), no_weight_init():
        model = native_model_class(spec)(spec, max_positions, group)
    materialize(model, device, dtype)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.build_table()  # rope tables stay fp32
    report = LoadReport()
    with checkpoint_tensors(files, dtype, quantization, report) as get:
        model.load_hf_weights(_base_model_names(get))
    model.eval()
    if device.type == "cpu":
        model.pack_cpu_weights()   # oneDNN's blocked layout, once (rein.model.architectures.linear)
        release_free_memory()      # the load's freed buffers back to the system
    log.info("%s", report.describe(resident_bytes(model)))
    return model


# The torch.nn.init functions the modules' reset_parameters call.
WEIGHT_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_")


@contextmanager
def no_weight_init() -> Iterator[None]:
    """torch.nn.init's initializers as no-ops, while a model is built on the meta device: its
    weights hold no data and are all loaded afterwards. Not for speed: a meta tensor's
    `normal_` runs torch's Python decomposition, whose first call imports torch._dynamo, and
    with it sympy and triton -- 133 MiB resident in every CPU engine process, used by nothing
    else there (SmolLM2's engine: 637 -> 494 MiB after load)."""
    init = torch.nn.init
    saved = {name: getattr(init, name) for name in WEIGHT_INITS}
    for name in WEIGHT_INITS:
        setattr(init, name, _leave_as_is)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(init, name, function)


def _leave_as_is(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Real storage for a model built on the meta device, straight on `device`, floating point
    in `dtype`, not initialized. Not nn.Module.to_empty: on the CPU its copies came back with
    their pages touched (109 of an embedding's 113 MB resident before a weight was read), and a
    weight that then arrives quantized should never have cost its float size."""
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            made[id(t)] = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
        return made[id(t)]

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                module._parameters[name] = torch.nn.Parameter(real(param), requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = real(buffer)


@contextmanager
def checkpoint_tensors(files: ModelFiles, dtype: torch.dtype, quantization: str = "auto",
                       report: LoadReport | None = None) -> Iterator[TensorGetter]:
    """The checkpoint's tensor getter for `quantization` (rein.model.quant.checkpoint)."""
    report = LoadReport() if report is None else report
    packed = read_quantization_config(_config(files)) if files.gguf is None else None
    if quantization in CHECKPOINT_METHODS:
        found = "gguf" if files.gguf is not None else (packed.method if packed is not None else "none")
        if found != quantization:
            raise ValueError(f"--quantization {quantization} names the checkpoint's method, but this checkpoint is "
                             f"{'not quantized' if found == 'none' else found.upper()}: use --quantization auto")
        quantization = "auto"
    if packed is not None and quantization not in ("auto", "none"):
        raise ValueError(f"the checkpoint is already quantized ({packed.method.upper()} {packed.bits}-bit): "
                         f"drop --quantization {quantization} (or use auto, or none to dequantize it)")
    if files.gguf is not None:
        source = gguf_tensors(files.gguf, files.directory, dtype, keep_quantized=quantization != "none",
                              report=report)
    else:
        source = safetensors_tensors(files.directory)
    with source as get:
        if packed is not None:
            get = packed_checkpoint(get, packed, dtype, report)
            if quantization == "none":
                get = _floats_only(get)
        if quantization not in ("auto", "none"):
            get = quantized_at_load(get, quantization, report)
        yield get


def _floats_only(get: TensorGetter) -> TensorGetter:
    def lookup(name: str, shard: Shard | None = None, quantized: bool = False):
        return get(name, shard)
    return lookup


def _config(files: ModelFiles) -> dict:
    path = files.directory / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _base_model_names(get: TensorGetter) -> TensorGetter:
    """A getter that also finds `model.X` saved as plain `X`: checkpoints saved from the base
    model (transformers' AutoModel, as sentence-transformers and Qwen3-Embedding ship them)
    lack the causal LM's `model.` prefix, which transformers itself tolerates."""

    def lookup(name: str, shard: Shard | None = None, quantized: bool = False):
        tensor = get(name, shard, quantized)
        if tensor is None and name.startswith("model."):
            tensor = get(name.removeprefix("model."), shard, quantized)
        return tensor

    return lookup
