"""A LoRA adapter's adapter_config.json read and checked, without torch.

Shared by the model side (rein.model.lora.adapters, which goes on to read the weights) and the
API, which checks an adapter named in REIN_LORA_MODULES or registered with
POST /v1/load_lora_adapter before any job runs under it: a missing directory, a config that is
not LoRA or asks for what rein does not run, a rank above --max-lora-rank, or another base model
are refused there with the same messages a worker would give.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"


class AdapterError(ValueError):
    """An adapter rein cannot serve as given; the message says what is wrong and what to change."""


def read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise AdapterError(f"adapter directory {directory} does not exist: give the directory PEFT's "
                           f"save_pretrained wrote ({CONFIG_FILE} + {SAFETENSORS_FILE})")
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{config_path} is missing: an adapter directory holds PEFT's {CONFIG_FILE} and "
                           f"{SAFETENSORS_FILE} (save it with PeftModel.save_pretrained)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_path} is not valid JSON ({exc}): save the adapter again") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path} is not a JSON object: save the adapter again")
    return config


def check_config(name: str, config: dict[str, Any]) -> None:
    """Refuse what PEFT's LoRA can do that rein's does not."""
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"adapter {name} is a PEFT {peft_type} adapter; rein serves LoRA adapters only")
    refusals = [
        (config.get("use_dora"), "uses DoRA (use_dora: true), which rein does not run: train with use_dora=False "
                                 "or merge the adapter into the base"),
        (config.get("fan_in_fan_out"), "has fan_in_fan_out: true (weights stored transposed, for GPT-2-style "
                                       "Conv1D layers), which rein's models do not have: train with "
                                       "fan_in_fan_out=False"),
        (config.get("bias", "none") not in ("none", None), f"trains biases (bias: {config.get('bias')!r}), which "
                                                           f"rein does not add: train with bias='none'"),
        (config.get("lora_bias"), "has LoRA biases (lora_bias: true), which rein does not add: train with "
                                  "lora_bias=False"),
        (config.get("modules_to_save"), f"replaces whole modules (modules_to_save: {config.get('modules_to_save')}"
                                        f"), which rein does not swap per request: train without modules_to_save "
                                        f"or merge the adapter into the base"),
        (config.get("target_parameters"), f"targets parameters (target_parameters: "
                                          f"{config.get('target_parameters')}, e.g. MoE experts), which rein does "
                                          f"not adapt: target the attention and dense MLP modules only"),
        (config.get("trainable_token_indices"), "trains token embeddings (trainable_token_indices), which rein "
                                                "does not adapt: train without them"),
        (config.get("layer_replication"), "replicates layers (layer_replication), which rein does not do: "
                                          "merge the adapter into the base"),
        (config.get("use_qalora"), "is a QA-LoRA adapter (use_qalora: true), which rein does not run"),
    ]
    for refused, reason in refusals:
        if refused:
            raise AdapterError(f"adapter {name} {reason}")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)) or config[key] <= 0:
            raise AdapterError(f"adapter {name}: {CONFIG_FILE} has no positive {key!r} ({config.get(key)!r}): "
                               f"save the adapter again with PEFT")


def check_base_model(name: str, recorded: str | None, expected: str | None) -> None:
    if not recorded or not expected:
        return
    if recorded == expected or last_component(recorded) == last_component(expected):
        return
    raise AdapterError(f"adapter {name} was trained on {recorded!r} (base_model_name_or_path in {CONFIG_FILE}), "
                       f"not on the served model {expected!r}: serve it with that base, or, if it is the same model "
                       f"under another name, give the request's base_model_name or turn the base check off")


def last_component(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()


def largest_rank(config: dict[str, Any]) -> int:
    """The largest rank any module of the adapter has: `r`, or a larger one in rank_pattern."""
    ranks = [config["r"], *(config.get("rank_pattern") or {}).values()]
    return int(max(rank for rank in ranks if isinstance(rank, (int, float))))


def check_largest_rank(name: str, config: dict[str, Any], max_rank: int) -> None:
    rank = largest_rank(config)
    if rank > max_rank:
        raise AdapterError(f"adapter {name} has rank {rank}, above the server's maximum LoRA rank {max_rank}: "
                           f"start the server with --max-lora-rank {rank} or more (REIN_MAX_LORA_RANK)")


def check_adapter_directory(path: str | Path, max_rank: int, expected_base: str | None,
                            check_base: bool = True) -> dict[str, Any]:
    """What can be checked of an adapter without its weights (AdapterError if anything is wrong);
    its config. `expected_base`: as load_peft_adapter's."""
    directory = Path(path)
    config = read_config(directory)
    check_config(directory.name, config)
    check_largest_rank(directory.name, config, max_rank)
    if check_base:
        check_base_model(directory.name, config.get("base_model_name_or_path"), expected_base)
    if not (directory / SAFETENSORS_FILE).is_file() and not (directory / BIN_FILE).is_file():
        raise AdapterError(f"{directory} has no {SAFETENSORS_FILE} (nor {BIN_FILE}): save the adapter with "
                           f"PeftModel.save_pretrained")
    return config
