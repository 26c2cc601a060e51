"""Image captioning on a vision-language model: rein (rein.LLM) against Hugging Face generate().

    python bench/vision.py [--family qwen2_vl|qwen2_5_vl] [--preset small] [--requests 64]
                           [--image-size 224] [--max-tokens 32] [--hf-batch 16]

The workload (seeded): `--requests` chat prompts "Describe this picture." each with its own
random `--image-size` x `--image-size` image (Qwen2-VL: 64 image tokens at 224 px), greedy,
`--max-tokens` tokens each (ignore_eos, so both sides produce every token). The model is
rein.fixtures.tiny_vision's `--preset` (small: 4 layers, hidden 256, a 4-block vision tower),
fp32 on the CPU (or the engine's default device and dtype where one is available: both sides
use the same).

rein: `LLM.chat` with image_url data-URL parts, all requests at once (continuous batching,
the vision encoder run once per image under its per-step budget). Hugging Face:
`Qwen2VLForConditionalGeneration.generate` on batches of `--hf-batch` (padding left), the
images through the same image processor. Printed: images/s and output tokens/s of each, the
ratio, and the vision encoder's share of rein's step time (EngineStats.encoder_seconds /
step_seconds). The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rein.core.images import open_image
from rein.engine.sampling_params import SamplingParams
from rein.fixtures.tiny_vision import tiny_vision_model


def images(count: int, size: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


def messages(data: bytes) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe this picture."}]}]


def run_rein(model_dir: Path, pictures: list[bytes], max_tokens: int) -> dict:
    from rein import LLM

    llm = LLM(str(model_dir))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.chat([messages(pictures[0])], params, use_tqdm=False)   # warm-up (its image is cached: a fresh one below)
    engine = llm.llm_engine
    engine.encoder_cache.clear()
    conversations = [messages(p) for p in pictures]   # built before the clock, as HF's inputs are PNG bytes
    before = (engine.stats.step_seconds, engine.runner.encoder_seconds)
    started = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    steps = engine.stats.step_seconds - before[0]
    encoder = engine.runner.encoder_seconds - before[1]
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "images_per_s": len(pictures) / seconds, "tokens_per_s": tokens / seconds,
            "encoder_share": encoder / steps if steps else 0.0, "device": str(engine.runner.device),
            "dtype": str(engine.runner.dtype).removeprefix("torch."), "outputs": [o.outputs[0].token_ids for o in outputs],
            "prompt_ids": outputs[0].prompt_token_ids}


def run_hf(model_dir: Path, pictures: list[bytes], max_tokens: int, batch: int, prompt_text: str,
           device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoModelForImageTextToText

    from rein.model.vision.processor import load_vision_processor

    processor = load_vision_processor(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    pad = processor.tokenizer.pad_token_id

    def generate(group: list[bytes]) -> list[list[int]]:
        opened = [open_image(d) for d in group]
        rows = [processor.expand(prompt_text, [image]).token_ids for image in opened]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        inputs = [processor.pixel_inputs(image) for image in opened]
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                mm_token_type_ids=(ids == processor.image_token_id).int().to(device),
                pixel_values=torch.cat([i["pixel_values"] for i in inputs]).to(device, dtype),
                image_grid_thw=torch.cat([i["image_grid_thw"] for i in inputs]).to(device),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        return out[:, width:].tolist()

    generate(pictures[:2])   # warm-up
    started = time.perf_counter()
    outputs = []
    for start in range(0, len(pictures), batch):
        outputs.extend(generate(pictures[start:start + batch]))
    seconds = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    return {"seconds": seconds, "images_per_s": len(pictures) / seconds, "tokens_per_s": tokens / seconds,
            "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen2_vl", choices=("qwen2_vl", "qwen2_5_vl"))
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_vision_model(Path(tmp) / args.family, args.family, preset=args.preset)
        pictures = images(args.requests + 1, args.image_size)[1:]
        rein = run_rein(model_dir, pictures, args.max_tokens)
        from transformers import AutoTokenizer

        prompt_text = AutoTokenizer.from_pretrained(str(model_dir)).decode(rein["prompt_ids"], skip_special_tokens=False)
        # The prompt text back from its ids has each image's run of tokens: keep one placeholder.
        image_token = "<|image_pad|>"
        while image_token * 2 in prompt_text:
            prompt_text = prompt_text.replace(image_token * 2, image_token)
        dtype = getattr(torch, rein["dtype"])
        hf = run_hf(model_dir, pictures, args.max_tokens, args.hf_batch, prompt_text, rein["device"], dtype)
    same = sum(a == b for a, b in zip(rein.pop("outputs"), hf.pop("outputs"), strict=True))
    rein.pop("prompt_ids")
    print(f"# {args.requests} captions of {args.image_size}px images, {args.max_tokens} tokens each, "
          f"{args.family} {args.preset}, {rein['device']} {rein['dtype']}, torch threads {torch.get_num_threads()}")
    print(f"{'':12}{'images/s':>10}{'tokens/s':>10}{'seconds':>9}")
    print(f"{'rein':12}{rein['images_per_s']:>10.2f}{rein['tokens_per_s']:>10.1f}{rein['seconds']:>9.2f}")
    print(f"{'HF b=' + str(args.hf_batch):12}{hf['images_per_s']:>10.2f}{hf['tokens_per_s']:>10.1f}{hf['seconds']:>9.2f}")
    ratio = rein["images_per_s"] / hf["images_per_s"]
    print(f"rein / HF: {ratio:.2f}x; vision encoder share of rein's step time: {rein['encoder_share']:.1%}; "
          f"greedy outputs equal: {same}/{args.requests}")
    print(json.dumps({"rein": rein, "hf": hf, "ratio": ratio, "same_outputs": same, "args": vars(args)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
