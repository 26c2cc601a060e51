"""rein.LLM with images on LLaVA, Idefics3 and Gemma 3 (tiny random weights), end to end against
transformers' own pipeline: chat messages with image_url data-URL parts through rein.LLM.chat, and
vLLM's {"prompt", "multi_modal_data"} through LLM.generate, give the greedy tokens that
transformers' AutoProcessor + generate() give for the same chat and images."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
import transformers

from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model


def picture(seed: int, size: tuple[int, int] = (60, 40)):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def data_url(image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.mark.parametrize("family", ["llava", "idefics3", "gemma3"])
def test_chat_and_multi_modal_data_match_transformers(tmp_path, family):
    from rein import LLM

    model_dir = tiny_vision_model(tmp_path / family, family)
    llm = LLM(str(model_dir), device="cpu", max_num_batched_tokens=24, enable_prefix_caching=True)
    images = [picture(1), picture(2, (30, 30))]
    parts = [{"type": "text", "text": "Compare "}, {"type": "image"}, {"type": "text", "text": " with "},
             {"type": "image"}, {"type": "text", "text": "."}]
    turns = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": parts}]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    processor = transformers.AutoProcessor.from_pretrained(str(model_dir))
    text = processor.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=images, return_tensors="pt")
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()

    chat_turns = [dict(turn) for turn in turns]
    urls = iter(data_url(image) for image in images)
    chat_turns[2] = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": next(urls)}} if part["type"] == "image" else part
        for part in parts]}
    [by_chat] = llm.chat(chat_turns, params, use_tqdm=False)
    [by_prompt] = llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params, use_tqdm=False)
    assert by_chat.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert by_prompt.prompt_token_ids == by_chat.prompt_token_ids
    assert by_chat.outputs[0].token_ids == want
    assert by_prompt.outputs[0].token_ids == want
