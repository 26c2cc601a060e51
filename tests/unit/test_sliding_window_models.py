"""Windowed models past their window: rein's greedy tokens equal Hugging Face's.

A Mistral-style model (every layer windowed), a Qwen2 with windows from `max_window_layers`
on, and a tiny Gemma 3 (five windowed layers to one global, two rope bases, sandwich norms),
all with an 8-token window and prompts up to 40 tokens, so most positions see only part of
their past. Each runs with continuous batching, chunked prefill (a 16-token step budget) and
a KV pool small enough to preempt. HF's own answers with the window removed differ, so
attention over the full context could not pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig
from unit_support import save_tiny_hf_model, windowed_copy

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams

WINDOW = 8
MAX_TOKENS = 10
LENGTHS = [3, 9, 17, 24, 33, 40]


def _prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def _gemma3(source: Path, target: Path) -> Path:
    """A random tiny Gemma 3 with the tiny llama's tokenizer (same vocabulary)."""
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              max_position_embeddings=512, query_pre_attn_scalar=16, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_tiny_hf_model(config, source, target, spread_norms=True)


def _hf(model_dir: Path, prompts: list[list[int]], window: bool = True) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if not window:
        model.config.sliding_window = 10**6
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _rein(model_dir: Path, prompts: list[list[int]], **config) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", **config))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=["mistral", "qwen2", "gemma3"])
def windowed(request, tiny_models, tmp_path_factory):
    target = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "mistral":
        model_dir = windowed_copy(tiny_models("mistral"), target, sliding_window=WINDOW)
    elif request.param == "qwen2":
        model_dir = windowed_copy(tiny_models("qwen2"), target, sliding_window=WINDOW, use_sliding_window=True,
                                   max_window_layers=1)
    else:
        model_dir = _gemma3(tiny_models("llama"), target)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = _prompts(vocab)
    return request.param, model_dir, prompts, _hf(model_dir, prompts)


def test_the_window_changes_hfs_answers(windowed):
    _, model_dir, prompts, expected = windowed
    assert _hf(model_dir, prompts, window=False) != expected


def test_greedy_past_the_window_matches_hf(windowed):
    arch, model_dir, prompts, expected = windowed
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32"))
    assert engine.spec.windowed_layers == {"mistral": 2, "qwen2": 1, "gemma3": 5}[arch]
    assert engine.runner.max_model_len > WINDOW     # no longer capped at the window
    assert _rein(model_dir, prompts) == expected


def test_chunked_prefill_and_preemption_past_the_window_match_hf(windowed):
    _, model_dir, prompts, expected = windowed
    per_token = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32")).spec.kv_bytes_per_token(torch.float32)
    assert _rein(model_dir, prompts, max_num_batched_tokens=16, kv_cache_memory=per_token * 16 * 8,
                 max_model_len=64) == expected
