"""Embedding requests in the engine, on tiny embedding models (rein make-tiny-model --embedding):
pooled vectors equal Hugging Face's (AutoModel's last hidden state, pooled and normalized),
alone, batched with generation requests, in chunked prefill, with the prefix cache, and cut
to fewer dimensions."""

from __future__ import annotations

import math

import pytest
import torch

from rein.engine import EngineConfig, EngineRequestError, LLMEngine, SamplingParams
from rein.model.pooling_config import PoolingParams, read_pooling_config

TOLERANCE = 1e-4
PROMPTS = [[11, 22, 33, 44, 55], list(range(100, 180)), [7], list(range(300, 337))]


def hf_embeddings(model_dir, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    """What sentence-transformers computes: AutoModel's last hidden state, pooled, L2-normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
            pooled = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
            vectors.append(torch.nn.functional.normalize(pooled, dim=-1))
    return vectors


def engine_for(model_dir, **overrides) -> LLMEngine:
    options = {"kv_cache_memory": "8MiB", "max_model_len": 512, "dtype": "float32"} | overrides
    return LLMEngine(EngineConfig(model=str(model_dir), **options))


def run(engine: LLMEngine) -> dict[str, dict]:
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "outputs": 0})
            r["tokens"].extend(out.new_token_ids)
            r["outputs"] += 1
            if out.finished:
                r["final"] = out
    return results


def assert_close(got: list[float], expected: torch.Tensor) -> None:
    assert len(got) == expected.shape[0]
    diff = (torch.tensor(got) - expected).abs().max().item()
    assert diff < TOLERANCE, f"max difference {diff}"


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_equal_hugging_face(tiny_models, pooling):
    model_dir = tiny_models("qwen3", embedding=pooling)
    assert read_pooling_config(model_dir).pooling_type == pooling
    expected = hf_embeddings(model_dir, PROMPTS, pooling)
    engine = engine_for(model_dir)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"e{i}", prompt, PoolingParams())
    results = run(engine)
    for i, vector in enumerate(expected):
        final = results[f"e{i}"]["final"]
        assert results[f"e{i}"]["outputs"] == 1   # one output: the vector
        assert final.finish_reason == "stop" and final.num_output_tokens == 0
        assert final.num_prompt_tokens == len(PROMPTS[i]) and final.new_token_ids == []
        assert math.isclose(sum(v * v for v in final.embedding), 1.0, rel_tol=1e-5)
        assert_close(final.embedding, vector)
    assert not engine.requests and engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_batch_with_generation_and_chunked_prefill(tiny_models, pooling):
    """Small token budget: prompts are prefilled in chunks across steps, next to decodes;
    the vectors are HF's and the generations are those of the engine alone."""
    model_dir = tiny_models("qwen3", embedding=pooling)
    expected = hf_embeddings(model_dir, PROMPTS, pooling)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine_for(model_dir)
    alone.add_request("g", [5, 6, 7, 8], greedy)
    alone_tokens = run(alone)["g"]["tokens"]

    engine = engine_for(model_dir, max_num_batched_tokens=16, block_size=16)
    engine.add_request("g", [5, 6, 7, 8], greedy)
    first = [t for out in engine.step() for t in out.new_token_ids]   # decoding when embeddings arrive
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"e{i}", prompt, PoolingParams())
    steps_before = engine.stats.steps
    results = run(engine)
    assert engine.stats.steps - steps_before >= sum(map(len, PROMPTS)) // 16   # really chunked
    assert first + results["g"]["tokens"] == alone_tokens
    for i, vector in enumerate(expected):
        assert_close(results[f"e{i}"]["final"].embedding, vector)


def test_last_token_pooling_with_the_prefix_cache(tiny_models):
    """A prompt whose leading blocks are cached is pooled from its computed last token."""
    model_dir = tiny_models("qwen3", embedding="last")
    prompt = list(range(200, 260))
    [expected] = hf_embeddings(model_dir, [prompt], "last")
    engine = engine_for(model_dir, block_size=16)
    engine.add_request("first", prompt, PoolingParams())
    first = run(engine)["first"]["final"]
    engine.add_request("again", prompt, PoolingParams())
    again = run(engine)["again"]["final"]
    assert again.num_cached_tokens == 48   # three of the four blocks; the last token is computed
    assert_close(first.embedding, expected)
    assert_close(again.embedding, expected)


def test_mean_pooling_skips_the_prefix_cache(tiny_models):
    model_dir = tiny_models("qwen3", embedding="mean")
    prompt = list(range(200, 260))
    [expected] = hf_embeddings(model_dir, [prompt], "mean")
    engine = engine_for(model_dir, block_size=16)
    engine.add_request("gen", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    run(engine)   # fills the cache with the prompt's blocks
    engine.add_request("mean", prompt, PoolingParams())
    final = run(engine)["mean"]["final"]
    assert final.num_cached_tokens == 0
    assert_close(final.embedding, expected)


def test_dimensions_cut_and_renormalize(tiny_models):
    model_dir = tiny_models("qwen3", embedding="last")
    engine = engine_for(model_dir)
    engine.add_request("full", PROMPTS[0], PoolingParams())
    engine.add_request("cut", PROMPTS[0], PoolingParams(dimensions=16))
    engine.add_request("raw", PROMPTS[0], PoolingParams(normalize=False))
    results = run(engine)
    full = torch.tensor(results["full"]["final"].embedding)
    cut = torch.tensor(results["cut"]["final"].embedding)
    raw = torch.tensor(results["raw"]["final"].embedding)
    assert cut.shape == (16,)
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:16], dim=0), atol=1e-6)
    assert torch.allclose(full, torch.nn.functional.normalize(raw, dim=0), atol=1e-6)
    assert raw.norm().item() > 1.5   # the hidden state, not normalized


def test_embedding_requests_refused_with_reasons(tiny_models):
    engine = engine_for(tiny_models("qwen3", embedding="last"), max_model_len=64)
    with pytest.raises(EngineRequestError, match="at most 64") as info:
        engine.add_request("big", PROMPTS[0], PoolingParams(dimensions=65))
    assert info.value.param == "dimensions"
    with pytest.raises(EngineRequestError, match="maximum context length is 64"):
        engine.add_request("long", list(range(65)), PoolingParams())
    # A model that does not declare Matryoshka support refuses dimensions (as vLLM).
    plain = engine_for(tiny_models("qwen3"))
    with pytest.raises(EngineRequestError, match="matryoshka"):
        plain.add_request("cut", PROMPTS[0], PoolingParams(dimensions=8))


def test_a_generation_model_embeds_with_the_default_pooling(tiny_models):
    """No sentence-transformers files: last token, normalized (vLLM's default for decoders)."""
    model_dir = tiny_models("qwen3")
    config = read_pooling_config(model_dir)
    assert (config.pooling_type, config.normalize, config.is_matryoshka) == ("last", True, False)
    [expected] = hf_embeddings(model_dir, [PROMPTS[1]], "last")
    engine = engine_for(model_dir)
    engine.add_request("e", PROMPTS[1], PoolingParams())
    assert_close(run(engine)["e"]["final"].embedding, expected)


def test_checkpoint_without_lm_head_serves_embeddings_only(tiny_models):
    """An untied arch saved as an embedding model has no lm_head: embeddings work, generation is refused."""
    model_dir = tiny_models("llama", embedding="last")
    engine = engine_for(model_dir)
    with pytest.raises(EngineRequestError, match="no lm_head"):
        engine.add_request("g", PROMPTS[0], SamplingParams(max_tokens=2))
    [expected] = hf_embeddings(model_dir, [PROMPTS[0]], "last")
    engine.add_request("e", PROMPTS[0], PoolingParams())
    assert_close(run(engine)["e"]["final"].embedding, expected)


def test_abort_an_embedding_request(tiny_models):
    engine = engine_for(tiny_models("qwen3", embedding="mean"), max_num_batched_tokens=16)
    engine.add_request("e", list(range(100, 180)), PoolingParams())
    engine.step()
    assert engine.abort("e")
    final = run(engine)["e"]["final"]
    assert final.finish_reason == "abort" and final.embedding is None
    assert engine.pool.num_free == engine.pool.num_blocks
