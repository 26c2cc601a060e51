"""Images end to end through the official `openai` client: `rein api` and a `rein worker` serving
the tiny Qwen2-VL (rein.fixtures.tiny_vision) in one stack shared by every test here (a vision
model needs its own worker). A data-URL image in chat (streamed and not, the same greedy answer),
an uploaded image (purpose vision) by file id in the Responses API, an image URL fetched from a
local server (REIN_IMAGE_FETCH on, the private-address escape on for this stack only: the SSRF
rules themselves are tests/unit/test_image_fetch.py's), a bad image's 400, and a batch of image
lines in which one bad image fails alone."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
from e2e_support import Service, run_service
from PIL import Image

MODEL = "vlm"
TIMEOUT = 120.0


def png(width: int = 56, height: int = 56, color=(220, 40, 40)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(url: str, **extra) -> dict:
    return {"model": MODEL, "max_tokens": 6, "temperature": 0.0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is shown?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}], **extra}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from rein.fixtures.tiny_vision import tiny_vision_model

    tmp = tmp_path_factory.mktemp("vision-e2e")
    model = tiny_vision_model(tmp / "qwen2_vl")
    with run_service(tmp, model, scopes="inference,batch,usage", model_name=MODEL, max_model_len=2048,
                     extra_env={"REIN_FILES_DIR": str(tmp / "files"), "REIN_BATCH_POLL_SECONDS": "0.2",
                                "REIN_IMAGE_FETCH": "on", "REIN_IMAGE_FETCH_ALLOW_PRIVATE": "true"}) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.keys["a"], max_retries=0,
                       timeout=TIMEOUT) as c:
        yield c


def test_a_data_url_image_in_chat(client: openai.OpenAI) -> None:
    body = chat(data_url(png()))
    completion = client.chat.completions.create(**body)
    [choice] = completion.choices
    assert isinstance(choice.message.content, str) and completion.usage.completion_tokens > 0
    # 56 x 56 pixels are 4 image tokens, counted in the prompt as the model sees it
    text_only = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "What is shown?"}]}])
    assert completion.usage.prompt_tokens >= text_only.usage.prompt_tokens + 4
    chunks = list(client.chat.completions.create(**body, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content


def test_a_bad_image_is_a_400_naming_the_part(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**chat(data_url(png()[:30])))
    error = caught.value.body
    assert error["param"] == "messages[0].content[1]" and error["code"] == "invalid_image"


def test_an_uploaded_image_by_file_id_in_responses(client: openai.OpenAI) -> None:
    uploaded = client.files.create(file=("cat.png", png(84, 56, (10, 200, 10))), purpose="vision")
    assert uploaded.purpose == "vision"
    response = client.responses.create(model=MODEL, max_output_tokens=5, temperature=0.0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Describe it."},
                                     {"type": "input_image", "file_id": uploaded.id, "detail": "low"}]}])
    # (a random model rarely stops within 5 tokens: "incomplete" is its max_output_tokens)
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens > 0


class ImageServer:
    def __init__(self, body: bytes) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/image.png"


def test_an_image_url_is_fetched_and_gives_the_data_urls_answer(client: openai.OpenAI) -> None:
    image = png(56, 84, (30, 30, 200))
    server = ImageServer(image)
    try:
        fetched = client.chat.completions.create(**chat(server.url))
    finally:
        server.http.shutdown()
    inline = client.chat.completions.create(**chat(data_url(image)))
    assert fetched.choices[0].message.content == inline.choices[0].message.content
    assert fetched.usage.prompt_tokens == inline.usage.prompt_tokens


def test_a_batch_of_image_lines_with_one_bad_image(client: openai.OpenAI) -> None:
    lines = [{"custom_id": f"img-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": chat(data_url(png(28 * (i + 1), 28, (40 * i, 90, 160))))} for i in range(3)]
    lines.insert(1, {"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions",
                     "body": chat(data_url(b"\x89PNG\r\n\x1a\n-truncated"))})
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    input_file = client.files.create(file=("images.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    deadline = time.monotonic() + TIMEOUT
    while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
        time.sleep(0.3)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    output = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in output) == ["img-0", "img-1", "img-2"]
    assert all(x["response"]["status_code"] == 200 for x in output)
    [error] = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert error["custom_id"] == "broken" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["code"] == "invalid_image"
