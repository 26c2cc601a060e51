"""The service on a real model: `rein api` + `rein worker` serving the GGUF file answer the
same prompts, concurrently (so they batch), token for token as HF does."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e.e2e_support import run_service
from real_support import (
    KV_CACHE_MEMORY,
    LOGPROB_TOLERANCE,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    REPORT,
    leading_match,
    token_bytes,
)

pytestmark = pytest.mark.real

MODEL = "smollm2"


@pytest.fixture(scope="module")
def service(tmp_path_factory, gguf_path, references):
    """One stack for the module. `references` first, so HF's work is done before it starts."""
    from rein.core.settings import cache_root

    env = {"REIN_KV_CACHE_MEMORY": KV_CACHE_MEMORY, "REIN_DTYPE": "float32",
           # the harness drops the caller's REIN_* settings; the GGUF's config view is cached here
           "REIN_CACHE_DIR": str(cache_root())}
    with run_service(tmp_path_factory.mktemp("real-service"), gguf_path, extra_env=env,
                     model_name=MODEL, max_model_len=MAX_MODEL_LEN) as svc:
        yield svc


def test_service_chat_matches_hf(service, references, tokenizer, record_property):
    def ask(text: str) -> dict:
        with service.client("a", timeout=300) as client:
            response = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": text}],
                "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": True})
        assert response.status_code == 200, f"{text!r}: {response.status_code} {response.text}{service.diagnostics()}"
        return response.json()

    with ThreadPoolExecutor(max_workers=len(references)) as pool:
        bodies = list(pool.map(ask, [r.text for r in references]))

    problems, worst = [], 0.0
    for ref, body in zip(references, bodies, strict=True):
        choice, usage = body["choices"][0], body["usage"]
        entries = choice["logprobs"]["content"]
        # Each entry's bytes name its token exactly (a byte-level BPE vocabulary has one token per byte string).
        got = [entry["bytes"] for entry in entries]
        want = [token_bytes(tokenizer, t) for t in ref.tokens]
        if got != want:
            k = leading_match(got, want)
            problems.append(f"{ref.text!r}: tokens differ from HF's at {k} of {len(want)} "
                            f"(service {got[k:k + 1]}, HF {want[k:k + 1]}); service text {choice['message']['content']!r}")
            continue
        assert usage["prompt_tokens"] == len(ref.prompt), ref.text       # the API's chat template is ours
        assert usage["completion_tokens"] == len(ref.tokens), ref.text
        assert choice["finish_reason"] == ("stop" if ref.stopped_at_eos else "length"), ref.text
        assert choice["message"]["content"] == tokenizer.decode(ref.tokens, skip_special_tokens=True), ref.text
        worst = max([worst, *(abs(e["logprob"] - lp) for e, lp in zip(entries, ref.logprobs, strict=True))])
    REPORT.append(f"service vs HF: {len(references) - len(problems)}/{len(references)} prompts equal token for "
                  f"token; logprobs max abs error {worst:.2e}")
    record_property("service_logprob_max_abs_error", worst)
    assert not problems, "the service's greedy answers differ from HF's:\n" + "\n".join(problems)
    assert worst <= LOGPROB_TOLERANCE
