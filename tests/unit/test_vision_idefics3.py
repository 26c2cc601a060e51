"""Idefics3 and SmolVLM (tiny random weights; images split into tiles): rein's processor, encoder
and engine against transformers: the expansion with its tile markers (and without splitting at
detail "low"), the image spans, the image features, and greedy tokens / logprobs under chunked
prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest
import transformers
from vlm_support import chat, check_parity, encoder_matches_hf, engine, hf_model, png, run

from rein.core.images import ImageInput, open_image
from rein.engine.errors import EngineRequestError
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model
from rein.model.vision.processor import load_vision_processor


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, family):
    return tiny_vision_model(tmp_path_factory.mktemp(family), family)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_model(model_dir)


@pytest.mark.parametrize("split", [True, False])
def test_expansion_matches_transformers_processor(model_dir, split):
    hf = transformers.AutoProcessor.from_pretrained(str(model_dir))
    mine = load_vision_processor(model_dir)
    images = [open_image(png(1)), open_image(png(2, (30, 30))), open_image(png(3, (70, 20)))]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image"},
                                             {"type": "text", "text": " and\n"}, {"type": "image"},
                                             {"type": "image"}, {"type": "text", "text": "!"}]}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf(text=text, images=images, return_tensors="pt", do_image_splitting=split)["input_ids"][0].tolist()
    got = mine.expand(text, images, None if split else ["low"] * 3)
    assert got.token_ids == want
    # Each image's span: its tiles (marker, tile tag, 4 tokens), newlines, the global tile (7 tokens).
    assert got.image_token_counts == ([33, 33, 20] if split else [7, 7, 7])
    spans = mine.image_spans(got.token_ids)
    assert [length for _, length in spans] == got.image_token_counts
    fake = mine.fake_token_id
    assert all(got.token_ids[o] == fake and got.token_ids[o + n - 1] == fake for o, n in spans)


def test_encoder_matches_transformers(model_dir, family):
    encoder_matches_hf(model_dir, family)


@pytest.mark.parametrize("setting", ["plain", "chunked", "preempt", "no_encoder_cache"])
def test_greedy_matches_transformers(model_dir, reference, family, setting):
    check_parity(model_dir, reference, family, setting)


def test_low_detail_and_encoder_cache(model_dir, reference, family):
    eng = engine(model_dir, block_size=4)
    vp = eng.vision_processor
    image = png(9, (60, 40))
    low = vp.expand(chat("<image>Caption?"), [open_image(image)], ["low"]).token_ids
    tokens, _ = run_low(eng, low, image)
    want, _ = _hf_low(reference, vp, low, image)
    assert tokens == want
    # The same image at "auto" is another encoder-cache entry (its tiles differ).
    auto = vp.expand(chat("<image>Caption?"), [open_image(image)]).token_ids
    assert len(auto) > len(low)
    run(eng, {"auto": (auto, [image])}, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert eng.encoder_cache.encoded_images == 2
    # An "auto" expansion sent with a "low" image: the engine refuses it.
    with pytest.raises(EngineRequestError, match="detail"):
        eng.add_request("bad", auto, SamplingParams(max_tokens=2), images=[ImageInput.of(image, "low")])


def run_low(eng, ids, image):
    eng.add_request("low", ids, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                    images=[ImageInput.of(image, "low")])
    tokens = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
    return tokens, None


def _hf_low(reference, vp, ids, image):
    import torch

    pixels = vp.pixel_inputs(open_image(image), "low")
    input_ids = torch.tensor([ids])
    out = reference.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             pixel_values=pixels["pixel_values"].unsqueeze(0),
                             pixel_attention_mask=pixels["pixel_attention_mask"].unsqueeze(0),
                             max_new_tokens=6, do_sample=False)
    return out[0, len(ids):].tolist(), None


def test_stray_image_tokens_refused(model_dir):
    eng = engine(model_dir)
    vp = eng.vision_processor
    ids = vp.expand(chat("<image>Hi"), [open_image(png(1))]).token_ids
    stray = ids[:3] + [vp.image_token_id] * 2 + ids[3:]   # image tokens outside any image's markers
    with pytest.raises(EngineRequestError, match="2 image"):
        eng.add_request("s", stray, SamplingParams(max_tokens=2), images=[ImageInput.of(png(1))])


def test_counts_agree_with_the_encoder_inputs(model_dir):
    """count_tokens (from the image's size) and tokens_of (from its preprocessed tiles) agree,
    at every detail, over shapes from tall to wide."""
    vp = load_vision_processor(model_dir)
    for size in ((5, 90), (28, 28), (29, 57), (60, 40), (200, 30), (90, 91)):
        image = open_image(png(1, size))
        for detail in ("auto", "low", "high"):
            assert vp.count_tokens(image, detail) == vp.tokens_of(vp.pixel_inputs(image, detail)), (size, detail)


def test_encoder_pads_tiles_of_different_sizes(model_dir, family):
    """Images whose tiles differ in size encode together as each alone (padding masked off)."""
    import torch

    eng = engine(model_dir)
    model, vp = eng.runner.model, eng.vision_processor
    a = vp.pixel_inputs(open_image(png(1)))
    b = vp.pixel_inputs(open_image(png(2, (30, 30))))
    # b's tiles cut to 21 x 14 pixels (3 x 2 patches), as a smaller tile size would give them.
    b = dict(b, pixel_values=b["pixel_values"][..., :21, :14].contiguous(),
             pixel_attention_mask=b["pixel_attention_mask"][..., :21, :14].contiguous())
    with torch.no_grad():
        together = model.encoder([a, b])
        alone = [model.encoder([a])[0], model.encoder([dict(b, pixel_values=torch.nn.functional.pad(
            b["pixel_values"], (0, 14, 0, 7)), pixel_attention_mask=torch.nn.functional.pad(
            b["pixel_attention_mask"], (0, 14, 0, 7)))])[0]]
    for got, want in zip(together, alone, strict=True):
        assert torch.allclose(got, want, atol=1e-5)
