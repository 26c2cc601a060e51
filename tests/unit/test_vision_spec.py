"""A vision model's spec from config.json, in transformers 5's layout (text_config nested) and the
released checkpoints' older one (text fields at the top, rope_scaling type mrope); the scheduler's
per-step encoder budget."""

from __future__ import annotations

import torch

from rein.engine.block_pool import BlockPool
from rein.engine.encoder_cache import EncoderCache
from rein.engine.multimodal import ImageItem, RequestImages
from rein.engine.request import Request, RequestStatus
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler
from rein.model.spec import ModelSpec

# Qwen2-VL-2B-Instruct's config.json as released (vision fields trimmed to what matters here).
RELEASED = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "bos_token_id": 151643, "eos_token_id": 151645,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 1536,
    "intermediate_size": 8960, "max_position_embeddings": 32768, "model_type": "qwen2_vl",
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "hidden_size": 1536,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}


def test_released_layout():
    spec = ModelSpec.from_config(RELEASED)
    assert (spec.family, spec.hidden_size, spec.num_layers, spec.num_kv_heads, spec.head_dim) == \
        ("qwen2_vl", 1536, 28, 2, 128)
    assert spec.mrope_section == (16, 24, 24) and spec.rope_scaling is None and spec.rope_theta == 1e6
    assert spec.attention_bias and spec.tie_word_embeddings and spec.sliding_window is None
    assert spec.vision_config["vision_config"]["embed_dim"] == 1280


def test_transformers_5_layout():
    text = {key: RELEASED[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_hidden_layers", "num_key_value_heads", "vocab_size",
                                           "rms_norm_eps", "max_position_embeddings")}
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
              "text_config": text, "vision_config": {}, "image_token_id": 151655, "tie_word_embeddings": False}
    spec = ModelSpec.from_config(config)
    assert (spec.family, spec.vocab_size, spec.mrope_section, spec.rope_theta) == \
        ("qwen2_5_vl", 151936, (16, 24, 24), 1e6)


def image_request(rid: str, key: str, text: int = 4, image: int = 6) -> Request:
    tokens = [1] * text + [9] * image + [1] * 2
    return Request(rid, tokens, SamplingParams(max_tokens=1),
                   images=RequestImages((ImageItem(text, image, key, {}),), tuple(tokens)))


def test_encoder_budget_holds_back_an_uncached_image():
    cache = EncoderCache(100)
    scheduler = Scheduler(BlockPool(64, 4), 8, 100, encoder_cache=cache, max_num_encoder_tokens=8)
    for rid, key in (("a", "ka"), ("b", "kb"), ("c", "ka")):
        scheduler.add(image_request(rid, key))
    plan = scheduler.schedule()
    # a's image takes 6 of 8 encoder tokens; b's (6 more) waits: its chunk stops before it; c shares a's image.
    assert [(s.request.request_id, s.start, s.end) for s in plan.scheduled] == \
        [("a", 0, 12), ("b", 0, 4), ("c", 0, 12)]
    cache.put("kb", torch.zeros(6, 4))   # encoded (cached) meanwhile: no budget needed
    b = plan.scheduled[1].request
    b.num_computed_tokens = 4
    scheduler.finish(plan.scheduled[0].request, RequestStatus.FINISHED_STOPPED)
    scheduler.finish(plan.scheduled[2].request, RequestStatus.FINISHED_STOPPED)
    assert [(s.request.request_id, s.start, s.end) for s in scheduler.schedule().scheduled] == [("b", 4, 12)]


def test_an_image_larger_than_the_budget_runs_alone():
    scheduler = Scheduler(BlockPool(64, 4), 8, 100, encoder_cache=EncoderCache(100), max_num_encoder_tokens=4)
    scheduler.add(image_request("big", "kbig", image=10))
    scheduler.add(image_request("next", "knext", image=2))
    plan = scheduler.schedule()
    assert [(s.request.request_id, s.start, s.end) for s in plan.scheduled] == [("big", 0, 16), ("next", 0, 4)]


def test_whole_chunk_models_resume_a_cache_hit_before_the_image():
    """A prefix-cache hit that ends inside an image is trimmed to the image's start for a model
    that computes an image in one chunk (Gemma 3); other models resume where the hit ends."""
    for whole, start in ((True, 0), (False, 8)):
        scheduler = Scheduler(BlockPool(64, 4, enable_caching=True), 8, 100, encoder_cache=EncoderCache(100),
                              image_tokens_whole_chunk=whole)
        first = image_request("a", "k", text=2, image=8)   # 12 tokens: the image at [2, 10)
        scheduler.add(first)
        scheduler.schedule()
        first.num_computed_tokens = 12
        scheduler.register_computed_blocks(first)
        scheduler.add(image_request("b", "k", text=2, image=8))
        [plan] = [s for s in scheduler.schedule().scheduled if s.request.request_id == "b"]
        assert (plan.start, plan.end) == (start, 12), whole
