"""What an image costs the API's intake: `rein.jobs.prepare.prepare` of a chat request with one
data-URL JPEG (base64 decode, the full decode that checks it, the chat template, the processor's
expansion) at three sizes, against the same request without an image, on the tiny Qwen2-VL
(rein.fixtures.tiny_vision: its processor counts tokens as Qwen2-VL's does; its small max_pixels
caps the token count, not the work measured). Prints the median of each.

    OMP_NUM_THREADS=1 python bench/intake_images.py
"""

from __future__ import annotations

import base64
import io
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from rein.core.settings import ServedModel, load_settings
from rein.fixtures.tiny_vision import tiny_vision_model
from rein.jobs.image_sources import ImageSources
from rein.jobs.prepare import prepare
from rein.jobs.registry import ModelRegistry, load_model

CHAT = "/v1/chat/completions"


def image_body(width: int, height: int) -> tuple[dict, int]:
    out = io.BytesIO()
    Image.effect_noise((width, height), 60).convert("RGB").save(out, "JPEG", quality=90)
    url = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
    return {"model": "vlm", "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {"url": url}}]}]}, len(out.getvalue())


def median_ms(call: Callable[[], object], times: int) -> float:
    spent = []
    for _ in range(times):
        start = time.perf_counter()
        call()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1000


def main() -> None:
    model = tiny_vision_model(Path(tempfile.mkdtemp()) / "vlm")
    registry = ModelRegistry([load_model(ServedModel(name="vlm", source=str(model), max_model_len=8192))])
    images = ImageSources(load_settings()).for_request("bench")
    text = {"model": "vlm", "max_tokens": 16, "messages": [{"role": "user", "content": "Describe."}]}
    print(f"no image: {median_ms(lambda: prepare(registry, CHAT, text), 30):.2f} ms")
    for width, height in ((448, 448), (1024, 768), (2048, 1536)):
        body, size = image_body(width, height)
        prompt = prepare(registry, CHAT, body, images=images).parsed.prompt_token_ids
        spent = median_ms(lambda body=body: prepare(registry, CHAT, body, images=images), 10)
        print(f"{width}x{height} JPEG ({size / 1024:.0f} KiB): {spent:.1f} ms, {len(prompt)} prompt tokens")


if __name__ == "__main__":
    main()
