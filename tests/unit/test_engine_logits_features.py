"""logit_bias, min_tokens and prompt logprobs through the whole engine (tiny random model;
prompt logprobs checked against a Hugging Face forward of the prompt)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from unit_support import make_engine, prompt_of

from rein.engine import EngineRequestError, LLMEngine, SamplingParams


@pytest.fixture()
def engine(model_dir):
    return make_engine(model_dir)


def run(engine: LLMEngine) -> dict[str, dict]:
    results: dict[str, dict] = {}
    while engine.has_unfinished():
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "text": "", "finish": None, "logprobs": [],
                                                    "prompt_logprobs": None, "outputs": 0, "cached": 0})
            r["outputs"] += 1
            if out.prompt_logprobs is not None:
                assert r["prompt_logprobs"] is None and r["outputs"] == 1, "prompt logprobs on the first output only"
                r["prompt_logprobs"] = out.prompt_logprobs
            r["tokens"].extend(out.new_token_ids)
            r["text"] += out.text_delta
            r["logprobs"].extend(out.logprobs or [])
            r["cached"] = out.num_cached_tokens
            if out.finished:
                r["finish"] = out.finish_reason
    return results


# -- logit_bias ---------------------------------------------------------------------------

def test_logit_bias_100_forces_a_token_greedy_and_sampled(engine):
    prompt = prompt_of(12)
    engine.add_request("greedy", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True,
                                                        logit_bias={"777": 100}, logprobs=1))
    engine.add_request("sampled", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
                                                         logit_bias={777: 100}))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    results = run(engine)
    assert results["greedy"]["tokens"] == [777] * 10
    assert results["sampled"]["tokens"] == [777] * 10
    assert results["plain"]["tokens"] != [777] * 10   # the bias is the greedy request's own
    # Logprobs describe the biased distribution: the forced token is ~certain.
    assert all(lp.logprob > -1e-3 and lp.top[0][0] == 777 for lp in results["greedy"]["logprobs"])


def test_logit_bias_minus_100_bans_the_greedy_token(engine):
    prompt = prompt_of(12, seed=1)
    engine.add_request("plain", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    plain = run(engine)["plain"]["tokens"]
    engine.add_request("banned", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                        logit_bias={plain[0]: -100}))
    banned = run(engine)["banned"]["tokens"]
    assert banned[0] != plain[0] and plain[0] not in banned


def test_logit_bias_outside_the_vocabulary_is_refused(engine):
    vocab = engine.spec.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(EngineRequestError) as info:
            engine.add_request("oov", [5, 6], SamplingParams(logit_bias={bad: 1.0}))
        assert info.value.param == "logit_bias" and str(bad) in str(info.value) and str(vocab - 1) in str(info.value)
    assert "oov" not in engine.requests


# -- min_tokens ---------------------------------------------------------------------------

def test_min_tokens_holds_back_eos_and_stop_token_ids(engine):
    prompt = prompt_of(10, seed=2)
    engine.add_request("plain", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    greedy = run(engine)["plain"]["tokens"]
    # Make the greedy first token the EOS: without min_tokens the request ends at once.
    engine.eos_token_ids = frozenset({greedy[0]})
    engine.add_request("eos", prompt, SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("min", prompt, SamplingParams(max_tokens=12, temperature=0, min_tokens=5))
    engine.add_request("stop-id", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                         stop_token_ids=[greedy[0]], min_tokens=4))
    results = run(engine)
    assert results["eos"]["tokens"] == [greedy[0]] and results["eos"]["finish"] == "stop"
    for rid, m in (("min", 5), ("stop-id", 4)):
        tokens = results[rid]["tokens"]
        assert len(tokens) > m and greedy[0] not in tokens[:m]
        if results[rid]["finish"] == "stop":
            assert tokens[-1] == greedy[0] and greedy[0] not in tokens[:-1]


def test_min_tokens_defers_stop_strings(engine):
    prompt = prompt_of(10, seed=3)
    engine.add_request("free", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    text = run(engine)["free"]["text"]
    stop = text[:2]   # matches at once without min_tokens
    engine.add_request("stopped", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]))
    engine.add_request("min", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop],
                                                     min_tokens=8))
    results = run(engine)
    assert results["stopped"]["text"] == "" and results["stopped"]["finish"] == "stop"
    assert len(results["min"]["tokens"]) >= 8
    assert results["min"]["text"].startswith(text[:2])


# -- prompt logprobs ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.eval()


def reference(hf_model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every prompt position: [len, vocab]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(entries, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e = entries[i]
        assert e.token_id == prompt[i]
        assert e.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=2e-4)
        assert len(e.top) == k
        if k:
            vals, _ = ref[i - 1].topk(k)
            assert [v for _, v in e.top] == pytest.approx(vals.tolist(), abs=2e-4)
            assert all(ref[i - 1, t].item() == pytest.approx(v, abs=2e-4) for t, v in e.top)


@pytest.mark.parametrize("budget", [2048, 8, 5])   # one chunk; chunks of 8; odd chunks
def test_prompt_logprobs_match_a_full_forward(model_dir, hf_model, budget):
    engine = make_engine(model_dir, max_num_batched_tokens=budget)
    prompts = {"a": prompt_of(37, seed=4), "b": prompt_of(20, seed=5), "one": [42]}
    engine.add_request("a", prompts["a"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                                         prompt_logprobs=3))
    engine.add_request("plain", prompt_of(30, seed=6), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    engine.add_request("b", prompts["b"], SamplingParams(max_tokens=2, temperature=0.7, seed=1, ignore_eos=True,
                                                         prompt_logprobs=0))
    engine.add_request("one", prompts["one"], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    results = run(engine)
    check_prompt_logprobs(results["a"]["prompt_logprobs"], prompts["a"], reference(hf_model, prompts["a"]), 3)
    check_prompt_logprobs(results["b"]["prompt_logprobs"], prompts["b"], reference(hf_model, prompts["b"]), 0)
    assert results["one"]["prompt_logprobs"] == [None]
    assert results["plain"]["prompt_logprobs"] is None
    assert engine.pool.num_used == 0


def test_prompt_logprobs_skip_the_prefix_cache_and_come_with_choice_0(model_dir, hf_model):
    engine = make_engine(model_dir)
    prompt = prompt_of(40, seed=7)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    run(engine)
    engine.add_request("hit", prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert run(engine)["hit"]["cached"] == 32
    engine.add_request("scored", prompt, SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=2, ignore_eos=True,
                                                        prompt_logprobs=1))
    firsts: dict[int, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            firsts.setdefault(out.index, out)
            if out.index != 0 or firsts[0] is not out:
                assert out.prompt_logprobs is None
    assert sorted(firsts) == [0, 1, 2]
    assert firsts[0].num_cached_tokens == 0   # every position computed: no prefix cache
    check_prompt_logprobs(firsts[0].prompt_logprobs, prompt, reference(hf_model, prompt), 1)
    assert engine.stats.prompt_tokens == 40 + 8 + 40   # warm, hit (after 32 cached), scored once
    assert engine.pool.num_used == 0


def test_prompt_logprobs_survive_preemption_mid_prompt(model_dir, hf_model):
    prompt = prompt_of(60, seed=8)
    block_bytes = make_engine(model_dir).spec.kv_bytes_per_token(torch.float32) * 16
    # 6 blocks: the long request prefills in chunks of 8 while two others grow and preempt it.
    engine = make_engine(model_dir, kv_cache_memory=6 * block_bytes, max_model_len=96, max_num_batched_tokens=8,
                         enable_prefix_caching=False)
    engine.add_request("x", prompt_of(30, seed=9), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.add_request("y", prompt_of(20, seed=10), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    engine.add_request("scored", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                        prompt_logprobs=2))
    results = run(engine)
    assert engine.stats.preemptions > 0
    check_prompt_logprobs(results["scored"]["prompt_logprobs"], prompt, reference(hf_model, prompt), 2)
