"""LoRA adapters on SmolLM2-135M-Instruct (issue 44): rein's greedy answers under three PEFT
adapters and the base, mixed in one batch, against transformers + PEFT generate().

The tier's Hugging Face model (conftest.py's hf_model) is transformers' own reading of the
packaged Q4_1 GGUF file, i.e. the dequantized weights: there is no other float copy. So both
rein cases are compared with the same references (HF + PEFT on the dequantized weights):

* the float base: rein on the same GGUF file with --quantization none (dequantized to float32,
  the very weights HF holds);
* the quantized base: rein on the GGUF file as it serves it (--quantization auto: projections
  kept in their Q4_1 blocks), the adapters' float products added to the quantized ones.

The adapters are random (tests/lora_support.py's make_peft_adapter, made on a copy of hf_model):
rank 8 on attention, rank 16 rsLoRA on the MLP, rank 64 on all seven projections. The
quantized case also serves the rank 8 adapter converted to llama.cpp's GGUF form (q/k rows of B
reordered as llama.cpp does for Llama), which must answer as its PEFT form. Then eviction: five
adapters through two slots give the answers of five slots.
"""

from __future__ import annotations

import copy
import json
import time
from types import SimpleNamespace

import pytest
from lora_support import make_peft_adapter, peft_to_gguf
from real_support import (
    EN_PROMPTS,
    REPORT,
    chat_ids,
    generate,
    greedy_path,
    hf_eos_ids,
    hf_generate,
    hf_logits,
)

pytestmark = pytest.mark.real

MAX_TOKENS = 12
MAX_RANK = 64
LOGPROB_TOLERANCE = 1e-4
NEAR_TIE = 1e-3        # as conftest.py: a padded-batch answer this close to a tie is generated again alone
TEXTS = EN_PROMPTS[:8]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, target modules, rsLoRA, lora_alpha)
ADAPTERS = {
    "attn8": (8, ATTENTION, False, 16),
    "mlp16": (16, MLP, True, 16),
    "all64": (64, ATTENTION + MLP, False, 32),
}
# Two more for the eviction test (no HF reference needed there).
EXTRA_ADAPTERS = {
    "qv4": (4, ["q_proj", "v_proj"], False, 8),
    "down32": (32, ["down_proj", "o_proj"], True, 8),
}
WEIGHT_STD = 0.02      # large enough to change the answers, small enough to leave the model fluent


@pytest.fixture(scope="module")
def loras(hf_model, gguf_path, tokenizer, tmp_path_factory):
    """The five adapters (LoRARequests), the GGUF form of attn8, the prompts and HF + PEFT's greedy
    answers (tokens and logprobs) under the three main adapters and the base."""
    from rein.model.lora import LoRARequest

    started = time.perf_counter()
    out = tmp_path_factory.mktemp("lora-smollm2")
    paths = {}
    for seed, (name, (rank, targets, rslora, alpha)) in enumerate({**ADAPTERS, **EXTRA_ADAPTERS}.items(), start=1):
        paths[name] = make_peft_adapter(None, out / name, r=rank, target_modules=targets, use_rslora=rslora,
                                        lora_alpha=alpha, seed=seed, weight_std=WEIGHT_STD, base_model=hf_model)
    made = time.perf_counter() - started
    # the base PEFT recorded (the GGUF file's folder), so rein's base check passes for the file
    recorded = json.loads((paths["attn8"] / "adapter_config.json").read_text())["base_model_name_or_path"]
    requests = {name: LoRARequest(name, i, str(path), base_model_name=recorded)
                for i, (name, path) in enumerate(paths.items(), start=1)}
    hf_model.config.save_pretrained(out / "config")   # what llama.cpp's converter reads of the base
    converted = peft_to_gguf(paths["attn8"], out / "config", out / "attn8.gguf")
    requests["attn8.gguf"] = LoRARequest("attn8.gguf", len(requests) + 1, str(converted))

    prompts = [chat_ids(tokenizer, text) for text in TEXTS]
    references, redone = {}, 0
    for name in (None, *ADAPTERS):
        model = hf_model
        if name is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(copy.deepcopy(hf_model), str(paths[name])).eval()
        references[name], again = hf_answers(model, prompts)
        redone += again
    REPORT.append(f"LoRA: 5 adapters made in {made:.1f} s; HF + PEFT references (4 x {len(prompts)} prompts, "
                  f"{MAX_TOKENS} tokens, {redone} generated again alone) in "
                  f"{time.perf_counter() - started - made:.1f} s")
    changed = sum(references[name][i].tokens != references[None][i].tokens
                  for name in ADAPTERS for i in range(len(prompts)))
    # each adapter changes answers (else matching HF would not show that rein applies it)
    for name in ADAPTERS:
        assert any(references[name][i].tokens != references[None][i].tokens for i in range(len(prompts))), name
    REPORT.append(f"LoRA: the adapters change {changed} of {len(ADAPTERS) * len(prompts)} HF answers")
    return SimpleNamespace(paths=paths, requests=requests, prompts=prompts, references=references)


def hf_answers(model, prompts: list[list[int]]) -> tuple[list[SimpleNamespace], int]:
    """HF's greedy answers in one left-padded batch, each checked (and its logprobs taken) by one
    unpadded forward; a near-tie or a non-argmax token is generated again alone, as conftest.py does."""
    answers, redone = [], 0
    eos = hf_eos_ids(model)
    for prompt, tokens in zip(prompts, hf_generate(model, prompts, MAX_TOKENS), strict=True):
        exact, margin, logprobs = greedy_path(hf_logits(model, prompt, tokens), tokens)
        if not exact or margin < NEAR_TIE:
            redone += 1
            [tokens] = hf_generate(model, [prompt], MAX_TOKENS)
            _, margin, logprobs = greedy_path(hf_logits(model, prompt, tokens), tokens)
        answers.append(SimpleNamespace(tokens=tokens, logprobs=logprobs, stopped_at_eos=tokens[-1] in eos,
                                       margin=margin))
    return answers, redone


def lora_engine(make_engine, max_loras: int, quantization: str):
    return make_engine(enable_lora=True, max_lora_rank=MAX_RANK, max_loras=max_loras, quantization=quantization)


def mixed_plan(names: list[str | None], prompts: list[list[int]]) -> list[tuple[int, str | None]]:
    """(prompt index, adapter name) for every prompt under every name, interleaved: neighbouring
    rows of a step run under different adapters."""
    return [(i, names[(i + k) % len(names)]) for k in range(len(names)) for i in range(len(prompts))]


def check_against_hf(engine, loras, names: list[str | None], what: str) -> None:
    """All `names` x prompts in one generate call; tokens equal HF's, logprobs within LOGPROB_TOLERANCE."""
    plan = mixed_plan(names, loras.prompts)
    started = time.perf_counter()
    got = generate(engine, [loras.prompts[i] for i, _ in plan], MAX_TOKENS, logprobs=[0] * len(plan),
                   lora_requests=[loras.requests[n] if n else None for _, n in plan])
    elapsed = time.perf_counter() - started
    problems, worst = [], 0.0
    for (i, name), answer in zip(plan, got, strict=True):
        # the GGUF form of an adapter answers as its PEFT form
        ref = loras.references[name.removesuffix(".gguf") if name else None][i]
        if answer.token_ids != ref.tokens:
            problems.append(f"{TEXTS[i]!r} under {name}: rein {answer.token_ids} vs HF {ref.tokens} (HF's smallest "
                            f"top-2 margin {ref.margin:.4f})")
            continue
        assert answer.finish_reason == ("stop" if ref.stopped_at_eos else "length"), (name, TEXTS[i])
        worst = max(worst, *(abs(a - b) for a, b in zip(answer.logprobs, ref.logprobs, strict=True)))
    REPORT.append(f"LoRA {what}: {len(plan) - len(problems)}/{len(plan)} answers equal HF + PEFT's "
                  f"({len(names)} adapters or base, one batch, {elapsed:.1f} s); logprobs max abs error "
                  f"{worst:.2e} (tolerance {LOGPROB_TOLERANCE:g})")
    assert not problems, f"{what}: rein's answers differ from HF + PEFT's:\n" + "\n".join(problems)
    assert worst <= LOGPROB_TOLERANCE


def test_float_base_matches_hf_and_peft(make_engine, loras):
    engine = lora_engine(make_engine, 3, "none")
    assert not [m for m in engine.runner.model.modules() if getattr(m, "quantized", None) is not None]
    check_against_hf(engine, loras, [None, *ADAPTERS], "float base (GGUF dequantized)")


def test_quantized_base_matches_hf_and_peft(make_engine, loras):
    engine = lora_engine(make_engine, 4, "auto")
    held = [m for m in engine.runner.model.modules() if getattr(m, "quantized", None) is not None]
    assert len(held) >= 4 * engine.spec.num_layers   # every projection kept quantized
    check_against_hf(engine, loras, [None, *ADAPTERS, "attn8.gguf"], "Q4_1 base (kept quantized)")


def test_eviction_gives_the_answers_of_enough_slots(make_engine, loras):
    """Five adapters (and the base) interleaved through two slots, twice: the answers of five slots."""
    names = [None, *ADAPTERS, *EXTRA_ADAPTERS]
    plan = mixed_plan(names, loras.prompts[:4])
    prompts = [loras.prompts[i] for i, _ in plan]
    requests = [loras.requests[n] if n else None for _, n in plan]
    few, many = lora_engine(make_engine, 2, "auto"), lora_engine(make_engine, 5, "auto")
    started = time.perf_counter()
    got = generate(few, prompts, MAX_TOKENS, lora_requests=requests)
    elapsed = time.perf_counter() - started
    want = generate(many, prompts, MAX_TOKENS, lora_requests=requests)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert many.runner.lora.num_activations == 5    # each adapter into its own slot once
    assert few.runner.lora.num_activations >= 5     # five adapters through two slots: three evictions
    # again: the adapters evicted before come back into the slots (and are read from disk again:
    # the host cache holds max_loras adapters)
    again = generate(few, prompts, MAX_TOKENS, lora_requests=requests)
    assert [g.token_ids for g in again] == [w.token_ids for w in want]
    assert few.runner.lora.num_activations >= 10 and many.runner.lora.num_activations == 5
    # the adapters' answers to one prompt differ (else equal answers would show nothing)
    assert len({tuple(g.token_ids) for (i, _), g in zip(plan, got, strict=True) if i == 0}) > 2
    REPORT.append(f"LoRA eviction: {len(plan)} prompts over 5 adapters and the base through 2 slots in "
                  f"{elapsed:.1f} s ({few.runner.lora.num_activations} activations), the answers of 5 slots")
