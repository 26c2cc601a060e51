"""Windowed models with the windowed layers' own KV storage (rein.engine.window_blocks): the
engine gives Hugging Face's greedy tokens with chunked prefill, preemption, prefix-cache
hits and n > 1; the storage holds O(window) blocks for a long request and never more than
its bound; a Gemma-3-shaped model fits about six times the tokens in the same memory.

Models: a tiny Gemma 3 (five windowed layers to one full), a Qwen2 with one windowed layer of
two, a Mistral whose every layer is windowed, and a Gemma 2 through the Transformers backend
(soft-capped attention, one windowed layer of two); windows of 8-16 tokens on 4-token blocks,
prompts and outputs several windows long.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig
from unit_support import save_tiny_hf_model, windowed_copy

from rein.engine.config import EngineConfig
from rein.engine.cuda_graphs import DecodeGraphs
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.model.capacity import kv_capacity, windowed_pool_bound
from rein.model.implementation import spec_for
from rein.model.spec import ModelSpec

BLOCK = 4
SEQS = 4
BUDGET = 16           # tokens per step: prompts are prefilled in chunks
MAX_LEN = 128
MAX_TOKENS = 24
LENGTHS = [5, 30, 47, 64]
WINDOWS = {"gemma3": 8, "qwen2": 16, "mistral": 12, "gemma2": 8}


def _gemma(source: Path, target: Path, window: int, version: int) -> Path:
    """A random tiny Gemma 3 (native) or Gemma 2 (Transformers backend, soft caps) with the
    tiny llama's tokenizer (same vocabulary)."""
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, sliding_window=window, max_position_embeddings=512,
                  query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if version == 3:
        config = Gemma3TextConfig(num_hidden_layers=6, **common)
        config.architectures = ["Gemma3ForCausalLM"]
    else:
        config = Gemma2Config(num_hidden_layers=2, attn_logit_softcapping=1.0, final_logit_softcapping=5.0,
                              attn_implementation="eager", **common)
        config.architectures = ["Gemma2ForCausalLM"]
    return save_tiny_hf_model(config, source, target)


def _hf(model_dir: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    # Gemma 2's soft caps are applied by transformers' eager attention only.
    model_type = json.loads((model_dir / "config.json").read_text())["model_type"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation="eager" if model_type == "gemma2" else None).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def _memory(model_dir: Path, full_blocks: int) -> int:
    """KV memory for the windowed storage's bound plus `full_blocks` blocks of the full layers
    (a model whose every layer is windowed: the bound plus 4 blocks, all windowed)."""
    spec = spec_for(model_dir, "auto")
    window = max(w for w in spec.layer_windows if w is not None)
    per_layer_block = spec.kv_bytes_per_token(torch.float32) // spec.num_layers * BLOCK
    bound = windowed_pool_bound(window, BLOCK, SEQS, BUDGET)
    full_layers = spec.num_layers - spec.windowed_layers
    if not full_layers:
        return (bound + 4) * spec.num_layers * per_layer_block
    return full_blocks * full_layers * per_layer_block + bound * spec.windowed_layers * per_layer_block


def _engine(model_dir: Path, full_blocks: int = 40, **config) -> LLMEngine:
    settings = dict(model=str(model_dir), dtype="float32", block_size=BLOCK, max_num_seqs=SEQS,
                    max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN,
                    kv_cache_memory=_memory(model_dir, full_blocks))
    settings.update(config)
    engine = LLMEngine(EngineConfig(**settings))
    assert engine.windows is not None, "the windowed layers must have storage of their own"
    return engine


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[tuple[str, int], list[int]]:
    """Tokens by (request id, choice); checks the windowed storage after every step."""
    windows = engine.windows
    bound = windowed_pool_bound(windows.window, BLOCK, SEQS, BUDGET)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        assert windows.num_held <= bound
    assert windows.num_held == 0 and engine.pool.num_used == 0
    return tokens


@pytest.fixture(scope="module", params=list(WINDOWS))
def windowed(request, tiny_models, tmp_path_factory):
    arch, window = request.param, WINDOWS[request.param]
    target = tmp_path_factory.mktemp(arch) / "model"
    if arch.startswith("gemma"):
        model_dir = _gemma(tiny_models("llama"), target, window, version=int(arch[-1]))
    elif arch == "qwen2":
        model_dir = windowed_copy(tiny_models("qwen2"), target, sliding_window=window, use_sliding_window=True,
                                   max_window_layers=1)
    else:
        model_dir = windowed_copy(tiny_models("mistral"), target, sliding_window=window)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (n,), generator=generator).tolist() for n in LENGTHS]
    return arch, model_dir, prompts, _hf(model_dir, prompts)


def test_greedy_with_chunks_preemption_and_prefix_hits_matches_hf(windowed):
    arch, model_dir, prompts, expected = windowed
    engine = _engine(model_dir)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    got = _run(engine, prompts, greedy)
    assert [got[(str(i), 0)] for i in range(len(prompts))] == expected
    if arch != "mistral":   # every layer windowed: the block pool is block ids only, never short
        assert engine.stats.preemptions > 0
    assert 0 < engine.windows.peak_held <= windowed_pool_bound(WINDOWS[arch], BLOCK, SEQS, BUDGET)
    # The same prompt again, alone: its blocks are still cached, windowed data included.
    for _ in range(2):
        assert _run(engine, [prompts[2]], greedy)[("0", 0)] == expected[2]
    assert engine.stats.prefix_cache_hits >= (LENGTHS[2] - 1) // BLOCK * BLOCK


def test_choices_share_and_copy_windowed_blocks(windowed):
    _, model_dir, prompts, expected = windowed
    engine = _engine(model_dir, full_blocks=80)
    # 47 tokens: the forked choices each copy the partly filled last block.
    got = _run(engine, [prompts[2]], SamplingParams(n=3, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [got[("0", i)] for i in range(3)] == [expected[2]] * 3


def test_a_long_request_holds_its_window_not_its_length(windowed):
    arch, model_dir, prompts, _ = windowed
    engine = _engine(model_dir, enable_prefix_caching=False)
    max_tokens = MAX_LEN - LENGTHS[0]
    expected = _hf(model_dir, [prompts[0]], max_tokens)[0]
    engine.add_request("long", prompts[0], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    request = engine.requests["long"]
    tokens, most_blocks = [], 0
    per_request = -(-WINDOWS[arch] // BLOCK) + 1
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        most_blocks = max(most_blocks, len(request.block_ids))
        assert engine.windows.num_held <= per_request
    assert tokens == expected
    assert most_blocks == MAX_LEN // BLOCK and engine.windows.peak_held <= per_request
    assert engine.windows.num_held == 0


def test_static_decode_buffers_translate_the_windowed_tables(windowed):
    """The CUDA-graph path's buffers (run eagerly on CPU) give the eager tokens."""
    _, model_dir, prompts, _ = windowed
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=i) for i in range(len(prompts))]

    def run(engine: LLMEngine) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params[i])
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [tokens[str(i)] for i in range(len(prompts))]

    expected = run(_engine(model_dir))
    engine = _engine(model_dir)
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.caches, max_num_seqs=3, max_blocks_per_seq=MAX_LEN // BLOCK,
                          device=runner.device, capture=False, windowed=True)
    sizes: list[int] = []
    plain_run = graphs.run
    graphs.run = lambda input_ids, *args: (sizes.append(len(input_ids)), plain_run(input_ids, *args))[1]
    runner.decode_graphs = graphs
    assert run(engine) == expected
    assert sizes and max(sizes) <= 3


def test_a_gemma3_shape_fits_about_six_times_the_tokens(windowed):
    arch, model_dir, _, _ = windowed
    if arch != "gemma3":
        pytest.skip("the Gemma 3 layer pattern")
    spec = dataclasses.replace(ModelSpec.from_dir(model_dir), layer_windows=(64,) * 5 + (None,))
    memory, max_len = 64 * 2**20, 512
    before = kv_capacity(spec, memory, torch.float32, 16, max_len)   # every layer keeps every position
    after = kv_capacity(spec, memory, torch.float32, 16, max_len, max_num_seqs=8, max_num_batched_tokens=256)
    bound = windowed_pool_bound(64, 16, 8, 256)
    assert after.num_windowed_blocks == bound and after.window == 64
    assert after.total_bytes <= memory and before.total_bytes <= memory
    ratio = after.num_tokens / before.num_tokens
    assert 5.5 < ratio < 6, ratio   # 6x, less what the bound's windowed blocks take
    assert "full-attention layers" in after.describe() and "sliding-window layers (window 64)" in after.describe()
    # Too little memory for the bound: every layer keeps every position, as before.
    small = kv_capacity(spec, bound * before.bytes_per_block, torch.float32, 16, max_len, 8, 256)
    assert small.num_windowed_blocks == 0 and small == kv_capacity(spec, bound * before.bytes_per_block,
                                                                   torch.float32, 16, max_len)


def test_random_workload_on_windowed_storage_matches_the_full_storage(windowed):
    """Mixed sampling, arrivals over time and aborts: the same tokens as with every layer
    keeping every position (windowed storage off: too little memory for its bound)."""
    _, model_dir, _, _ = windowed
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        rng = random.Random(1)
        shared = [rng.randrange(10, vocab) for _ in range(20)]
        pending = [(f"r{i}", shared[:rng.randint(0, 20)] + [rng.randrange(10, vocab) for _ in range(rng.randint(1, 30))],
                    SamplingParams(max_tokens=rng.randint(4, 40), ignore_eos=True,
                                   **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})))
                   for i in range(12)]
        tokens: dict[str, list[int]] = {}
        step = 0
        while pending or engine.has_unfinished():
            if pending and step % 3 == 0:
                engine.add_request(*pending.pop(0))
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            step += 1
        return tokens

    engine = _engine(model_dir)
    got = run(engine)
    # 64 sequences: the bound outgrows a 64-block pool, so every layer keeps every position.
    per_block = spec_for(model_dir, "auto").kv_bytes_per_token(torch.float32) * BLOCK
    full = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", block_size=BLOCK, max_num_seqs=64,
                                  max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN,
                                  kv_cache_memory=64 * per_block))
    assert full.windows is None and not any(cache.windowed for cache in full.runner.caches)
    assert got == run(full)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_windowed_storage_gives_the_eager_tokens(windowed):
    _, model_dir, prompts, expected = windowed
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine = _engine(model_dir, device="cuda")
    graphs = engine.runner.decode_graphs
    if engine.spec.family == "transformers":   # the backend always runs eagerly
        assert graphs is None
        return
    assert graphs is not None and graphs.captured and graphs.windowed_slots is not None
    replays: list[int] = []
    plain_run = graphs.run
    graphs.run = lambda input_ids, *args: (replays.append(len(input_ids)), plain_run(input_ids, *args))[1]
    got = _run(engine, prompts, greedy)
    assert replays and [got[(str(i), 0)] for i in range(len(prompts))] == expected
