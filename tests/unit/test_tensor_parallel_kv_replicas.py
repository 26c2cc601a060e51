"""Tensor parallelism above the KV-head count: the KV heads are replicated, as vLLM does.

With N ranks and fewer KV heads than N (N a multiple of them), each rank holds one KV head --
rank r the head r // (N / num_kv_heads) -- and its query heads are the ones that read that head.
Checked here:

- each rank's fused q/k/v projection gives the one-rank projection's outputs of its query
  heads and of its KV head's k and v (float weights, and weights quantized at load), without
  any process: a group that only says rank and size;
- the model over spawned gloo ranks (one thread each) computes the logits of one rank, step
  by step through the paged cache (tests/unit/test_tensor_parallel.py's steps): a Llama and a
  Gemma 3 with one KV head over two ranks; over four ranks those two and the tiny llama,
  qwen2 (q/k/v bias), qwen3 (per-head q/k norms) and OLMoE (q/k norms over all heads) with
  two KV heads;
- the whole engine, a Llama with one KV head over two ranks, generates one rank's greedy
  tokens (logprobs within 1e-4), each rank's cache holding the one head whole: the same pool
  from the same memory as one rank's;
- a size the KV heads cannot be replicated over evenly, or that does not divide the query
  heads, is refused before any rank starts.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_tensor_parallel import TOLERANCE, logits_of
from unit_support import save_tiny_hf_model

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.model.files import resolve_model
from rein.model.loader import load_model
from rein.model.parallel import DistributedGroup, tcp_init_method
from rein.model.parallel.layers import attention_heads, kv_replicas
from rein.model.spec import ModelSpec


def one_kv_head_llama(source: Path, target: Path) -> Path:
    """The tiny llama's shape with one KV head (four query heads), random weights."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source))
    config.num_key_value_heads = 1
    return save_tiny_hf_model(config, source, target)


def one_kv_head_gemma3(source: Path, target: Path) -> Path:
    """A tiny Gemma 3 with one KV head, as Gemma 3 270M has, windows and a vocabulary (2051)
    that does not split evenly."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=2051, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                              max_position_embeddings=512, query_pre_attn_scalar=16, bos_token_id=1,
                              eos_token_id=2, pad_token_id=0, initializer_range=0.2)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_tiny_hf_model(config, source, target, spread_norms=True)


@pytest.fixture(scope="module")
def cases(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-kv-models")
    built = {arch: tiny_models(arch) for arch in ("llama", "qwen2", "qwen3", "olmoe")}
    built["llama_kv1"] = one_kv_head_llama(tiny_models("llama"), root / "llama_kv1")
    built["gemma3_kv1"] = one_kv_head_gemma3(tiny_models("llama"), root / "gemma3_kv1")
    return built


# -- each rank's projection rows, without processes ------------------------------------------------


def load_rank(directory: Path, rank: int, world_size: int, quantization: str = "auto"):
    files = resolve_model(str(directory))
    spec = ModelSpec.from_dir(files.directory)
    group = SimpleNamespace(rank=rank, world_size=world_size)
    return load_model(files, spec, 64, torch.float32, torch.device("cpu"), group=group,
                      quantization=quantization), spec


@pytest.mark.parametrize(("name", "world_size", "quantization"), [
    ("llama_kv1", 2, "auto"), ("llama_kv1", 4, "auto"), ("llama", 4, "auto"), ("qwen2", 4, "auto"),
    ("llama", 4, "int8"),
])
def test_each_rank_projects_its_query_heads_and_its_kv_heads_copy(cases, name, world_size, quantization):
    whole, spec = load_rank(cases[name], 0, 1, quantization)
    replicas = kv_replicas(spec, world_size)
    assert replicas == world_size // spec.num_kv_heads > 1
    head_dim = spec.head_dim
    q_size, kv_size = spec.num_heads * head_dim, spec.num_kv_heads * head_dim
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = whole.layers[1].self_attn.qkv_proj(x)
        for rank in range(world_size):
            model, _ = load_rank(cases[name], rank, world_size, quantization)
            attention = model.layers[1].self_attn
            heads, kv_heads = attention_heads(spec, world_size)
            assert (attention.num_heads, attention.num_kv_heads) == (heads, kv_heads) == (spec.num_heads // world_size, 1)
            kv_head = rank // replicas
            # Grouped-query attention reads KV head q // (heads / kv_heads) for query head q: this
            # rank's query heads all read its KV head.
            assert {q // (spec.num_heads // spec.num_kv_heads) for q in range(rank * heads, (rank + 1) * heads)} \
                == {kv_head}
            got = attention.qkv_proj(x)
            q_rows = slice(rank * heads * head_dim, (rank + 1) * heads * head_dim)
            k_rows = slice(q_size + kv_head * head_dim, q_size + (kv_head + 1) * head_dim)
            v_rows = slice(q_size + kv_size + kv_head * head_dim, q_size + kv_size + (kv_head + 1) * head_dim)
            expected = torch.cat([want[:, q_rows], want[:, k_rows], want[:, v_rows]], dim=1)
            error = (got - expected).abs().max().item()
            assert error < 1e-5, f"rank {rank}: its q/k/v outputs are off one rank's heads by {error:.2e}"


# -- the model over spawned ranks ------------------------------------------------------------------

MODEL_RUNS = {2: ("llama_kv1", "gemma3_kv1"), 4: ("llama_kv1", "gemma3_kv1", "llama", "qwen2", "qwen3", "olmoe")}


def replicated_rank(rank: int, world_size: int, init_method: str, cases: dict[str, str], out: str) -> None:
    """One of `world_size` ranks: every case's logits, saved to `out`."""
    torch.set_num_threads(1)
    group = DistributedGroup(rank, world_size, init_method, timeout_s=120)
    try:
        results = {name: logits_of(Path(directory), group) for name, directory in cases.items()}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        group.close()


@pytest.fixture(scope="module")
def ranks_logits(cases, tmp_path_factory) -> dict[int, list[dict]]:
    """world size -> each rank's logits per case, from one spawn per world size."""
    context = multiprocessing.get_context("spawn")
    results = {}
    for world_size, names in MODEL_RUNS.items():
        out = tmp_path_factory.mktemp(f"tp-kv-out{world_size}")
        init_method = tcp_init_method()
        paths = {name: str(cases[name]) for name in names}
        ranks = [context.Process(target=replicated_rank, args=(rank, world_size, init_method, paths, str(out)))
                 for rank in range(world_size)]
        for process in ranks:
            process.start()
        try:
            for process in ranks:
                process.join(timeout=300)
                assert process.exitcode == 0, f"a rank ended with exit code {process.exitcode}"
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
        results[world_size] = [torch.load(out / f"rank{rank}.pt") for rank in range(world_size)]
    return results


@pytest.mark.parametrize(("world_size", "name"), [(size, name) for size, names in MODEL_RUNS.items()
                                                  for name in names])
def test_replicated_kv_heads_compute_the_logits_of_one_rank(cases, ranks_logits, world_size, name):
    spec = ModelSpec.from_dir(cases[name])
    assert world_size > spec.num_kv_heads
    want = logits_of(cases[name])
    first, *others = (logits[name] for logits in ranks_logits[world_size])
    assert [t.shape for t in first] == [t.shape for t in want] and want[0].shape[-1] == spec.vocab_size
    diff = max((got - ref).abs().max().item() for got, ref in zip(first, want, strict=True))
    assert diff < TOLERANCE, f"{name}: TP={world_size} logits differ from TP=1 by up to {diff:.2e}"
    for other in others:
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


# -- the engine ------------------------------------------------------------------------------------

KV_MEMORY_PER_RANK = 96 * 1024   # a rank caches the one KV head whole: one rank's memory, one rank's pool


def generate(model: str, tensor_parallel_size: int) -> tuple[dict, dict, LLMEngine]:
    engine = LLMEngine(EngineConfig(model=model, device="cpu", tensor_parallel_size=tensor_parallel_size,
                                    max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                                    kv_cache_memory=KV_MEMORY_PER_RANK))
    shared = list(range(100, 132))   # prefix-cached across the first two
    prompts = [shared + [7, 8], shared + [9], list(range(300, 360)), [11, 12, 13]]
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                               logprobs=2))
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                logprobs.setdefault(out.request_id, []).extend(out.logprobs or [])
    finally:
        engine.close()
    return tokens, logprobs, engine


def test_two_ranks_with_one_kv_head_generate_what_one_rank_does(cases):
    model = str(cases["llama_kv1"])
    one_tokens, one_logprobs, one = generate(model, 1)
    two_tokens, two_logprobs, two = generate(model, 2)
    assert two_tokens == one_tokens and len(one_tokens) == 4
    worst = 0.0
    for key, entries in one_logprobs.items():
        for a, b in zip(entries, two_logprobs[key], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            worst = max(worst, abs(a.logprob - b.logprob),
                        *(abs(p - q) for (_, p), (_, q) in zip(a.top, b.top, strict=True)))
    assert worst < 1e-4, f"logprobs differ by up to {worst:.2e}"
    # Each rank caches its copy of the one KV head: as many blocks from the same memory as one rank.
    assert two.runner.cache_spec.num_kv_heads == one.runner.cache_spec.num_kv_heads == 1
    assert two.pool.num_blocks == one.pool.num_blocks
    assert one.stats.prefix_cache_hits > 0 and two.stats.prefix_cache_hits == one.stats.prefix_cache_hits


def test_a_size_that_cannot_replicate_the_kv_heads_is_refused_before_any_rank_starts(tiny_models, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_models("llama")))
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim = 96, 6, 2, 16
    model = str(save_tiny_hf_model(config, tiny_models("llama"), tmp_path / "six-heads"))
    # Three ranks split the six query heads, but neither share out the two KV heads nor replicate
    # them evenly; four do not divide the query heads.
    for size, refusal in ((3, "neither divides nor is a multiple of the model's 2 KV heads"),
                          (4, "does not divide the model's 6 attention heads")):
        with pytest.raises(ValueError, match=f"tensor parallel size {size} {refusal}"):
            LLMEngine(EngineConfig(model=model, device="cpu", tensor_parallel_size=size))
    LLMEngine(EngineConfig(model=model, device="cpu", tensor_parallel_size=1, kv_cache_memory="1MiB",
                           max_model_len=64))   # the model itself loads
