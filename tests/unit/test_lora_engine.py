"""LoRA in the engine (issue 44): the prefix cache keeps each adapter's blocks apart, the slot
manager's host cache and device slots, the scheduler's max_loras, and `rein.LLM` with adapters
on the tiny llama against transformers + PEFT (greedy tokens), with eviction and a bad adapter."""

from __future__ import annotations

import pytest
from scheduler_support import Driver

from rein.engine.block_pool import ROOT, BlockPool, prefix_root
from rein.engine.kv_cache_manager import KVCacheManager
from rein.engine.lora_slots import LoRASlots
from rein.engine.request import Request
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler
from rein.model.lora import LoRARequest

BLOCK = 4


def adapter(lora_id: int, path: str | None = None) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_id}", lora_id, path or f"/adapters/{lora_id}")


def lora_request(rid: str, tokens: list[int], lora: LoRARequest | None, max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), lora_request=lora)


# -- the prefix cache ---------------------------------------------------------------------------


def test_each_adapter_has_its_own_prefix_root():
    assert prefix_root(0) == ROOT
    roots = {prefix_root(i) for i in range(5)}
    assert len(roots) == 5 and all(root[0] < 0 for root in roots)   # no block id is negative


def test_the_pool_finds_a_prefix_only_under_the_root_it_was_cached_under():
    pool = BlockPool(8, BLOCK, enable_caching=True)
    tokens = list(range(8))
    blocks = pool.allocate(2)
    parent = pool.cache_block(blocks[0], prefix_root(1), tokens[:4])
    pool.cache_block(blocks[1], parent, tokens[4:])
    assert pool.find_prefix(tokens, 2, prefix_root(1)) == blocks       # the same adapter: a hit
    assert pool.find_prefix(tokens, 2) == []                          # the base: none
    assert pool.find_prefix(tokens, 2, prefix_root(2)) == []          # another adapter: none


def test_requests_of_different_adapters_never_share_computed_blocks():
    kv = KVCacheManager.create(16, BLOCK, enable_caching=True)
    tokens = list(range(9))
    first = lora_request("a", tokens, adapter(1))
    assert first.cache_parent == prefix_root(1)
    kv.allocate(first, 3)
    first.num_computed_tokens = 8
    kv.mark_computed(first)
    lora_blocks = first.block_ids[:2]
    assert kv.find_cached(lora_request("same", tokens, adapter(1)), 2) == lora_blocks
    assert kv.find_cached(lora_request("other", tokens, adapter(2)), 2) == []
    assert kv.find_cached(lora_request("base", tokens, None), 2) == []
    kv.free(first)   # back at its adapter's root: a preempted request resumes under it
    assert first.cache_parent == prefix_root(1)

    base = lora_request("b", tokens, None)
    kv.allocate(base, 3)
    base.num_computed_tokens = 8
    kv.mark_computed(base)
    assert kv.find_cached(lora_request("base2", tokens, None), 2) == base.block_ids[:2]
    assert kv.find_cached(lora_request("lora", tokens, adapter(1)), 2) == lora_blocks
    assert not set(lora_blocks) & set(base.block_ids)


def test_a_scheduled_adapter_request_takes_no_base_blocks():
    scheduler = Scheduler(KVCacheManager.create(32, BLOCK, enable_caching=True), 8, 64, max_loras=2)
    driver = Driver(scheduler)
    tokens = list(range(12))
    scheduler.add(lora_request("base", tokens, None))
    driver.run(3)
    base_blocks = set(scheduler.running[0].block_ids[:2])
    scheduler.add(lora_request("lora", tokens, adapter(1)))
    scheduler.add(lora_request("base-again", tokens, None))
    plan = driver.step()
    by_id = {s.request.request_id: s for s in plan.scheduled}
    assert by_id["lora"].start == 0 and not base_blocks & set(by_id["lora"].request.block_ids)
    assert by_id["base-again"].start == 8 and by_id["base-again"].request.num_cached_tokens == 8


# -- the scheduler's max_loras ------------------------------------------------------------------


def test_the_running_requests_use_at_most_max_loras_adapters():
    scheduler = Scheduler(KVCacheManager.create(64, BLOCK), 8, 256, max_loras=2)
    driver = Driver(scheduler)
    for i, lora_id in enumerate([1, 2, 3, 1, 0, 3]):
        scheduler.add(lora_request(f"r{i}", [100 * i + t for t in range(5)], adapter(lora_id) if lora_id else None))
    seen = set()
    while scheduler.has_unfinished():
        plan = driver.step()
        adapters = {s.request.lora_int_id for s in plan.scheduled if s.request.lora_request is not None}
        assert len(adapters) <= 2
        seen |= {s.request.request_id for s in plan.scheduled}
        if scheduler.num_steps == 1:   # adapter 3 waits; base and adapter 1 behind it go ahead
            assert {s.request.request_id for s in plan.scheduled} == {"r0", "r1", "r3", "r4"}
    assert seen == {f"r{i}" for i in range(6)} and len(driver.finished) == 6


# -- the slot manager ---------------------------------------------------------------------------


class FakeSlots:
    def __init__(self) -> None:
        self.slots: dict[int, object] = {}
        self.calls: list[tuple] = []

    def activate(self, slot, weights):
        self.calls.append(("activate", slot, weights))
        self.slots[slot] = weights

    def deactivate(self, slot):
        self.calls.append(("deactivate", slot))
        self.slots.pop(slot, None)


def test_the_host_cache_keeps_max_cpu_loras_adapters_least_recently_used_out():
    loads = []

    def load(request):
        if "bad" in request.lora_path:
            raise ValueError(f"adapter {request.lora_name}: no adapter_config.json")
        loads.append(request.lora_int_id)
        return f"weights-{request.lora_int_id}"

    slots = LoRASlots(load, FakeSlots(), max_loras=1, max_cpu_loras=2)
    assert slots.load(adapter(1)) == "weights-1"
    assert slots.load(adapter(2)) == "weights-2"
    assert slots.load(adapter(1)) == "weights-1"
    slots.load(adapter(3))             # drops 2, the least recently used
    assert loads == [1, 2, 3] and slots.loaded == [1, 3]
    slots.load(adapter(2))
    assert loads == [1, 2, 3, 2]
    with pytest.raises(ValueError, match="no adapter_config"):
        slots.load(adapter(4, "/bad"))
    assert 4 not in slots.loaded
    with pytest.raises(ValueError, match="lora_int_id 2 is adapter"):
        slots.load(adapter(2, "/elsewhere"))
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LoRASlots(load, FakeSlots(), max_loras=3, max_cpu_loras=2)


def test_device_slots_evict_the_least_recently_used_adapter_not_in_the_step():
    model = FakeSlots()
    slots = LoRASlots(lambda r: None, model, max_loras=2, max_cpu_loras=4)
    assert slots.assign({1: "w1", 2: "w2"}) == {1: 0, 2: 1}
    assert slots.assign({2: "w2"}) == {2: 1}
    assert slots.assign({1: "w1"}) == {1: 0}          # in its slot already: nothing copied
    assert slots.num_activations == 2
    assert slots.assign({3: "w3", 1: "w1"}) == {3: 1, 1: 0}   # 2 is the one not used
    assert model.calls[-2:] == [("deactivate", 1), ("activate", 1, "w3")]
    assert slots.assign({3: "w3"}) == {3: 1}
    assert slots.assign({4: "w4"}) == {4: 0}            # 1 used before 3
    assert slots.active == {3: 1, 4: 0} and model.slots == {1: "w3", 0: "w4"}
    with pytest.raises(ValueError, match="max_loras"):
        slots.assign({5: "w5", 6: "w6", 7: "w7"})


# -- configuration -----------------------------------------------------------------------------


def test_lora_options_are_checked():
    from rein.engine.config import EngineConfig

    config = EngineConfig(model="m", device="cpu", enable_lora=True, max_loras=2)
    assert config.cpu_lora_capacity == 2
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(model="m", device="cpu", max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be between 1 and 256"):
        EngineConfig(model="m", device="cpu", max_lora_rank=512)
    assert EngineConfig(model="m", device="cpu", enable_lora=True, tensor_parallel_size=2).enable_lora


# -- rein.LLM with adapters, against transformers + PEFT ---------------------------------------

MAX_TOKENS = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 15, 27, 99, 4], [1, 7, 7, 300, 42, 18, 5, 61], [1, 200, 3], [1, 15, 27, 99, 4, 8, 11]]


@pytest.fixture(scope="module")
def lora_setup(tiny_models, tmp_path_factory):
    from lora_support import make_peft_adapter

    model_dir = tiny_models("llama")
    out = tmp_path_factory.mktemp("lora-engine")
    specs = [(ATTENTION, 8, 16), (MLP, 16, 8), (ATTENTION + MLP, 4, 8), (["q_proj", "down_proj"], 8, 32)]
    paths = [make_peft_adapter(model_dir, out / f"adapter{i}", r=r, target_modules=targets, lora_alpha=alpha,
                               seed=10 + i)
             for i, (targets, r, alpha) in enumerate(specs, start=1)]
    adapters = [LoRARequest(f"adapter{i}", i, str(path)) for i, path in enumerate(paths, start=1)]
    return model_dir, adapters, out


def hf_greedy(model_dir, adapter_path, prompt: list[int]) -> list[int]:
    """Greedy tokens of transformers (+ PEFT with `adapter_path`), MAX_TOKENS of them."""
    from lora_support import peft_greedy

    return peft_greedy(model_dir, adapter_path, prompt, MAX_TOKENS)


def make_llm(model_dir, max_loras: int, **kwargs):
    from rein import LLM

    return LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB", max_model_len=128, max_num_seqs=8, block_size=4,
               enable_lora=True, max_loras=max_loras, max_lora_rank=16, **kwargs)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_a_mixed_generate_matches_peft_prompt_by_prompt(lora_setup):
    model_dir, adapters, _ = lora_setup
    llm = make_llm(model_dir, max_loras=2)
    # base and three adapters in one call, more adapters than slots
    plan = [None, adapters[0], adapters[1], None, adapters[2], adapters[0]]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(plan))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=plan)
    references = {}
    for prompt, lora, output in zip(prompts, plan, outputs, strict=True):
        key = (tuple(prompt), lora.lora_int_id if lora else 0)
        if key not in references:
            references[key] = hf_greedy(model_dir, lora.lora_path if lora else None, prompt)
        assert output.error is None
        assert output.outputs[0].token_ids == references[key], key
    # the adapters change the answers (else this test would prove nothing)
    assert len({tuple(o.outputs[0].token_ids) for o, p in zip(outputs, prompts, strict=True) if p == PROMPTS[0]}) > 1


def test_eviction_gives_the_answers_of_enough_slots(lora_setup):
    model_dir, adapters, _ = lora_setup
    plan = [adapters[i % 4] if i % 5 else None for i in range(10)]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(10)]
    few = make_llm(model_dir, max_loras=2)
    many = make_llm(model_dir, max_loras=4)
    got = [o.outputs[0].token_ids for o in few.generate(prompts, GREEDY, use_tqdm=False, lora_request=plan)]
    want = [o.outputs[0].token_ids for o in many.generate(prompts, GREEDY, use_tqdm=False, lora_request=plan)]
    assert got == want
    # again: adapters go in and out of the 2 slots, and the prefixes cached under each (the same
    # prompts under other adapters and the base) are reused by their own adapter's requests only
    again = few.generate(prompts, GREEDY, use_tqdm=False, lora_request=plan)
    assert [o.outputs[0].token_ids for o in again] == want
    assert few.engine.runner.lora.num_activations > 4 and many.engine.runner.lora.num_activations == 4
    assert few.engine.stats.prefix_cache_hits > 0


def test_a_bad_adapter_fails_its_prompt_alone(lora_setup):
    model_dir, adapters, out = lora_setup
    llm = make_llm(model_dir, max_loras=2)
    bad = LoRARequest("missing", 9, str(out / "no-such-adapter"))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], GREEDY, use_tqdm=False,
                           lora_request=[adapters[0], bad, None])
    assert outputs[1].error and "no-such-adapter" in outputs[1].error
    assert outputs[1].outputs[0].token_ids == [] and outputs[1].outputs[0].finish_reason == "abort"
    for output in (outputs[0], outputs[2]):
        assert output.error is None and len(output.outputs[0].token_ids) == MAX_TOKENS
    # the engine itself refuses it as the request's error, and keeps running
    from rein.engine.errors import EngineRequestError

    with pytest.raises(EngineRequestError, match="no-such-adapter") as refused:
        llm.engine.add_request("x", PROMPTS[0], GREEDY, lora_request=bad)
    assert refused.value.param == "lora_request"


def test_an_engine_without_lora_refuses_adapter_requests(lora_setup, tiny_models):
    from rein import LLM
    from rein.engine.errors import EngineRequestError

    model_dir, adapters, _ = lora_setup
    llm = LLM(str(model_dir), device="cpu", kv_cache_memory="16MiB", max_model_len=128)
    with pytest.raises(EngineRequestError, match="without LoRA: start it with enable_lora=True"):
        llm.engine.add_request("x", PROMPTS[0], GREEDY, lora_request=adapters[0])
    outputs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, GREEDY, use_tqdm=False,
                           lora_request=[adapters[0], None])
    assert "enable_lora" in outputs[0].error and len(outputs[1].outputs[0].token_ids) == MAX_TOKENS


def test_run_batch_lines_name_adapters(lora_setup, tmp_path, capsys):
    """`rein run-batch --lora-modules`: a line whose model names an adapter runs under it."""
    import json

    from rein.cli.main import main

    model_dir, adapters, _ = lora_setup
    plan = [("adapter1", adapters[0]), ("base", None), ("adapter2", adapters[1])]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": name, "method": "POST", "url": "/v1/completions", "body": {
        "model": name, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0}}) + "\n" for name, _ in plan))
    modules = ",".join(f"{a.lora_name}={a.lora_path}" for a in adapters[:2])
    code = main(["run-batch", str(src), "-o", str(out), "--model", str(model_dir), "--kv-cache-memory", "16MiB",
                 "--lora-modules", modules, "--no-progress"])
    assert code == 0, capsys.readouterr().err
    answers = {}
    for raw in out.read_text().splitlines():
        line = json.loads(raw)
        body = line["response"]["body"]
        assert body["model"] == line["custom_id"]
        answers[line["custom_id"]] = body["choices"][0]["logprobs"]["tokens"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for name, adapter in plan:
        want = hf_greedy(model_dir, adapter.lora_path if adapter else None, PROMPTS[0])
        assert answers[name] == [tokenizer.decode([t]) for t in want], name
    assert answers["adapter1"] != answers["base"]
    bad = main(["run-batch", str(src), "-o", str(out), "--model", str(model_dir), "--lora-modules", "x"])
    assert bad == 2 and "is not name=path" in capsys.readouterr().err


def test_announced_adapters_are_read_before_their_requests_and_dropped_when_unloaded(lora_setup, tmp_path):
    """LLMEngine.lora_event (the worker's announcements, rein.worker.adapters)."""
    model_dir, adapters, _ = lora_setup
    engine = make_llm(model_dir, max_loras=2).engine
    slots = engine.runner.lora
    engine.lora_event("load", adapters[0])
    assert slots.loaded == [adapters[0].lora_int_id] and slots.num_loads == 1
    engine.add_request("r", PROMPTS[0], GREEDY, lora_request=adapters[0])
    assert slots.num_loads == 1                       # its request found it read
    engine.lora_event("unload", adapters[0])
    assert slots.loaded == []
    engine.lora_event("load", LoRARequest("bad", 99, str(tmp_path / "nowhere")))   # logged, not raised
    assert slots.loaded == []
    finished = []
    while engine.has_unfinished():                  # the request holds its adapter's weights still
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["r"] and finished[0].num_output_tokens == MAX_TOKENS
