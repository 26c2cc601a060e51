"""/v1/embeddings end to end with the official `openai` client: `rein api` and `rein worker`
serving a tiny embedding model (rein make-tiny-model --embedding: Qwen3-Embedding's shape,
last-token pooling, normalized), plus a batch file of /v1/embeddings lines through the
Batch API and through `rein run-batch`.

Its own service (the other e2e modules serve the tiny llama, which has no pooling files):
the vectors are checked against Hugging Face's AutoModel on the same token ids.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import time
from collections.abc import Iterator

import openai
import pytest
import torch
from e2e_support import MODEL, REIN, REPO, Service, run_service

pytestmark = pytest.mark.slow

TIMEOUT = 120.0
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "The quick brown fox"]


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("qwen3", embedding="last")


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, model_dir) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("embeddings")
    with run_service(tmp, model_dir, scopes="inference,batch,usage",
                     extra_env={"REIN_FILES_DIR": str(tmp / "files"), "REIN_BATCH_POLL_SECONDS": "0.2"}) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{service.base_url}/v1", api_key=service.keys["a"], max_retries=0,
                       timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="module")
def expected(model_dir) -> dict[str, list[float]]:
    """Hugging Face's vectors: AutoModel's last hidden state at the last token, L2-normalized."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    vectors = {}
    with torch.no_grad():
        for text in set(TEXTS):
            hidden = model(input_ids=torch.tensor([tokenizer.encode(text)])).last_hidden_state[0]
            vectors[text] = torch.nn.functional.normalize(hidden[-1], dim=-1).tolist()
    return vectors


def close(got: list[float], want: list[float], tolerance: float = 1e-4) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < tolerance


def test_embeddings_float(client: openai.OpenAI, expected) -> None:
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert isinstance(response, openai.types.CreateEmbeddingResponse)
    assert response.object == "list" and response.model == MODEL
    assert [d.index for d in response.data] == [0, 1, 2] and {d.object for d in response.data} == {"embedding"}
    for text, item in zip(TEXTS, response.data, strict=True):
        assert close(item.embedding, expected[text])
    single = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert response.usage.prompt_tokens == response.usage.total_tokens == \
        2 * single.usage.prompt_tokens + client.embeddings.create(model=MODEL, input=TEXTS[1]).usage.prompt_tokens


def test_embeddings_base64(client: openai.OpenAI, expected) -> None:
    # Asked explicitly, base64 comes back as the text OpenAI sends: little-endian float32 bytes.
    raw = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="base64")
    data = base64.b64decode(raw.data[0].embedding)
    assert close(list(struct.unpack(f"<{len(data) // 4}f", data)), expected[TEXTS[1]])
    # Not asked, the client itself requests base64 and decodes it.
    plain = client.embeddings.create(model=MODEL, input=TEXTS[1])
    assert close(plain.data[0].embedding, expected[TEXTS[1]])


def test_embeddings_token_ids_and_dimensions(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model=MODEL, input=[[5, 6, 7], [8, 9]], encoding_format="float")
    assert full.usage.prompt_tokens == 5
    cut = client.embeddings.create(model=MODEL, input=[[5, 6, 7]], dimensions=16, encoding_format="float")
    vector = torch.tensor(full.data[0].embedding)
    assert len(cut.data[0].embedding) == 16
    assert close(cut.data[0].embedding, torch.nn.functional.normalize(vector[:16], dim=0).tolist(), 1e-6)


def test_embeddings_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="")
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input="hi", dimensions=10_000)
    assert info.value.body["param"] == "dimensions"


def test_embeddings_next_to_generation(client: openai.OpenAI) -> None:
    """The same worker and engine generate too (tied embeddings): both kinds at once."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        completion = pool.submit(client.completions.create, model=MODEL, prompt="Hello", max_tokens=8,
                                 temperature=0)
        embeddings = [pool.submit(client.embeddings.create, model=MODEL, input=TEXTS) for _ in range(3)]
        assert completion.result().usage.completion_tokens >= 1
        assert all(len(e.result().data) == 3 for e in embeddings)


def embedding_lines() -> bytes:
    return "".join(json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                               "body": {"model": MODEL, "input": [text, TEXTS[0]],
                                        "encoding_format": "base64" if i % 2 else "float"}}) + "\n"
                   for i, text in enumerate(TEXTS)).encode()


def decode(embedding) -> list[float]:
    if isinstance(embedding, str):
        data = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(data) // 4}f", data))
    return embedding


def test_batch_of_embeddings(client: openai.OpenAI, expected) -> None:
    input_file = client.files.create(file=("embeddings.jsonl", embedding_lines()), purpose="batch")
    batch = client.batches.create(input_file_id=input_file.id, endpoint="/v1/embeddings", completion_window="24h")
    deadline = time.monotonic() + 180
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.completed == 3 and batch.request_counts.failed == 0
    lines = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in lines] == ["e0", "e1", "e2"]
    for i, line in enumerate(lines):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and body["object"] == "list"
        assert isinstance(body["data"][0]["embedding"], str) == bool(i % 2)
        assert close(decode(body["data"][0]["embedding"]), expected[TEXTS[i]])
        assert close(decode(body["data"][1]["embedding"]), expected[TEXTS[0]])


def test_run_batch_cli_with_embeddings_lines(model_dir, tmp_path, expected) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_bytes(embedding_lines())
    done = subprocess.run([*REIN, "run-batch", str(source), "-o", str(out), "--model", str(model_dir),
                           "--device", "cpu", "--kv-cache-memory", "16MiB", "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert sorted(lines) == ["e0", "e1", "e2"]
    for i, text in enumerate(TEXTS):
        body = lines[f"e{i}"]["response"]["body"]
        assert close(decode(body["data"][0]["embedding"]), expected[text])
