"""LoRA adapters under tensor parallelism (issue 44): each rank holds its shard of every adapter,
cut as its layers are (rein.model.lora.sharding), and rank 0's step plans tell the other ranks
which adapter goes in which slot.

First without any process: every rank's shard of the tiny models is loaded (a group that only
says rank and size), and each adapted projection is compared with the one-rank model's --
a column-parallel projection's outputs are the one-rank outputs of the columns its base
weights came from (found from the base outputs, not from rein's sharding), a row-parallel
projection's partial outputs add up to the one-rank output. Then the whole engine: two gloo
ranks generating with several adapters and the base mixed in one batch, more adapters than
slots, give the tokens of one rank and logprobs within 1e-4. SmolLM2 over three ranks is in
tests/real/test_smollm2_lora_tensor_parallel.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lora_support import make_peft_adapter

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.model.architectures.linear import Linear
from rein.model.files import resolve_model
from rein.model.loader import load_model
from rein.model.lora import LoRARequest, enable_lora, load_peft_adapter
from rein.model.spec import ModelSpec

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
WORLD_SIZE = 2
MAX_RANK = 16
TOLERANCE = 1e-4
LOGPROB_TOLERANCE = 1e-4


def adapters_in(model_dir, out) -> list[LoRARequest]:
    """Three adapters: attention at rank 8, MLP at rank 16 (rsLoRA), a few of each at rank 4 with
    a rank_pattern; with weights large enough to change the greedy tokens."""
    specs = [
        dict(r=8, target_modules=ATTENTION, lora_alpha=16),
        dict(r=16, target_modules=MLP, lora_alpha=8, use_rslora=True),
        dict(r=4, target_modules=["k_proj", "v_proj", "up_proj", "down_proj"], lora_alpha=8,
             rank_pattern={"down_proj": 2}),
    ]
    return [LoRARequest(f"adapter{i}", i, str(make_peft_adapter(model_dir, out / f"adapter{i}", seed=20 + i,
                                                                   weight_std=0.1, **spec)))
            for i, spec in enumerate(specs, start=1)]


@pytest.fixture(scope="module")
def setup(tiny_models, tmp_path_factory):
    model_dir = tiny_models("llama")
    return model_dir, adapters_in(model_dir, tmp_path_factory.mktemp("lora-tp"))


# -- each rank's shard of an adapter, without processes ------------------------------------------


def load_shard(model_dir, rank: int, world_size: int):
    files = resolve_model(str(model_dir))
    spec = ModelSpec.from_dir(files.directory)
    group = SimpleNamespace(rank=rank, world_size=world_size)
    return load_model(files, spec, 64, torch.float32, torch.device("cpu"), group=group), spec


def projection_outputs(model, spec, adapter: LoRARequest, inputs: dict[str, torch.Tensor], adapted: bool
                       ) -> dict[str, torch.Tensor]:
    """Each adapted projection's output for its input (with the adapter in slot 0, or the base)."""
    lora = enable_lora(model, max_loras=1, max_rank=MAX_RANK, device="cpu", dtype=torch.float32)
    lora.activate(0, load_peft_adapter(adapter.lora_path, model, spec, MAX_RANK, None))
    outputs = {}
    with torch.inference_mode():
        for path, x in inputs.items():
            with lora.step(torch.full((x.shape[0],), 0 if adapted else -1)):
                outputs[path] = model.get_submodule(path)(x)
    lora.deactivate(0)
    return outputs


# Four ranks over the tiny llama's two KV heads replicate them (rein.model.parallel.layers): the
# ranks sharing a KV head each keep its k and v adapter rows.
@pytest.mark.parametrize(("arch", "world_size"), [("llama", WORLD_SIZE), ("qwen2_moe", WORLD_SIZE), ("llama", 4)])
def test_each_ranks_shard_adds_what_one_rank_adds(arch, world_size, tiny_models, tmp_path_factory):
    model_dir = tiny_models(arch)
    out = tmp_path_factory.mktemp(f"lora-shards-{arch}")
    adapter = LoRARequest("all", 1, str(make_peft_adapter(model_dir, out / "all", r=8, target_modules=ATTENTION + MLP,
                                                          lora_alpha=16, seed=5, weight_std=0.1)))
    whole, spec = load_shard(model_dir, 0, 1)
    shards = [load_shard(model_dir, rank, world_size)[0] for rank in range(world_size)]
    paths = [name for name, module in whole.named_modules()
             if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in
             ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    assert any("shared_expert" in p for p in paths) == (arch == "qwen2_moe")
    generator = torch.Generator().manual_seed(0)
    inputs = {p: torch.randn(6, whole.get_submodule(p).in_features, generator=generator) for p in paths}
    want = projection_outputs(whole, spec, adapter, inputs, adapted=True)
    want_base = projection_outputs(whole, spec, adapter, inputs, adapted=False)
    for path in paths:
        assert (want[path] - want_base[path]).abs().max() > 0.05, f"{path}: the adapter changes nothing"
    row_sums = {p: 0.0 for p in paths if p.endswith(("o_proj", "down_proj"))}
    row_base_sums = dict(row_sums)
    for rank, shard in enumerate(shards):
        local_inputs = {}
        for path in paths:
            width = shard.get_submodule(path).in_features
            local_inputs[path] = inputs[path] if path not in row_sums else inputs[path][:, rank * width:(rank + 1) * width]
        got = projection_outputs(shard, spec, adapter, local_inputs, adapted=True)
        base = projection_outputs(shard, spec, adapter, local_inputs, adapted=False)
        for path in paths:
            if path in row_sums:
                row_sums[path] = row_sums[path] + got[path]
                row_base_sums[path] = row_base_sums[path] + base[path]
                continue
            # The one-rank column each of this rank's columns is: the one whose base output matches.
            distance = (base[path].T[:, None, :] - want_base[path].T[None, :, :]).abs().amax(-1)
            columns = distance.argmin(1)
            assert distance.min(1).values.max() < 1e-5 and len(set(columns.tolist())) == len(columns)
            error = (got[path] - want[path][:, columns]).abs().max().item()
            assert error < TOLERANCE, f"rank {rank} {path}: off one rank's columns by {error:.2e}"
    for path in row_sums:
        assert (row_base_sums[path] - want_base[path]).abs().max() < TOLERANCE   # the inputs are split right
        error = (row_sums[path] - want[path]).abs().max().item()
        assert error < TOLERANCE, f"{path}: the ranks' partial sums are off one rank by {error:.2e}"


# -- the engine over two ranks ---------------------------------------------------------------------


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 2000, (n,), generator=generator).tolist() for n in (5, 9, 3, 12)]


def run_engine(model_dir, adapters: list[LoRARequest], tensor_parallel_size: int) -> tuple[dict, dict, LLMEngine]:
    """Greedy tokens and logprobs by (prompt index, adapter id or 0, request index)."""
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), device="cpu", tensor_parallel_size=tensor_parallel_size, max_model_len=128,
        max_num_seqs=8, kv_cache_memory="4MiB", block_size=4, enable_lora=True, max_loras=2,
        max_lora_rank=MAX_RANK))
    # The base and three adapters in one batch, more adapters than slots: adapters go in and out
    # of the two slots while the others run; after the first wave, each adapter once more (two of
    # them in slots already). Each adapted prompt also runs on the base.
    a1, a2, a3 = adapters
    waves = [[(0, a1), (0, None), (1, a2), (1, None), (2, a3), (2, None)], [(3, a1), (3, a3), (3, None), (3, a2)]]
    tokens: dict[tuple, list[int]] = {}
    logprobs: dict[tuple, list] = {}
    keys = {}
    try:
        for wave in waves:
            for prompt, lora in wave:
                request_id = f"r{len(keys)}"
                keys[request_id] = (prompt, lora.lora_int_id if lora else 0, len(keys))
                params = SamplingParams(max_tokens=8 + len(keys), temperature=0, ignore_eos=True, logprobs=2)
                engine.add_request(request_id, prompts()[prompt], params, lora_request=lora)
            while engine.has_unfinished():
                for out in engine.step():
                    key = keys[out.request_id]
                    tokens.setdefault(key, []).extend(out.new_token_ids)
                    logprobs.setdefault(key, []).extend(out.logprobs or [])
    finally:
        engine.close()
    return tokens, logprobs, engine


def test_two_ranks_generate_with_adapters_what_one_rank_does(setup):
    model_dir, adapters = setup
    one_tokens, one_logprobs, one = run_engine(model_dir, adapters, 1)
    two_tokens, two_logprobs, two = run_engine(model_dir, adapters, WORLD_SIZE)
    assert two_tokens == one_tokens and len(one_tokens) == 10
    worst = 0.0
    for key, entries in one_logprobs.items():
        assert len(entries) == len(one_tokens[key])
        for a, b in zip(entries, two_logprobs[key], strict=True):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            worst = max(worst, abs(a.logprob - b.logprob),
                        *(abs(p - q) for (_, p), (_, q) in zip(a.top, b.top, strict=True)))
    assert worst < LOGPROB_TOLERANCE, f"logprobs differ by up to {worst:.2e}"
    # Each adapter changes its prompt's answer from the base's (else equal answers would prove
    # nothing), and the two slots were reused: more adapters put in slots than there are.
    base = {prompt: ids for (prompt, lora_id, _), ids in one_tokens.items() if lora_id == 0}
    for (prompt, lora_id, _), ids in one_tokens.items():
        if lora_id and prompt in base:
            assert ids[:8] != base[prompt][:8], f"adapter {lora_id} answers prompt {prompt} as the base does"
    assert two.runner.lora.num_activations == one.runner.lora.num_activations > len(adapters)


# -- the other ranks' slots ------------------------------------------------------------------------


class RecordingSlots:
    def __init__(self) -> None:
        self.slots: dict[int, object] = {}

    def activate(self, slot, weights):
        self.slots[slot] = weights

    def deactivate(self, slot):
        self.slots.pop(slot, None)


def test_a_follower_places_each_adapter_where_rank_zero_assigned_it():
    from rein.engine.lora_slots import LoRASlots

    def load(request):
        return f"{request.lora_int_id}@{request.lora_path}"

    def adapter(lora_id, path=None):
        return LoRARequest(f"a{lora_id}", lora_id, path or f"/adapters/{lora_id}")

    leader_model, follower_model = RecordingSlots(), RecordingSlots()
    leader = LoRASlots(load, leader_model, max_loras=2, max_cpu_loras=2)
    follower = LoRASlots(load, follower_model, max_loras=2, max_cpu_loras=2)
    for step in ([1, 2], [2], [3, 2], [1], [1, 3]):
        held = leader.active
        slot_of = leader.assign({i: leader.load(adapter(i)) for i in step})
        for lora_id, slot in slot_of.items():
            if held.get(lora_id) != slot:
                follower.place(slot, adapter(lora_id))
        assert follower_model.slots == leader_model.slots and follower.active == leader.active
    assert follower.num_activations == leader.num_activations == 5
    # Adapter 1's id now names another directory (rank 0 accepted it after 1 left its cache):
    # the follower reads it again rather than refusing what rank 0 runs.
    follower.place(0, adapter(1, "/adapters/new"))
    assert follower_model.slots[0] == "1@/adapters/new"
    with pytest.raises(ValueError, match="out of range"):
        follower.place(2, adapter(4))


def test_a_rank_that_cannot_read_an_adapter_fails_the_step_saying_why(setup, tmp_path):
    import shutil

    from rein.engine.rank_processes import RankDiedError

    model_dir, adapters = setup
    copy = LoRARequest("gone", 7, str(shutil.copytree(adapters[0].lora_path, tmp_path / "gone")))
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", tensor_parallel_size=WORLD_SIZE,
                                    max_model_len=128, kv_cache_memory="4MiB", enable_lora=True, max_loras=2,
                                    max_lora_rank=MAX_RANK))
    try:
        engine.add_request("a", prompts()[0], SamplingParams(max_tokens=4, temperature=0), lora_request=copy)
        shutil.rmtree(copy.lora_path)   # rank 0 read it when the request came; rank 1 reads it at its first step
        with pytest.raises(RankDiedError, match="rank 1 .*gone does not exist"):
            engine.step()
    finally:
        engine.close()
