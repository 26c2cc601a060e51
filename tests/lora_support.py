"""PEFT LoRA adapters for tests: made on a tiny Hugging Face model (rein.fixtures.tiny_model)
with transformers + peft, the reference implementation rein's LoRA is compared against.

PEFT starts B at zero (an adapter that changes nothing, which would let a LoRA implementation
that ignores the adapter pass); here A and B are both redrawn from a seeded normal, small
enough that the adapted model stays close to the base (std `weight_std`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def make_peft_adapter(
    hf_model_dir: str | Path | None,
    out_dir: str | Path,
    r: int,
    target_modules: Sequence[str] | str,
    use_rslora: bool = False,
    lora_alpha: float = 16,
    seed: int = 0,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    weight_std: float = 0.05,
    base_model: Any = None,
    **config: Any,
) -> Path:
    """Write a PEFT LoRA adapter for the model in `hf_model_dir` to `out_dir` (adapter_config.json
    + adapter_model.safetensors, as `save_pretrained` writes them) and return `out_dir`.

    Every lora_A / lora_B weight is N(0, weight_std) under `torch.manual_seed(seed)`; extra
    keyword arguments go to `peft.LoraConfig` (e.g. `use_dora=True` for an adapter rein refuses).
    `base_model`: a loaded transformers model to adapt (a copy of it; `hf_model_dir` is then not
    read), e.g. the real tier's reading of a GGUF file.
    """
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if base_model is not None:
        base = copy.deepcopy(base_model)
    else:
        base = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    lora_config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        lora_dropout=0.0,
        bias=config.pop("bias", "none"),
        task_type="CAUSAL_LM",
        init_lora_weights=False,
        **config,
    )
    model = get_peft_model(base, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * weight_std)
    model.save_pretrained(str(out))
    return out


def peft_logits(hf_model_dir: str | Path, adapter_dir: str | Path | None, input_ids: Any) -> Any:
    """Reference logits [T, vocab] (float32) of one sequence `input_ids` [T] under the PEFT adapter
    in `adapter_dir` (None: the base model alone)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
        return model(input_ids=ids).logits[0].float()


def peft_greedy(hf_model_dir: str | Path, adapter_dir: str | Path | None, prompt: Sequence[int],
                max_tokens: int) -> list[int]:
    """The reference greedy answer: transformers (+ PEFT with `adapter_dir`), one argmax at a
    time for `max_tokens` tokens (end of sequence ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


# The base's model_type -> the general.architecture llama.cpp's convert_hf_to_gguf.py writes for
# its architecture, and whether that model class reorders the q/k rows (LlamaModel's permute).
GGUF_CONVERSION = {"llama": ("llama", True), "mistral": ("llama", True), "qwen2": ("qwen2", False),
                   "qwen3": ("qwen3", False)}


def llama_cpp_permute(rows: Any, n_head: int, n_head_kv: int | None = None) -> Any:
    """The row reordering llama.cpp's converter applies to Llama q/k weights (rotary pairs
    interleaved per head), applied to any [out, ...] array's rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = rows.shape
    return rows.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def peft_to_gguf(adapter_dir: str | Path, hf_model_dir: str | Path, out_path: str | Path, outtype: str = "f32",
                 architecture: str | None = None, extra: dict[str, Any] | None = None,
                 tensors: dict[str, Any] | None = None) -> Path:
    """Write the PEFT adapter in `adapter_dir` as llama.cpp's convert_lora_to_gguf.py does (written
    here from reading it): general.type "adapter", adapter.type "lora", adapter.lora.alpha (float32),
    general.architecture; per adapted projection `<llama.cpp base name>.lora_a` (PEFT's A, [r, in]
    as an array: ne [in, r]) and `.lora_b` (B, [out, r]), B's rows of q/k reordered as the base's
    are for Llama. `outtype` f32 | f16 | bf16 | q8_0 (q8_0 falls back to f16 for rows that are not
    whole blocks of 32, as the converter does). `architecture`, `extra` (metadata key -> string,
    None to leave out) and `tensors` (name -> array, added or replacing) make damaged files."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    adapter_dir, out_path = Path(adapter_dir), Path(out_path)
    lora_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    hf_config = json.loads((Path(hf_model_dir) / "config.json").read_text())
    arch_name, permutes = GGUF_CONVERSION[hf_config["model_type"]]
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch_name)
    names = gguf.get_tensor_name_map(arch, hf_config["num_hidden_layers"])
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads", heads)

    written: dict[str, Any] = {}
    for key, value in sorted(load_file(str(adapter_dir / "adapter_model.safetensors")).items()):
        module, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        base = names.get_name(module) + ".weight"
        if which == "B.weight" and permutes and module.endswith(("q_proj", "k_proj")):
            value = llama_cpp_permute(value, heads, kv_heads if module.endswith("k_proj") else None)
        written[base + (".lora_a" if which == "A.weight" else ".lora_b")] = value.astype(np.float32)
    written.update(tensors or {})

    writer = gguf.GGUFWriter(str(out_path), architecture or arch_name)
    metadata = {"general.type": "adapter", "adapter.type": "lora", **(extra or {})}
    for key, text in metadata.items():
        if text is not None:
            writer.add_string(key, text)
    writer.add_float32("adapter.lora.alpha", float(lora_config["lora_alpha"]))
    for name, value in written.items():
        if outtype == "f16" or (outtype == "q8_0" and value.shape[-1] % 32):
            writer.add_tensor(name, value.astype(np.float16))
        elif outtype in ("bf16", "q8_0"):
            qtype = gguf.GGMLQuantizationType.BF16 if outtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path
