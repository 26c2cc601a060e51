"""Mixture-of-experts models natively (rein.model.architectures.moe, moe_family): the router and the
grouped experts against transformers' and a per-token reference, the MoE fields of ModelSpec,
and whole tiny Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE models whose greedy tokens and logits
equal Hugging Face's through the engine, with prefix caching and preemption."""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_model import MOE_ARCHS, model_summary
from rein.model.architectures.moe import SparseMoeBlock, grouped_experts, route
from rein.model.spec import ModelSpec, UnsupportedModelError

MAX_TOKENS = 10
# float32 end to end; the differences are the order of additions (oneDNN's matmuls, C kernels).
LOGIT_ATOL = 1e-4


def small_config(cls: str, **extra):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, num_experts_per_tok=2)
    return getattr(transformers, cls)(**(common | extra))


# -- the router and the experts ------------------------------------------------------------

@pytest.mark.parametrize("cls, router, norm", [
    ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter", True),
    ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe:Qwen3MoeTopKRouter", False),
    ("MixtralConfig", "mixtral.modeling_mixtral:MixtralTopKRouter", True),   # renormalises always
])
def test_route_matches_transformers_routers(cls, router, norm):
    import importlib

    module, _, name = router.partition(":")
    config = small_config(cls, num_experts=6, norm_topk_prob=norm)
    hf = getattr(importlib.import_module(f"transformers.models.{module}"), name)(config)
    torch.nn.init.normal_(hf.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(1))
    _, want_weights, want_ids = hf(x)
    weights, ids = route(torch.nn.functional.linear(x, hf.weight), 2, norm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights.float(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(7)) == norm


def per_token_experts(x, gate_up_proj, down_proj, weights, ids):
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate, up = (gate_up_proj[ids[t, k]] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (down_proj[ids[t, k]] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (13, 8, 2), (6, 3, 3), (20, 16, 4)])
def test_grouped_experts_equal_a_per_token_reference(tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 24, generator=gen)
    gate_up = torch.randn(experts, 2 * 20, 24, generator=gen) * 0.2
    down = torch.randn(experts, 24, 20, generator=gen) * 0.2
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=False)
    got = grouped_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, per_token_experts(x, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)


def test_sparse_block_with_a_shared_expert_matches_transformers():
    """Qwen2-MoE's block: routed experts (not renormalised) plus the sigmoid-gated shared expert."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = small_config("Qwen2MoeConfig", num_experts=4, moe_intermediate_size=16,
                          shared_expert_intermediate_size=40, norm_topk_prob=False)
    torch.manual_seed(0)
    hf = Qwen2MoeSparseMoeBlock(config)
    for param in hf.parameters():
        torch.nn.init.normal_(param, std=0.3)
    spec = ModelSpec.from_config(config.to_dict() | {"architectures": ["Qwen2MoeForCausalLM"]})
    block = SparseMoeBlock(spec)
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        block.gate_up_proj.copy_(hf.experts.gate_up_proj)
        block.down_proj.copy_(hf.experts.down_proj)
        shared = hf.shared_expert
        block.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        block.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
        block.shared_expert_gate.weight.copy_(hf.shared_expert_gate.weight)
        x = torch.randn(9, 32)
        torch.testing.assert_close(block(x), hf(x[None])[0], rtol=1e-5, atol=1e-5)


# -- ModelSpec -------------------------------------------------------------------------------

def spec_of(cls: str, architecture: str, **extra) -> ModelSpec:
    return ModelSpec.from_config(small_config(cls, **extra).to_dict() | {"architectures": [architecture]})


def test_spec_reads_which_layers_are_sparse():
    spec = spec_of("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_hidden_layers=6, num_experts=8,
                   moe_intermediate_size=16, decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    assert spec.family == "qwen3_moe" and spec.qk_norm and spec.is_moe
    assert spec.sparse_layers == (False, True, False, False, False, True)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (8, 2, 16)
    assert spec.norm_topk_prob and spec.shared_expert_intermediate_size == 0


def test_spec_reads_each_familys_router_and_experts():
    mixtral = spec_of("MixtralConfig", "MixtralForCausalLM", num_local_experts=4)
    assert mixtral.num_experts == 4 and mixtral.norm_topk_prob   # Mixtral always renormalises
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 48
    assert mixtral.sparse_layers == (True, True) and not mixtral.qk_norm
    qwen2 = spec_of("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, moe_intermediate_size=16,
                    shared_expert_intermediate_size=40)
    assert qwen2.attention_bias and not qwen2.norm_topk_prob   # Qwen2-MoE's qkv_bias
    assert qwen2.shared_expert_intermediate_size == 40
    olmoe = spec_of("OlmoeConfig", "OlmoeForCausalLM", num_experts=4)
    assert olmoe.qk_norm and olmoe.num_experts == 4 and not olmoe.norm_topk_prob
    # A released Qwen config spells it num_experts, transformers 5 num_local_experts: both read.
    config = small_config("Qwen3MoeConfig", num_experts=4).to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    config["num_experts"] = config.pop("num_local_experts")
    assert ModelSpec.from_config(config).num_experts == 4
    dense = spec_of("Qwen3Config", "Qwen3ForCausalLM")
    assert not dense.is_moe and dense.num_experts == 0


def test_spec_refuses_what_the_native_models_lack():
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        spec_of("OlmoeConfig", "OlmoeForCausalLM", clip_qkv=8.0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_num_parameters_counts_the_experts(tiny_models, arch):
    model_dir = tiny_models(arch)
    assert ModelSpec.from_dir(model_dir).num_parameters() == model_summary(model_dir)["parameters"]


def test_a_checkpoint_with_transformers_in_memory_names_loads_the_same(tiny_models, tmp_path):
    """Saved from a transformers 5 model's state_dict (safetensors' save_model does that):
    experts already stacked as mlp.experts.gate_up_proj / down_proj, Mixtral's block named mlp."""
    import shutil

    from safetensors.torch import save_file

    from rein.model.files import resolve_model
    from rein.model.loader import load_model

    model_dir = tiny_models("mixtral")
    state = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(tmp_path / "model.safetensors"))

    def loaded(directory):
        files = resolve_model(directory)
        model = load_model(files, ModelSpec.from_dir(files.directory), 64, torch.float32, torch.device("cpu"))
        return {name: tensor.to_dense() if tensor.is_mkldnn else tensor for name, tensor in model.state_dict().items()}

    want, got = loaded(model_dir), loaded(tmp_path)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


# -- whole models through the engine ---------------------------------------------------------

def make_prompts(vocab_size: int) -> list[list[int]]:
    """Mixed lengths; the last two share a 20-token prefix (a whole cached block) with the 24-token one."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(n)] for n in (1, 3, 7, 16, 17, 24, 31, 40)]
    prompts += [prompts[5][:20] + [rng.randrange(10, vocab_size) for _ in range(n)] for n in (5, 12)]
    return prompts


def hf_reference(model_dir, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations from generate(), and the logits of a forward over each whole
    sequence (prompt + continuation) at the positions that predicted the continuation."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, logits = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                       min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
            tokens.append(generated[0, len(prompt):].tolist())
            logits.append(model(generated[:, :-1]).logits[0, len(prompt) - 1:])
    return tokens, logits


def run_engine(engine: LLMEngine, prompts: list[list[int]], arrivals: list[int]):
    """Greedy tokens of each prompt (prompt i added before step arrivals[i]), and each sampled
    logits row keyed by (prompt, index of the token it predicts)."""
    logits: dict[tuple[int, int], torch.Tensor] = {}
    execute = engine.runner.execute

    def spy(scheduled):
        result = execute(scheduled)
        ends = {id(s.request): s.end for s in scheduled if s.samples}
        for row, request in zip(result.logits, result.sampling, strict=True):
            logits[int(request.request_id), ends[id(request)]] = row.clone()
        return result

    engine.runner.execute = spy
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
        assert step < 10_000
    return [tokens[str(i)] for i in range(len(prompts))], logits


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_case(request, tiny_models):
    model_dir = tiny_models(request.param)
    prompts = make_prompts(ModelSpec.from_dir(model_dir).vocab_size)
    return request.param, model_dir, prompts, *hf_reference(model_dir, prompts)


def max_logit_error(got: dict[tuple[int, int], torch.Tensor], prompts, expected_logits) -> float:
    """Largest |rein - HF| over every sampled row (a preempted request's recomputed rows overwrite its first ones)."""
    worst = 0.0
    for (i, end), row in got.items():
        worst = max(worst, (row - expected_logits[i][end - len(prompts[i])]).abs().max().item())
    return worst


def test_greedy_and_logits_match_hf_with_prefix_caching(moe_case):
    arch, model_dir, prompts, expected, expected_logits = moe_case
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory="16MiB"))
    assert engine.config.enable_prefix_caching
    # The prompts sharing a prefix come after the one they share it with has been prefilled.
    got, logits = run_engine(engine, prompts, arrivals=[0, 0, 0, 1, 1, 2, 4, 4, 6, 7])
    assert got == expected, f"{arch}: engine greedy differs from HF generate"
    assert engine.stats.prefix_cache_hits >= 16, "the shared prefix must come from the prefix cache"
    assert len(logits) == len(prompts) * MAX_TOKENS
    error = max_logit_error(logits, prompts, expected_logits)
    assert error < LOGIT_ATOL, f"{arch}: max logit error {error:.2e}"
    assert engine.pool.num_free == engine.pool.num_blocks


def test_preemption_matches_hf(moe_case):
    arch, model_dir, prompts, expected, expected_logits = moe_case
    spec = ModelSpec.from_dir(model_dir)
    block_bytes = spec.kv_bytes_per_token(torch.float32) * 16
    # 8 blocks = 128 tokens for 10 requests needing ~300 in all: preemption is certain.
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_memory=8 * block_bytes, max_model_len=128))
    got, logits = run_engine(engine, prompts, arrivals=[0] * len(prompts))
    assert engine.stats.preemptions > 0, "the tiny pool must force preemption"
    assert got == expected, f"{arch}: preemption and recompute changed greedy output"
    error = max_logit_error(logits, prompts, expected_logits)
    assert error < LOGIT_ATOL, f"{arch}: max logit error {error:.2e}"
    assert engine.pool.num_free == engine.pool.num_blocks
