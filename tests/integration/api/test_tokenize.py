"""POST /tokenize and /detokenize (vLLM's shapes): a prompt and chat messages as the ids a request
of them runs with, the counts against the context, the token strings, ids back to text, and the
refusals (no key before the body is read, both or neither of prompt and messages, unknown model,
ids outside the vocabulary)."""

from __future__ import annotations

import pytest
from api_support import auth, chat_body
from transformers import AutoTokenizer

from rein.store.tables import Job


@pytest.fixture
def key(make_key, tenant):
    return make_key(tenant)


def test_a_prompt_and_messages_tokenize_as_their_requests(client, key, model_dir, db_session):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answer = client.post("/tokenize", headers=auth(key), json={"model": "tiny", "prompt": "The quick brown fox",
                                                               "return_token_strs": True})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    want = tokenizer.encode("The quick brown fox")
    assert body == {"count": len(want), "max_model_len": 512, "tokens": want,
                    "token_strs": tokenizer.convert_ids_to_tokens(want)}
    bare = client.post("/tokenize", headers=auth(key), json={"prompt": "The quick brown fox",
                                                             "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert bare["token_strs"] is None

    chat = chat_body("Hello there")
    job = client.post("/v1/jobs", headers=auth(key), json={"endpoint": "/v1/chat/completions", "body": chat})
    assert job.status_code == 202, job.text
    stored = db_session.get(Job, job.json()["id"]).prompt_token_ids
    tokenized = client.post("/tokenize", headers=auth(key), json={"messages": chat["messages"]}).json()
    assert tokenized["tokens"] == stored and tokenized["count"] == len(stored)

    text = client.post("/detokenize", headers=auth(key), json={"model": "tiny", "tokens": want})
    assert text.status_code == 200, text.text
    assert text.json() == {"prompt": tokenizer.decode(want)}


def test_refusals(client, key):
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 401
    both = client.post("/tokenize", headers=auth(key), json={"prompt": "hi", "messages": [
        {"role": "user", "content": "hi"}]})
    assert both.status_code == 400 and "not both or neither" in both.json()["error"]["message"]
    assert client.post("/tokenize", headers=auth(key), json={}).status_code == 400
    unknown = client.post("/tokenize", headers=auth(key), json={"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    extra = client.post("/tokenize", headers=auth(key), json={"prompt": "hi", "temperature": 1})
    assert extra.status_code == 400
    outside = client.post("/detokenize", headers=auth(key), json={"tokens": [1, 10**9]})
    assert outside.status_code == 400 and "tokens[1] is 1000000000" in outside.json()["error"]["message"]
    negative = client.post("/detokenize", headers=auth(key), json={"tokens": [-1]})
    assert negative.status_code == 400
    as_text = client.post("/detokenize", headers=auth(key), json={"tokens": ["1"]})
    assert as_text.status_code == 400        # ids are integers, not strings that look like them
