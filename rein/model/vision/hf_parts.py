"""Vision towers and projectors made of transformers' own modules, for the families whose
encoder rein does not reimplement (LLaVA's CLIP / SigLIP tower and MLP projector, Idefics3's
tower and pixel-shuffle connector, Gemma 3's SigLIP tower and pooled projector).

The encoder runs once per image (the engine caches its output by the image's content), so its
speed matters far less than the text model's; running transformers' modules keeps its
arithmetic exactly transformers'. `build_module` makes one from a config without a random
initialisation (the checkpoint overwrites every weight), `load_module` fills it from the
checkpoint under whichever of the layouts transformers has saved it in: transformers 5's
`model.vision_tower.*` or the older `vision_tower.*`, each with or without the tower's own
`vision_model.` level (CLIPVisionModel / SiglipVisionModel wrap their transformer in one
in checkpoints; transformers 5's modules no longer do).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rein.model.spec import UnsupportedModelError

# Levels a tower's own names may carry in a checkpoint but not in the module (or the reverse).
TOWER_LEVELS = ("", "vision_model.")


def build_module(factory: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`factory()` without transformers' random initialisation, on `device` in `dtype`, in eval mode."""
    from transformers.initialization import no_init_weights

    with no_init_weights():
        module = factory()
    return module.to(device=device, dtype=dtype).eval()


def load_module(module: nn.Module, get: Callable[[str], torch.Tensor | None], prefixes: tuple[str, ...],
                what: str) -> None:
    """Copy every parameter and persistent buffer of `module` from the checkpoint getter `get`,
    looking each name up under `prefixes` (most recent layout first) and TOWER_LEVELS;
    UnsupportedModelError naming the first missing tensor."""
    with torch.no_grad():
        for name, target in module.state_dict().items():
            tensor = _find(get, prefixes, name)
            if tensor is None:
                raise UnsupportedModelError(
                    f"the checkpoint has no {what} weight {prefixes[0]}{name} (nor under {', '.join(prefixes[1:])}): "
                    f"is it a complete {what} checkpoint?")
            if tuple(tensor.shape) != tuple(target.shape):
                raise UnsupportedModelError(f"{what} weight {name} has shape {tuple(tensor.shape)} in the "
                                            f"checkpoint, the config says {tuple(target.shape)}")
            target.copy_(tensor)


def _find(get: Callable[[str], torch.Tensor | None], prefixes: tuple[str, ...], name: str) -> torch.Tensor | None:
    candidates = [name]
    for level in TOWER_LEVELS[1:]:
        if name.startswith(level):
            candidates.append(name.removeprefix(level))
        else:
            candidates.append(level + name)
    for prefix in prefixes:
        for candidate in candidates:
            tensor = get(prefix + candidate)
            if tensor is not None:
                return tensor
    return None


def hf_config(config: dict[str, Any]) -> Any:
    """The transformers config object of a config.json dict (its model_type's class)."""
    from transformers import AutoConfig

    config = dict(config)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def text_getter(get: Callable[..., Any], prefixes: tuple[str, ...], heads: tuple[str, ...] = ("lm_head.weight",)
                ) -> Callable[..., Any]:
    """A getter that serves a text model's `model.*` and `lm_head.weight` names (what rein's
    native text models ask for) from a vision-language checkpoint, whose text model sits under
    one of `prefixes` (e.g. transformers 5's `model.language_model.`, the older
    `language_model.model.`) and whose head under one of `heads`. The prefix is the first whose
    embedding table the checkpoint has."""
    prefix = next((p for p in prefixes if get(p + "embed_tokens.weight") is not None), prefixes[0])

    def lookup(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "lm_head.weight":
            for head in heads:
                tensor = get(head, *args, **kwargs)
                if tensor is not None:
                    return tensor
            return None
        if name.startswith("model."):
            name = prefix + name.removeprefix("model.")
        return get(name, *args, **kwargs)

    return lookup
