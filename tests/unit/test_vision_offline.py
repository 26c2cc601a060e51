"""rein.LLM with images: vLLM's {"prompt", "multi_modal_data"} prompts and chat messages with
image_url data-URL parts, against the engine fed by hand (whose parity with transformers
tests/unit/test_vision_engine.py checks)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model


def picture(seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (84, 56, 3), dtype=np.uint8))


def data_url(image) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from rein import LLM

    return LLM(str(tiny_vision_model(tmp_path_factory.mktemp("vl"), "qwen2_vl")), device="cpu")


def test_multi_modal_data_and_image_url_chat_agree(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    image = picture(1)
    text = ("<|begin_of_text|><|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
            "<|im_start|>assistant\n")
    [by_prompt] = llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, params, use_tqdm=False)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "What is it?"}]}]
    [by_chat] = llm.chat(messages, params, use_tqdm=False)
    assert by_prompt.prompt_token_ids == by_chat.prompt_token_ids
    assert by_prompt.outputs[0].token_ids == by_chat.outputs[0].token_ids
    assert len(by_chat.outputs[0].token_ids) == 6
    # A different image changes the answer's prompt (same ids) but runs; two images in one turn too.
    [two] = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture(2)), "detail": "low"}},
        {"type": "image_url", "image_url": {"url": data_url(picture(3))}},
        {"type": "text", "text": "Compare."}]}], params, use_tqdm=False)
    assert len(two.outputs[0].token_ids) == 6


def test_bad_images_refused(llm):
    with pytest.raises(ValueError, match="data: URLs"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
                 use_tqdm=False)
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": picture(1)}}, use_tqdm=False)


def test_run_batch_lines_with_images(llm, tmp_path):
    import json

    from rein.offline.run_batch import run_batch

    image = picture(5)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "Caption?"}]}]
    [want] = llm.chat(messages, params, use_tqdm=False)
    lines = [
        {"custom_id": "img", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}},
        {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": [
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 2}},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch(llm.llm_engine, source, tmp_path / "out.jsonl", progress=False)
    out = {line["custom_id"]: line for line in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    body = out["img"]["response"]["body"]
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["choices"][0]["message"]["content"] == want.outputs[0].text
    assert out["bad"]["error"] is not None and "image" in json.dumps(out["bad"]["error"])
