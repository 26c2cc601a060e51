"""Vision-language models through rein's engine (Qwen2-VL / Qwen2.5-VL, tiny random weights):
greedy tokens and logprobs against transformers' generate() with the same images, under chunked
prefill, prefix caching and preemption; the encoder cache; prefix-cache keys that include the
image; n > 1; the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import vlm_support
from vlm_support import chat

from rein.core.images import ImageInput, open_image
from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.errors import EngineRequestError
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def png(seed: int, size: tuple[int, int] = (56, 84)) -> bytes:
    """A random picture (Qwen2-VL's patches are 14 px: 56 x 84 is 4 x 6 of them)."""
    return vlm_support.png(seed, size)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def model_dir(request, tmp_path_factory):
    return tiny_vision_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", **kwargs))


def run(eng: LLMEngine, requests: dict[str, tuple[list[int], list[bytes]]], params: SamplingParams):
    """Add every request, step to the end; each request's tokens and logprobs (choice 0 unless n > 1)."""
    for rid, (ids, images) in requests.items():
        eng.add_request(rid, ids, params, images=[ImageInput.of(d) for d in images])
    tokens: dict[tuple[str, int], list[int]] = {}
    logprobs: dict[tuple[str, int], list[float]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
            if out.logprobs:
                logprobs.setdefault((out.request_id, out.index), []).extend(lp.logprob for lp in out.logprobs)
    return tokens, logprobs


def hf_generate(hf_model, processor, ids: list[int], images: list[bytes], max_tokens: int):
    """transformers' greedy tokens and their logprobs for the same expanded prompt and images."""
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        inputs = [processor.pixel_inputs(open_image(d)) for d in images]
        kwargs = {"pixel_values": torch.cat([i["pixel_values"] for i in inputs]),
                  "image_grid_thw": torch.cat([i["image_grid_thw"] for i in inputs])}
    out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            mm_token_type_ids=(input_ids == processor.image_token_id).int(), max_new_tokens=max_tokens,
                            do_sample=False, output_scores=True, return_dict_in_generate=True, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens, strict=False)]
    return tokens, logprobs


def prompts(processor) -> dict[str, tuple[list[int], list[bytes]]]:
    """One image; several images; an image in the middle of the conversation."""
    one = [png(1)]
    several = [png(2), png(3, (84, 56)), png(4, (112, 112))]
    middle = [png(5)]
    out = {
        "one": (chat(f"{IMAGE}What is this?"), one),
        "several": (chat(f"Compare {IMAGE} and {IMAGE} with {IMAGE}."), several),
        "middle": (chat("Hello there.", f"Look: {IMAGE} -- and now say something long about it."), middle),
    }
    return {k: (processor.expand(text, [open_image(d) for d in imgs]).token_ids, imgs)
            for k, (text, imgs) in out.items()}


@pytest.mark.parametrize("setting", ["plain", "chunked", "preempt", "evicting"])
def test_greedy_matches_transformers(model_dir, hf_model, setting):
    kwargs = {"plain": {}, "chunked": {"max_num_batched_tokens": 16, "max_num_encoder_tokens": 8},
              "preempt": {"max_num_batched_tokens": 32, "kv_cache_memory": 40 * 1024, "block_size": 4},
              # an encoder cache smaller than one image: every chunk and recompute encodes again
              "evicting": {"max_num_batched_tokens": 8, "encoder_cache_tokens": 2, "kv_cache_memory": 40 * 1024,
                           "block_size": 4}}[setting]
    eng = engine(model_dir, **kwargs)
    cases = prompts(eng.vision_processor)
    tokens, logprobs = run(eng, cases, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
    if setting in ("preempt", "evicting"):
        assert eng.stats.preemptions > 0
    if setting == "evicting":
        assert eng.encoder_cache.encoded_images > len([i for _, imgs in cases.values() for i in imgs])
    for rid, (ids, images) in cases.items():
        want, want_logprobs = hf_generate(hf_model, eng.vision_processor, ids, images, 12)
        assert tokens[(rid, 0)] == want, rid
        assert np.allclose(logprobs[(rid, 0)], want_logprobs, atol=1e-4), rid


def test_same_image_encoded_once_and_prefix_keys_include_the_image(model_dir, hf_model):
    eng = engine(model_dir, block_size=4)
    vp = eng.vision_processor
    same, other = png(10), png(11)
    text = chat(f"{IMAGE}Describe the picture in detail please.")
    ids = vp.expand(text, [open_image(same)]).token_ids
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tokens_a, _ = run(eng, {"a": (ids, [same])}, params)
    assert eng.encoder_cache.encoded_images == 1
    tokens_b, _ = run(eng, {"b": (ids, [same])}, params)
    assert eng.encoder_cache.encoded_images == 1          # the cache gave it
    b_cached = eng.stats.prefix_cache_hits
    assert b_cached > 0                                   # the same image behind the same text shares blocks
    assert tokens_a[("a", 0)] == tokens_b[("b", 0)]
    # A different image behind the same text: the same token ids, but no block past the image is shared.
    ids_other = vp.expand(text, [open_image(other)]).token_ids
    assert ids_other == ids
    request = eng.add_request("c", ids_other, params, images=[ImageInput.of(other)])
    offset = request.images.items[0].offset
    while eng.has_unfinished():
        eng.step()
    assert eng.encoder_cache.encoded_images == 2
    assert request.num_cached_tokens <= offset            # only blocks wholly before the image
    want, _ = hf_generate(hf_model, vp, ids_other, [other], 4)
    tokens_c = request.output_token_ids
    assert tokens_c == want


def test_n_choices_with_an_image(model_dir, hf_model):
    eng = engine(model_dir)
    image = png(20)
    ids = eng.vision_processor.expand(chat(f"{IMAGE}Caption?"), [open_image(image)]).token_ids
    tokens, _ = run(eng, {"n": (ids, [image])}, SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True))
    want, _ = hf_generate(hf_model, eng.vision_processor, ids, [image], 6)
    assert [tokens[("n", i)] for i in range(3)] == [want] * 3
    assert eng.encoder_cache.encoded_images == 1


def test_refusals(model_dir, tmp_path):
    eng = engine(model_dir)
    vp = eng.vision_processor
    image = png(30)
    ids = vp.expand(chat(f"{IMAGE} and {IMAGE}"), [open_image(image), open_image(image)]).token_ids
    with pytest.raises(EngineRequestError, match="2 image"):
        eng.add_request("x", ids, SamplingParams(max_tokens=2), images=[ImageInput.of(image)])
    with pytest.raises(EngineRequestError, match="no images"):
        eng.add_request("y", ids, SamplingParams(max_tokens=2))
    from rein.core.images import ImageError

    with pytest.raises(ImageError, match="placeholder"):
        vp.expand(chat(f"{IMAGE}"), [open_image(image), open_image(image)])
    # An image at detail "low" expanded at "auto" (a big image: the two differ).
    big = png(31, (1200, 900))
    auto = vp.expand(chat(IMAGE), [open_image(big)]).token_ids
    with pytest.raises(EngineRequestError, match="detail"):
        eng.add_request("z", auto, SamplingParams(max_tokens=2), images=[ImageInput.of(big, "low")])
    low = vp.expand(chat(IMAGE), [open_image(big)], ["low"])
    assert low.image_token_counts[0] <= 256 < vp.expand(chat(IMAGE), [open_image(big)]).image_token_counts[0]


def test_images_on_a_text_model_refused(tmp_path):
    from rein.fixtures.tiny_model import make_tiny_model

    eng = LLMEngine(EngineConfig(model=str(make_tiny_model(tmp_path / "text", "qwen2")), device="cpu"))
    with pytest.raises(EngineRequestError, match="text only"):
        eng.add_request("t", [1, 2, 3], SamplingParams(max_tokens=2), images=[ImageInput.of(png(1))])


def test_legacy_checkpoint_layout(tmp_path):
    new = tiny_vision_model(tmp_path / "new", "qwen2_vl")
    old = tiny_vision_model(tmp_path / "old", "qwen2_vl", legacy_layout=True)
    image = png(40)
    results = []
    for path in (new, old):
        eng = engine(path)
        ids = eng.vision_processor.expand(chat(f"{IMAGE}Hi"), [open_image(image)]).token_ids
        results.append(run(eng, {"r": (ids, [image])}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0])
    assert results[0] == results[1]


def test_whole_chunk_rule_never_cuts_an_image():
    from rein.engine.block_pool import BlockPool
    from rein.engine.encoder_cache import EncoderCache
    from rein.engine.multimodal import ImageItem, RequestImages
    from rein.engine.request import Request
    from rein.engine.scheduler import Scheduler

    scheduler = Scheduler(BlockPool(64, 4), 8, 10, encoder_cache=EncoderCache(100), max_num_encoder_tokens=100,
                          image_tokens_whole_chunk=True)
    tokens = [1] * 4 + [9] * 8 + [1] * 4
    item = ImageItem(4, 8, "k:auto", {})
    request = Request("r", tokens, SamplingParams(max_tokens=1),
                      images=RequestImages((item,), tuple(tokens)))
    scheduler.add(request)
    plan = scheduler.schedule()
    assert [(s.start, s.end) for s in plan.scheduled] == [(0, 4)]   # stops before the image
    request.num_computed_tokens = 4
    plan = scheduler.schedule()
    assert [(s.start, s.end) for s in plan.scheduled] == [(4, 14)]  # the image whole, then text up to the budget
    # Starting two tokens earlier, a 10-token chunk would cut the image: it stops before it.
    other = Request("o", [1] * 6 + [9] * 8, SamplingParams(max_tokens=1),
                    images=RequestImages((ImageItem(6, 8, "k2:auto", {}),), tuple([1] * 6 + [9] * 8)))
    fresh = Scheduler(BlockPool(64, 4), 8, 10, encoder_cache=EncoderCache(100), image_tokens_whole_chunk=True)
    fresh.add(other)
    assert [(s.start, s.end) for s in fresh.schedule().scheduled] == [(0, 6)]


def test_images_through_the_process_client(tmp_path):
    """The worker's path: images= through ProcessEngineClient.submit reach the engine in its
    process, with the same tokens as the engine in this one."""
    from rein.engine.process_client import ProcessEngineClient

    path = tiny_vision_model(tmp_path / "m", "qwen2_vl")
    here = engine(path)
    image = png(50)
    ids = here.vision_processor.expand(chat(f"{IMAGE}Hi"), [open_image(image)]).token_ids
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    want = run(here, {"r": (ids, [image])}, params)[0][("r", 0)]
    client = ProcessEngineClient(EngineConfig(model=str(path), device="cpu"), name="vision-test").start()
    try:
        stream = client.submit("r", ids, params, images=[ImageInput.of(image)])
        tokens = []
        for out in stream:
            tokens.extend(out.new_token_ids)
        assert tokens == want
        with pytest.raises(EngineRequestError, match="image"):
            client.submit("bad", ids, params)
    finally:
        client.stop()


def test_tensor_parallel_refused(tmp_path):
    path = tiny_vision_model(tmp_path / "m", "qwen2_vl")
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        engine(path, tensor_parallel_size=2)


def test_mrope_positions_match_transformers(model_dir, hf_model):
    """The positions hook against transformers' get_rope_index, two images of different grids."""
    eng = engine(model_dir)
    vp = eng.vision_processor
    images = [png(60, (56, 112)), png(61, (84, 56))]
    ids = vp.expand(chat(f"a {IMAGE} b {IMAGE} c"), [open_image(d) for d in images]).token_ids
    grids = torch.cat([vp.pixel_inputs(open_image(d))["image_grid_thw"] for d in images])
    input_ids = torch.tensor([ids])
    want, delta = hf_model.model.get_rope_index(input_ids, (input_ids == vp.image_token_id).int(), grids)
    positions, got_delta = eng.runner.model.mrope_positions(ids, [tuple(g.tolist()) for g in grids])
    assert torch.equal(positions, want[:, 0]) and got_delta == int(delta)


def test_low_detail_matches_transformers(model_dir, hf_model):
    """detail "low": fewer image tokens, the same pixels HF gets from the processor at that detail."""
    eng = engine(model_dir)
    vp = eng.vision_processor
    big = png(70, (600, 450))
    image = open_image(big)
    expanded = vp.expand(chat(f"{IMAGE}Describe."), [image], ["low"])
    assert expanded.image_token_counts[0] < vp.count_tokens(image, "auto")
    eng.add_request("low", expanded.token_ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                    images=[ImageInput.of(big, "low")])
    tokens = []
    while eng.has_unfinished():
        for out in eng.step():
            tokens.extend(out.new_token_ids)
    pixels = vp.pixel_inputs(image, "low")
    ids = torch.tensor([expanded.token_ids])
    want = hf_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             mm_token_type_ids=(ids == vp.image_token_id).int(), max_new_tokens=5, do_sample=False,
                             **pixels)[0, ids.shape[1]:].tolist()
    assert tokens == want


def test_expand_equals_the_transformers_processor(model_dir):
    """`expand` against transformers' own Qwen2VLProcessor.__call__ (built without its video
    processor, which needs torchvision), several sizes: the same ids, and the token counts
    `count_tokens` computes without preprocessing equal the image processor's grids."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    vp = engine(model_dir).vision_processor
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    hf = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    hf.image_processor, hf.tokenizer, hf.video_processor, hf.chat_template = (
        AutoImageProcessor.from_pretrained(str(model_dir)), tokenizer, None, None)
    hf.image_token, hf.video_token = "<|image_pad|>", "<|video_pad|>"
    hf.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    hf.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    images = [open_image(png(80 + i, size)) for i, size in enumerate([(56, 56), (57, 300), (640, 480), (30, 30)])]
    text = chat(f"{IMAGE} one {IMAGE} two {IMAGE} three {IMAGE}")
    want = hf(text=[text], images=images, return_tensors="pt")
    got = vp.expand(text, images)
    assert got.token_ids == want["input_ids"][0].tolist()
    assert got.image_token_counts == (want["image_grid_thw"].prod(-1) // 4).tolist()
