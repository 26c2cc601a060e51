"""SmolLM2-135M with PEFT LoRA adapters over three tensor-parallel ranks (gloo, on CPU): each rank
reads its shard of every adapter (its q heads and its one KV head of q/k/v, its slice of
gate/up, its input columns of o_proj and down_proj) into the slot rank 0 chose. Greedy answers
of the base and two adapters mixed in one batch equal the one-rank engine's token for token,
logprobs within 1e-4.

The adapters are made with PEFT on transformers' own reading of the GGUF file, saved as a Hugging
Face directory (a copy of the conftest's `hf_model`); random A and B (tests/lora_support.py), small enough
that the model still answers, large enough to change its answers. Few prompts and short answers:
three engine loads of 30 layers on a 2-core machine are the cost here.
"""

from __future__ import annotations

import time

import pytest
from real_support import REPORT, chat_ids, torch_threads

pytestmark = pytest.mark.real

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2 + 2?"]


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """Two PEFT adapters for the model: attention (q, k, v, o) at rank 8, the MLP (gate, up,
    down) and k at rank 4, rsLoRA."""
    import torch
    from lora_support import make_peft_adapter
    from transformers import AutoModelForCausalLM

    from rein.model.lora import LoRARequest

    started = time.perf_counter()
    out = tmp_path_factory.mktemp("smollm2-lora")
    with torch_threads(1):
        # transformers will not save a model it read from GGUF: a plain copy of it then.
        copy = AutoModelForCausalLM.from_config(hf_model.config, dtype=torch.float32)
        copy.load_state_dict(hf_model.state_dict())
        copy.save_pretrained(str(out / "hf"))
        del copy
        paths = [
            make_peft_adapter(out / "hf", out / "attention", r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                              lora_alpha=16, seed=1, weight_std=0.02),
            make_peft_adapter(out / "hf", out / "mlp", r=4, target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"],
                              lora_alpha=8, use_rslora=True, seed=2, weight_std=0.03),
        ]
    REPORT.append(f"LoRA adapters on an HF copy of the model: {time.perf_counter() - started:.1f} s")
    # The adapters record the HF copy's directory as their base; the engine serves the GGUF file.
    return [LoRARequest(path.name, i, str(path), base_model_name=str(out / "hf"))
            for i, path in enumerate(paths, start=1)]


def answer(engine, tokenizer, adapters) -> dict[tuple[int, int], tuple[list[int], list[float]]]:
    """Greedy tokens and logprobs of every question under the base and each adapter, in one batch:
    (question index, adapter id or 0) -> (tokens, logprobs)."""
    from rein.engine.sampling_params import SamplingParams

    keys = {}
    for q, question in enumerate(QUESTIONS):
        for lora in [None, *adapters]:
            request_id = f"q{q}-{lora.lora_int_id if lora else 0}"
            keys[request_id] = (q, lora.lora_int_id if lora else 0)
            engine.add_request(request_id, chat_ids(tokenizer, question),
                               SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0), lora_request=lora)
    results = {key: ([], []) for key in keys.values()}
    with torch_threads(1):
        while engine.has_unfinished():
            for out in engine.step():
                tokens, logprobs = results[keys[out.request_id]]
                tokens.extend(out.new_token_ids)
                logprobs.extend(lp.logprob for lp in out.logprobs or [])
    return results


def test_three_ranks_with_adapters_answer_as_one(make_engine, tokenizer, adapters):
    answers = {}
    for ranks in (1, 3):
        engine = make_engine(tensor_parallel_size=ranks, enable_lora=True, max_loras=2, max_lora_rank=8)
        try:
            started = time.perf_counter()
            answers[ranks] = answer(engine, tokenizer, adapters)
            REPORT.append(f"LoRA answers on {ranks} rank(s): {len(answers[ranks])} requests in "
                          f"{time.perf_counter() - started:.1f} s")
        finally:
            engine.close()
    one, three = answers[1], answers[3]
    for key, (tokens, logprobs) in one.items():
        assert three[key][0] == tokens, key
        assert len(logprobs) == len(tokens) == len(three[key][1])
        worst = max(abs(a - b) for a, b in zip(logprobs, three[key][1], strict=True))
        assert worst < LOGPROB_TOLERANCE, f"{key}: logprobs differ by up to {worst:.2e}"
    # Each adapter changes the answers (else equal answers would say nothing about the adapters):
    # some of their tokens, and on every question its tokens or their logprobs, by far more than
    # the ranks differ.
    for lora_id in (1, 2):
        base, adapted = [one[(q, 0)] for q in range(len(QUESTIONS))], [one[(q, lora_id)] for q in range(len(QUESTIONS))]
        assert any(a[0] != b[0] for a, b in zip(adapted, base, strict=True)), f"adapter {lora_id} changes no answer"
        for q, (a, b) in enumerate(zip(adapted, base, strict=True)):
            assert a[0] != b[0] or max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) > 1e-2, (lora_id, q)
