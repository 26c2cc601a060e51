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
    hf_model_dir: str | Path,
    out_dir: str | Path,
    r: int,
    target_modules: Sequence[str] | str,
    use_rslora: bool = False,
    lora_alpha: float = 16,
    seed: int = 0,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    weight_std: float = 0.05,
    **config: Any,
) -> Path:
    """Write a PEFT LoRA adapter for the model in `hf_model_dir` to `out_dir` (adapter_config.json
    + adapter_model.safetensors, as `save_pretrained` writes them) and return `out_dir`.

    Every lora_A / lora_B weight is N(0, weight_std) under `torch.manual_seed(seed)`; extra
    keyword arguments go to `peft.LoraConfig` (e.g. `use_dora=True` for an adapter rein refuses).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
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
