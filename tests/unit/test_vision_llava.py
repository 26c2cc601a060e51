"""LLaVA (tiny random weights, CLIP or SigLIP tower): rein's processor, encoder and engine against
transformers: the prompt's expansion, the image features, and greedy tokens / logprobs under
chunked prefill, prefix caching and preemption, in both checkpoint layouts."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from vlm_support import chat, check_parity, encoder_matches_hf, engine, hf_model, png, run

from rein.core.images import open_image
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model
from rein.model.spec import ModelSpec, UnsupportedModelError
from rein.model.vision.processor import load_vision_processor

FAMILY = "llava"


@pytest.fixture(scope="module", params=["llava", "llava_siglip"])
def variant(request):
    """LLaVA-1.5's shape (CLIP, CLS dropped, layer -2), and a SigLIP tower with the "full"
    strategy and layers -2 and -1 concatenated."""
    return request.param


@pytest.fixture(scope="module")
def model_dir(variant, tmp_path_factory):
    return tiny_vision_model(tmp_path_factory.mktemp(variant), variant)


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_model(model_dir)


def test_expansion_matches_transformers_processor(model_dir):
    hf = transformers.AutoProcessor.from_pretrained(str(model_dir))
    mine = load_vision_processor(model_dir)
    images = [open_image(png(1)), open_image(png(2, (30, 30)))]
    messages = [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image"},
                                             {"type": "text", "text": " and\n"}, {"type": "image"}]}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf(text=text, images=images, return_tensors="pt")
    got = mine.expand(text, images)
    assert got.token_ids == want["input_ids"][0].tolist()
    assert got.image_token_counts == [16, 16]   # 4 x 4 patches (CLIP's CLS dropped)
    assert (want["pixel_values"][1:] == mine.pixel_inputs(images[1])["pixel_values"]).all()


def test_encoder_matches_transformers(model_dir):
    encoder_matches_hf(model_dir, FAMILY)


@pytest.mark.parametrize("setting", ["plain", "chunked", "preempt", "no_encoder_cache"])
def test_greedy_matches_transformers(model_dir, reference, setting):
    check_parity(model_dir, reference, FAMILY, setting)


def test_legacy_layout_and_prefix_cache(tmp_path, reference, variant):
    old = tiny_vision_model(tmp_path / "old", variant, legacy_layout=True)
    eng = engine(old, block_size=4)
    ids = eng.vision_processor.expand(chat("<image>Describe it."), [open_image(png(7))]).token_ids
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first, _ = run(eng, {"a": (ids, [png(7)])}, params)
    again, _ = run(eng, {"b": (ids, [png(7)])}, params)
    assert eng.encoder_cache.encoded_images == 1 and eng.stats.prefix_cache_hits > 0
    other, _ = run(eng, {"c": (ids, [png(8)])}, params)   # the same tokens, another image
    assert first["a"] == again["b"]
    from vlm_support import hf_generate

    for rid, image, tokens in (("a", png(7), first), ("c", png(8), other)):
        want, _ = hf_generate(reference, eng.vision_processor, FAMILY, ids, [image], 6)
        assert tokens[rid] == want


def test_any_resolution_llava_refused(model_dir, tmp_path):
    import json
    import shutil

    for model_type, architecture in (("llava_next", "LlavaNextForConditionalGeneration"),
                                     ("llava_onevision", "LlavaOnevisionForConditionalGeneration")):
        copy = tmp_path / model_type
        shutil.copytree(model_dir, copy)
        config = json.loads((copy / "config.json").read_text())
        config.update(model_type=model_type, architectures=[architecture])
        (copy / "config.json").write_text(json.dumps(config))
        with pytest.raises(UnsupportedModelError, match="any-resolution"):
            load_vision_processor(copy)
        from rein.model.implementation import spec_for

        with pytest.raises(UnsupportedModelError, match="any-resolution tiling"):   # what the engine says
            spec_for(copy, "auto")


def test_spec_is_the_text_model(model_dir):
    spec = ModelSpec.from_dir(model_dir)
    assert (spec.family, spec.architecture) == ("llava", "LlavaForConditionalGeneration")
    assert spec.hidden_size == 64 and not spec.tie_word_embeddings and spec.vision_config["model_type"] == "llava"
    assert np.isclose(spec.attention_scale, 16 ** -0.5)


def test_other_towers_refused(model_dir, tmp_path):
    import json
    import shutil

    copy = tmp_path / "pixtral"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["vision_config"] = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 28, "patch_size": 7}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'pixtral' vision tower"):
        ModelSpec.from_dir(copy)
