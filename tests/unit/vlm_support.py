"""Helpers of the LLaVA / Idefics3 / SmolVLM / Gemma 3 vision tests (imported by name, as
unit_support): images, chat prompts, running rein's engine, and transformers' reference."""

from __future__ import annotations

import io
import json

import numpy as np
import torch

from rein.core.images import ImageInput, open_image
from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams

PLACEHOLDERS = {"llava": "<image>", "idefics3": "<image>", "smolvlm": "<image>", "gemma3": "<start_of_image>"}
# Engine settings each parity test runs under ("preempt" also gets PREEMPT_TOKENS of KV memory).
SETTINGS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 16, "max_num_encoder_tokens": 8, "block_size": 4},
    "preempt": {"max_num_batched_tokens": 48, "block_size": 4},
    # An encoder cache smaller than any image: every chunk of an image encodes it again.
    "no_encoder_cache": {"max_num_batched_tokens": 16, "block_size": 4, "encoder_cache_tokens": 2},
}


# KV memory of the "preempt" setting, in tokens of every layer: the longest request fits, the
# three together do not (Gemma 3's windowed layers keep fewer blocks, so it holds more tokens).
PREEMPT_TOKENS = {"llava": 150, "idefics3": 200, "smolvlm": 200, "gemma3": 70}


def png(seed: int, size: tuple[int, int] = (40, 60)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def chat(*turns: str) -> str:
    """A ChatML prompt (as the fixtures' template writes it) of user turns, then the assistant's."""
    body = "".join(f"<|im_start|>user\n{turn}<|im_end|>\n" for turn in turns)
    return f"<|begin_of_text|>{body}<|im_start|>assistant\n"


def engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **kwargs))


def cases(processor, family: str) -> dict[str, tuple[list[int], list[bytes]]]:
    """One image; several images of different shapes; an image in the middle of a conversation."""
    image = PLACEHOLDERS[family]
    prompts = {
        "one": (chat(f"{image}What is this?"), [png(1)]),
        "several": (chat(f"Compare {image} and {image} with {image}."), [png(2), png(3, (30, 30)), png(4, (70, 20))]),
        "middle": (chat("Hello there.", f"Look: {image} -- and now say something long about it."), [png(5)]),
    }
    return {name: (processor.expand(text, [open_image(d) for d in images]).token_ids, images)
            for name, (text, images) in prompts.items()}


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], list[bytes]]], params: SamplingParams):
    """Add every request, step to the end; each request's tokens and logprobs."""
    for rid, (ids, images) in requests.items():
        eng.add_request(rid, ids, params, images=[ImageInput.of(d) for d in images])
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.logprobs or [])
    return tokens, logprobs


def hf_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def hf_inputs(processor, family: str, ids: list[int], images: list[bytes]) -> dict[str, torch.Tensor]:
    """transformers' model inputs for an expanded prompt and its images (each image's pixels from
    rein's processor, which the processor tests hold equal to transformers' processor's)."""
    input_ids = torch.tensor([ids])
    inputs = [processor.pixel_inputs(open_image(d)) for d in images]
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if family in ("idefics3", "smolvlm"):
        kwargs["pixel_values"] = torch.cat([i["pixel_values"] for i in inputs]).unsqueeze(0)
        kwargs["pixel_attention_mask"] = torch.cat([i["pixel_attention_mask"] for i in inputs]).unsqueeze(0)
    else:
        kwargs["pixel_values"] = torch.cat([i["pixel_values"] for i in inputs])
    if family == "gemma3":   # what Gemma3Processor returns: it turns on the image tokens' bidirectional mask
        kwargs["token_type_ids"] = (input_ids == processor.image_token_id).long()
    return kwargs


def hf_generate(model, processor, family: str, ids: list[int], images: list[bytes], max_tokens: int):
    """transformers' greedy tokens and their logprobs."""
    out = model.generate(**hf_inputs(processor, family, ids, images), max_new_tokens=max_tokens, do_sample=False,
                         output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens, strict=False)]
    return tokens, logprobs


def check_parity(model_dir, model, family: str, setting: str, max_tokens: int = 10) -> LLMEngine:
    """Greedy tokens equal and logprobs within 1e-4 of transformers' for `cases`, under `setting`."""
    kwargs = dict(SETTINGS[setting])
    if setting == "preempt":
        spec_bytes = _kv_bytes_per_token(model_dir)
        kwargs["kv_cache_memory"] = PREEMPT_TOKENS[family] * spec_bytes
    eng = engine(model_dir, **kwargs)
    requests = cases(eng.vision_processor, family)
    tokens, logprobs = run(eng, requests, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                         logprobs=0))
    if setting == "preempt":
        assert eng.stats.preemptions > 0
    for rid, (ids, images) in requests.items():
        want, want_logprobs = hf_generate(model, eng.vision_processor, family, ids, images, max_tokens)
        assert tokens[rid] == want, rid
        assert np.allclose(logprobs[rid], want_logprobs, atol=1e-4), rid
    return eng


def _kv_bytes_per_token(model_dir) -> int:
    from rein.model.spec import ModelSpec

    return ModelSpec.from_dir(model_dir).kv_bytes_per_token(torch.float32)


def encoder_matches_hf(model_dir, family: str) -> None:
    """rein's encoder (rein.model.vision.encoders, loaded by rein from the checkpoint) against
    transformers' get_image_features, image by image, within 1e-5."""
    from safetensors.torch import load_file

    from rein.model.vision.encoders import make_encoder
    from rein.model.vision.hf_parts import hf_config
    from rein.model.vision.processor import load_vision_processor

    model = hf_model(model_dir)
    processor = load_vision_processor(model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    config = hf_config(json.loads((model_dir / "config.json").read_text()))
    encoder = make_encoder(config, torch.float32, torch.device("cpu"), tensors.get)
    for seed, size in ((1, (40, 60)), (2, (30, 30)), (3, (70, 20))):
        pixels = processor.pixel_inputs(open_image(png(seed, size)))
        inputs = hf_inputs(processor, family, [0], [png(seed, size)])
        kwargs = {"pixel_attention_mask": inputs["pixel_attention_mask"]} if "pixel_attention_mask" in inputs else {}
        with torch.no_grad():
            mine = encoder([pixels])[0]
            want = model.get_image_features(pixel_values=inputs["pixel_values"], **kwargs).pooler_output
        want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want.reshape(-1, want.shape[-1])
        assert mine.shape == want.shape
        assert torch.allclose(mine, want, atol=1e-5)
