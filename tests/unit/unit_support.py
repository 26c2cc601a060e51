"""Helpers the unit test modules share (imported by name: pytest puts tests/unit on sys.path;
the shared fixtures are in conftest.py)."""

from __future__ import annotations

import random

from rein.engine import EngineConfig, LLMEngine


def make_engine(model_dir, **config) -> LLMEngine:
    """A CPU engine on `model_dir` (8 MiB of KV cache, 256 tokens of context unless `config` says)."""
    config.setdefault("kv_cache_memory", "8MiB")
    config.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **config))


def record_plans(engine: LLMEngine) -> list:
    """A list that gets every scheduler plan `engine` makes from now on (to see who was
    scheduled from where)."""
    plans = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        plans.append(plan)
        return plan

    engine.scheduler.schedule = recording
    return plans


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """`length` random token ids in [10, 2000), the same for the same `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def save_tiny_hf_model(config, tokenizer_source, target, spread_norms: bool = False):
    """A random-weight model transformers builds from `config` (seed 0), saved into `target` with
    the tokenizer files of `tokenizer_source` (a tiny model of the same vocabulary). With
    `spread_norms`, norm weights are drawn from [-0.5, 0.5], so Gemma's (1 + w) is not trivially 1."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    if spread_norms:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(-0.5, 0.5)
    model.save_pretrained(target)
    for file in tokenizer_source.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, target / file.name)
    return target


def windowed_copy(source, target, **changes):
    """A copy of the model folder `source` with config.json's window settings changed."""
    import json
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    config.pop("layer_types", None)   # derived again from the window settings
    (target / "config.json").write_text(json.dumps(config))
    return target
