"""Gemma 3 with vision (tiny random weights: sliding-window layers, two rope bases, tied
embeddings): rein's processor, encoder and engine against transformers, whose prefill lets an
image's tokens attend to each other both ways. Greedy tokens / logprobs under chunked prefill,
prefix caching and preemption; that the bidirectional image attention is what makes them agree;
both checkpoint layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from vlm_support import (
    cases,
    chat,
    check_parity,
    encoder_matches_hf,
    engine,
    hf_inputs,
    hf_model,
    png,
    run,
)

from rein.core.images import open_image
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model
from rein.model.spec import ModelSpec
from rein.model.vision import gemma3_vision
from rein.model.vision.processor import load_vision_processor

FAMILY = "gemma3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_vision_model(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_model(model_dir)


def test_expansion_matches_transformers_processor(model_dir):
    hf = transformers.AutoProcessor.from_pretrained(str(model_dir))
    mine = load_vision_processor(model_dir)
    images = [open_image(png(1)), open_image(png(2, (30, 30)))]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image"},
                                             {"type": "text", "text": "and"}, {"type": "image"}]}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf(text=text, images=images, return_tensors="pt")
    got = mine.expand(text, images)
    assert got.token_ids == want["input_ids"][0].tolist()
    assert got.image_token_counts == [4, 4]
    # transformers marks exactly the image tokens as the bidirectional ones.
    assert want["token_type_ids"][0].tolist() == [int(t == mine.image_token_id) for t in got.token_ids]


def test_encoder_matches_transformers(model_dir):
    encoder_matches_hf(model_dir, FAMILY)


def test_spec_has_windows_and_two_ropes(model_dir):
    spec = ModelSpec.from_dir(model_dir)
    assert spec.family == "gemma3_vision" and spec.layer_windows == (8, 8, None)
    assert spec.local_rope_theta == 10_000.0 and spec.rope_theta == 1_000_000.0 and spec.tie_word_embeddings


@pytest.mark.parametrize("setting", ["plain", "chunked", "preempt", "no_encoder_cache"])
def test_greedy_matches_transformers(model_dir, reference, setting):
    eng = check_parity(model_dir, reference, FAMILY, setting)
    assert eng.runner.model.image_tokens_whole_chunk


def test_bidirectional_image_attention_is_needed(model_dir, reference, monkeypatch):
    """transformers' logits differ with and without the image mask, and rein with its image
    blocks turned off misses transformers' logprobs: the parity tests can fail on it."""
    eng = engine(model_dir)
    requests = cases(eng.vision_processor, FAMILY)
    ids, images = requests["several"]
    inputs = hf_inputs(eng.vision_processor, FAMILY, ids, images)
    with torch.no_grad():
        both_ways = reference(**inputs).logits[0, -1]
        inputs.pop("token_type_ids")
        causal = reference(**inputs).logits[0, -1]
    assert (both_ways - causal).abs().max() > 1e-2
    want = torch.log_softmax(both_ways, -1)
    monkeypatch.setattr(gemma3_vision, "find_image_blocks", lambda *args: None)
    off = engine(model_dir)
    _, logprobs = run(off, {"several": (ids, images)}, SamplingParams(max_tokens=1, temperature=0, logprobs=0,
                                                                      ignore_eos=True))
    assert abs(logprobs["several"][0] - want.max().item()) > 1e-4


def test_image_block_attention_against_a_dense_mask():
    """The torch path alone: a step with a decode row and two prefill chunks (one with two image
    blocks, one text only), over a tiny paged cache, against attention with the mask spelled out."""
    from rein.model.attention import AttentionMetadata, LayerCache, paged_attention

    torch.manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    k_cache = torch.zeros(16, block, kv_heads, dim)
    v_cache = torch.zeros(16, block, kv_heads, dim)
    cache = LayerCache(k_cache, v_cache)
    image = 7
    # Request A: 3 cached tokens, then a chunk of 14: text x6, image x3, text, image x2, text x2
    # (with the window of 4, the first image row's window starts inside the chunk).
    a_ids = [1, 2, 3, 4, 5, 6, image, image, image, 2, image, image, 3, 4]
    b_ids = [5, 6, 8, 9]   # request B: a text chunk of 4, nothing cached
    a_ctx, b_ctx = 3 + len(a_ids), len(b_ids)
    a_table, b_table, d_table = [0, 1, 2, 5, 6], [3], [4]
    # The decode row: a request with 2 cached tokens in block 4.
    k_prefix = torch.randn(3, kv_heads, dim)
    v_prefix = torch.randn(3, kv_heads, dim)
    k_cache[0, :3], v_cache[0, :3] = k_prefix, v_prefix
    k_cache[4, :2], v_cache[4, :2] = torch.randn(2, kv_heads, dim), torch.randn(2, kv_heads, dim)
    tokens = 1 + len(a_ids) + len(b_ids)
    q, k, v = torch.randn(tokens, heads, dim), torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    slots = [4 * block + 2] + [a_table[p // block] * block + p % block for p in range(3, a_ctx)] + \
        [b_table[p // block] * block + p % block for p in range(b_ctx)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=1,
        decode_block_tables=torch.tensor([d_table]), decode_context_lens=torch.tensor([3]), decode_groups=None,
        prefill_block_tables=torch.tensor([a_table, b_table + [0] * 4]),
        prefill_cu_seqlens_q=torch.tensor([0, len(a_ids), len(a_ids) + len(b_ids)]),
        prefill_context_lens=torch.tensor([a_ctx, b_ctx]))
    input_ids = torch.tensor([0] + a_ids + b_ids)
    scale = dim ** -0.5
    for window in (None, 4):
        causal = paged_attention(q, k, v, cache, meta, scale, window=window)
        blocks = gemma3_vision.find_image_blocks(input_ids, meta, image)
        assert [r[0] for r in blocks.requests] == [0]   # request B has no image
        got = gemma3_vision.image_block_attention(causal.clone(), q, cache, meta, scale, window, blocks)
        # Request A by hand: keys = its prefix + its chunk, mask = causal | same block, & window.
        keys = torch.cat([k_prefix, k[1:1 + len(a_ids)]]).repeat_interleave(heads // kv_heads, 1)
        values = torch.cat([v_prefix, v[1:1 + len(a_ids)]]).repeat_interleave(heads // kv_heads, 1)
        block_of = [-1] * 9 + [0, 0, 0, -1, 1, 1, -1, -1]
        want = torch.empty(len(a_ids), heads, dim)
        for row in range(len(a_ids)):
            pos = 3 + row
            allowed = torch.tensor([kp <= pos or (block_of[pos] >= 0 and block_of[kp] == block_of[pos])
                                    for kp in range(a_ctx)])
            if window is not None:
                allowed &= torch.arange(a_ctx) > pos - window
            scores = torch.einsum("hd,khd->hk", q[1 + row], keys) * scale
            scores[:, ~allowed] = float("-inf")
            want[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), values)
        assert torch.allclose(got[1:1 + len(a_ids)], want, atol=1e-5)
        # Rows outside request A keep the kernels' causal output.
        assert torch.equal(got[0], causal[0]) and torch.equal(got[1 + len(a_ids):], causal[1 + len(a_ids):])
        # and request A's text rows before its first image are causal too.
        assert torch.allclose(got[1], causal[1], atol=1e-6)


def test_legacy_layout(tmp_path, reference):
    old = tiny_vision_model(tmp_path / "old", FAMILY, legacy_layout=True)
    image = png(7)
    results = []
    for path in (tmp_path / "new", old):
        if path.name == "new":
            tiny_vision_model(path, FAMILY)
        eng = engine(path)
        ids = eng.vision_processor.expand(chat("<start_of_image>Hi"), [open_image(image)]).token_ids
        results.append(run(eng, {"r": (ids, [image])}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                                      logprobs=0)))
    assert results[0][0] == results[1][0]
    assert np.allclose(results[0][1]["r"], results[1][1]["r"], atol=1e-6)


def test_image_longer_than_a_step_refused(model_dir):
    from rein.core.images import ImageInput
    from rein.engine.errors import EngineRequestError

    eng = engine(model_dir, max_num_batched_tokens=3)   # an image is 4 tokens, computed in one step
    ids = eng.vision_processor.expand(chat("<start_of_image>Hi"), [open_image(png(1))]).token_ids
    with pytest.raises(EngineRequestError, match="in one step"):
        eng.add_request("r", ids, SamplingParams(max_tokens=2), images=[ImageInput.of(png(1))])


@pytest.mark.parametrize("setting", ["plain", "chunked"])
def test_images_longer_than_the_window(tmp_path, setting, monkeypatch):
    """56-pixel images: 16 tokens each, twice the sliding window (8), so on the windowed layers an
    image token sees its block's later tokens but not its earlier ones beyond the window."""
    import vlm_support

    from rein.fixtures.tiny_vlm import make_tiny_vlm

    model_dir = make_tiny_vlm(tmp_path / "wide", FAMILY, image_size=56)
    assert ModelSpec.from_dir(model_dir).layer_windows[0] == 8
    monkeypatch.setitem(vlm_support.SETTINGS, "chunked",
                        {"max_num_batched_tokens": 24, "max_num_encoder_tokens": 8, "block_size": 4})
    check_parity(model_dir, hf_model(model_dir), FAMILY, setting)
