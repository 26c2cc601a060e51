"""LoRA on the model: PEFT adapters loaded onto rein's native models (rein.model.lora.adapters)
and run per token inside one forward (rein.model.lora.layers), compared with transformers +
PEFT row by row; and every adapter rein refuses, refused with a message that says why."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lora_support import make_peft_adapter, peft_logits

from rein.model.attention import AttentionMetadata, LayerCache
from rein.model.files import resolve_model
from rein.model.loader import load_model
from rein.model.lora import AdapterError, LoRAModel, enable_lora, load_peft_adapter
from rein.model.spec import ModelSpec

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "mixtral")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
MAX_RANK = 64
BLOCK = 8
LENGTHS = (7, 5, 9, 6, 4)
TOLERANCE = 1e-4


def mlp_targets(arch: str) -> list[str]:
    # transformers' MoE experts are fused parameters (no per-expert Linear for PEFT to wrap);
    # qwen2_moe's shared expert is a plain MLP, mixtral has none.
    return ["o_proj"] if arch == "mixtral" else MLP


def adapters_for(arch: str, model_dir: Path, out: Path) -> dict[str, Path]:
    """Three adapters: attention-only rank 8; MLP-only rank 16 rsLoRA; everything at rank 64
    with rank_pattern / alpha_pattern overrides."""
    return {
        "attn8": make_peft_adapter(model_dir, out / "attn8", r=8, target_modules=ATTENTION, lora_alpha=16, seed=1),
        "mlp16": make_peft_adapter(model_dir, out / "mlp16", r=16, target_modules=mlp_targets(arch), lora_alpha=8,
                                   use_rslora=True, seed=2),
        "all64": make_peft_adapter(model_dir, out / "all64", r=MAX_RANK, target_modules=ATTENTION + mlp_targets(arch),
                                   lora_alpha=32, seed=3,
                                   rank_pattern={"o_proj": 4, "layers.1.self_attn.q_proj": 32},
                                   alpha_pattern={"v_proj": 64}),
    }


def load_rein(model_dir: Path, quantization: str = "auto"):
    files = resolve_model(str(model_dir))
    spec = ModelSpec.from_dir(files.directory)
    return load_model(files, spec, 256, torch.float32, torch.device("cpu"), quantization=quantization), spec


def sequences(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def prefill(model, spec: ModelSpec, seqs: list[list[int]], lora: LoRAModel | None = None,
            slots: list[int] | None = None) -> list[torch.Tensor]:
    """Every sequence's logits [len, vocab] from one prefill step of all of them (token t of
    sequence i under the adapter in slots[i])."""
    blocks = [-(-len(s) // BLOCK) for s in seqs]
    kv_heads = spec.num_kv_heads
    shape = (sum(blocks), BLOCK, kv_heads, spec.head_dim)
    caches = [LayerCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    width = max(blocks)
    tables, first = [], 0
    for n in blocks:
        tables.append(list(range(first, first + n)) + [0] * (width - n))
        first += n
    ids, positions, slot_mapping, token_slots, offsets = [], [], [], [], [0]
    for i, seq in enumerate(seqs):
        ids += seq
        positions += range(len(seq))
        slot_mapping += [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(len(seq))]
        token_slots += [slots[i] if slots else -1] * len(seq)
        offsets.append(offsets[-1] + len(seq))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping), num_decode_tokens=0, decode_block_tables=None,
        decode_context_lens=None, decode_groups=None,
        prefill_block_tables=torch.tensor(tables, dtype=torch.int32),
        prefill_cu_seqlens_q=torch.tensor(offsets, dtype=torch.int32),
        prefill_context_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32))
    with torch.inference_mode():
        if lora is None:
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
        else:
            with lora.step(torch.tensor(token_slots)):
                hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
        logits = model.compute_logits(hidden).float()
    return [logits[offsets[i]:offsets[i + 1]].clone() for i in range(len(seqs))]


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    error = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert error <= tolerance, f"{what}: relative error {error:.2e} above {tolerance:.0e}"


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tiny_models, tmp_path_factory):
    arch = request.param
    model_dir = tiny_models(arch)
    adapters = adapters_for(arch, model_dir, tmp_path_factory.mktemp(f"lora-{arch}"))
    model, spec = load_rein(model_dir)
    seqs = sequences(spec.vocab_size)
    reference = {name: [peft_logits(model_dir, path, s) for s in seqs] for name, path in adapters.items()}
    reference[None] = [peft_logits(model_dir, None, s) for s in seqs]
    return SimpleNamespace(arch=arch, model_dir=model_dir, adapters=adapters, model=model, spec=spec, seqs=seqs,
                           reference=reference)


def load(case, name: str, max_rank: int = MAX_RANK):
    return load_peft_adapter(case.adapters[name], case.model, case.spec, max_rank, str(case.model_dir))


def test_a_mixed_batch_matches_peft_row_by_row(case):
    lora = enable_lora(case.model, max_loras=3, max_rank=MAX_RANK, device="cpu", dtype=torch.float32)
    names = ["attn8", "mlp16", "all64"]
    for slot, name in enumerate(names):
        lora.activate(slot, load(case, name))
    try:
        # Sequences under attn8, the base, mlp16, all64, attn8 again: every kind of row in one forward.
        plan = ["attn8", None, "mlp16", "all64", "attn8"]
        slots = [names.index(n) if n else -1 for n in plan]
        got = prefill(case.model, case.spec, case.seqs, lora, slots)
        for i, name in enumerate(plan):
            assert_close(got[i], case.reference[name][i], f"{case.arch} sequence {i} under {name}")
            if name is not None:   # the adapter really changes the logits
                assert (case.reference[name][i] - case.reference[None][i]).abs().max() > 1e-2
        # One adapter for the whole step (no row gathering), and the base outside any step.
        got = prefill(case.model, case.spec, case.seqs, lora, [2] * len(case.seqs))
        for i in range(len(case.seqs)):
            assert_close(got[i], case.reference["all64"][i], f"{case.arch} sequence {i} all under all64")
        for i, logits in enumerate(prefill(case.model, case.spec, case.seqs)):
            assert_close(logits, case.reference[None][i], f"{case.arch} sequence {i} without a step")
    finally:
        for slot in range(3):
            lora.deactivate(slot)


def test_slots_evicted_and_reused_give_the_same_results(case):
    lora = enable_lora(case.model, max_loras=2, max_rank=MAX_RANK, device="cpu", dtype=torch.float32)
    attn8, mlp16, all64 = load(case, "attn8"), load(case, "mlp16"), load(case, "all64")
    lora.activate(0, attn8)
    lora.activate(1, mlp16)
    first = prefill(case.model, case.spec, case.seqs, lora, [0, 1, -1, 0, 1])
    lora.deactivate(0)
    lora.activate(0, all64)                 # slot 0 now another adapter
    second = prefill(case.model, case.spec, case.seqs, lora, [0, 1, -1, 0, 1])
    lora.activate(1, attn8)                 # replaces mlp16 in place
    third = prefill(case.model, case.spec, case.seqs, lora, [1, 0, -1, 1, 0])
    for slot in (0, 1):
        lora.deactivate(slot)
    lora.deactivate(1)                      # emptying an empty slot does nothing
    assert not any(getattr(m, "lora", None) for m in case.model.modules())
    base = prefill(case.model, case.spec, case.seqs)
    ref = case.reference
    for i, (a, b, c) in enumerate(zip(["attn8", "mlp16", None, "attn8", "mlp16"],
                                      ["all64", "mlp16", None, "all64", "mlp16"],
                                      ["attn8", "all64", None, "attn8", "all64"], strict=True)):
        assert_close(first[i], ref[a][i], f"first, sequence {i}")
        assert_close(second[i], ref[b][i], f"after eviction, sequence {i}")
        assert_close(third[i], ref[c][i], f"after replacement, sequence {i}")
        assert_close(base[i], ref[None][i], f"after deactivating all, sequence {i}")


def test_slot_errors(case):
    lora = enable_lora(case.model, max_loras=1, max_rank=8, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="--max-loras"):
        lora.activate(1, load(case, "attn8"))
    with pytest.raises(ValueError, match="--max-lora-rank 16"):
        lora.activate(0, load(case, "mlp16"))
    with pytest.raises(ValueError, match="hold no adapter"):
        with lora.step(torch.tensor([0, -1])):
            pass


# -- refusals (on llama) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory):
    model_dir = tiny_models("llama")
    out = tmp_path_factory.mktemp("lora-errors")
    model, spec = load_rein(model_dir)
    adapter = make_peft_adapter(model_dir, out / "good", r=8, target_modules=ATTENTION + MLP, seed=4)
    return SimpleNamespace(model_dir=model_dir, model=model, spec=spec, adapter=adapter, out=out)


def copy_adapter(llama, tmp_path: Path) -> Path:
    return Path(shutil.copytree(llama.adapter, tmp_path / "adapter"))


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def rename_tensors(path: Path, old: str, new: str) -> Path:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k.replace(old, new): v for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def refused(llama, path: Path, match: str, max_rank: int = MAX_RANK, expected_base: str | None = None,
            **kwargs) -> None:
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter(path, llama.model, llama.spec, max_rank, expected_base, **kwargs)


def test_a_good_adapter_loads_with_its_rein_modules(llama):
    weights = load_peft_adapter(llama.adapter, llama.model, llama.spec, 8, str(llama.model_dir))
    assert weights.rank == 8
    by_module = weights.by_module()
    q_size, kv_size = 4 * 16, 2 * 16
    qkv = sorted((t.start, t.stop) for t in by_module["layers.0.self_attn.qkv_proj"])
    assert qkv == [(0, q_size), (q_size, q_size + kv_size), (q_size + kv_size, q_size + 2 * kv_size)]
    assert sorted((t.start, t.stop) for t in by_module["layers.1.mlp.gate_up_proj"]) == [(0, 128), (128, 256)]
    assert {t.layer for t in weights.targets} == {0, 1}
    assert len(weights.targets) == 2 * 7


def test_rank_above_the_maximum(llama):
    refused(llama, llama.adapter, r"rank 8 .*--max-lora-rank 8", max_rank=4)


def test_a_module_the_model_does_not_have(llama, tmp_path):
    path = rename_tensors(copy_adapter(llama, tmp_path), "layers.1.", "layers.7.")
    refused(llama, path, "model.layers.7.* has no projection for")


def test_moe_experts(llama, tmp_path):
    path = rename_tensors(copy_adapter(llama, tmp_path), "layers.1.mlp.gate_proj", "layers.1.mlp.experts.0.gate_proj")
    refused(llama, path, "MoE experts")
    refused(llama, edit_config(copy_adapter(llama, tmp_path / "p"), target_parameters=["mlp.experts.gate_up_proj"]),
            "target_parameters")


def test_shapes_of_another_base(llama, tiny_models, tmp_path):
    # qwen3's q_proj gives 4 heads x 32, llama's 4 x 16: same input width, other output.
    other = make_peft_adapter(tiny_models("qwen3"), tmp_path / "qwen3", r=8, target_modules=["q_proj"])
    refused(llama, other, r"gives 64 outputs.*trained on another base", check_base=False)


def test_missing_and_damaged_files(llama, tmp_path):
    refused(llama, tmp_path / "nowhere", "does not exist")
    path = copy_adapter(llama, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    refused(llama, path, "damaged or incomplete")
    (path / "adapter_model.safetensors").unlink()
    refused(llama, path, "has no adapter_model.safetensors")
    (path / "adapter_config.json").write_text("{not json")
    refused(llama, path, "not valid JSON")
    (path / "adapter_config.json").unlink()
    refused(llama, path, "adapter_config.json is missing")


def test_a_pytorch_bin_adapter_loads_as_safetensors_does(llama, tmp_path):
    from safetensors.torch import load_file

    path = copy_adapter(llama, tmp_path)
    torch.save(load_file(str(path / "adapter_model.safetensors")), path / "adapter_model.bin")
    (path / "adapter_model.safetensors").unlink()
    got = load_peft_adapter(path, llama.model, llama.spec, 8, None)
    want = load_peft_adapter(llama.adapter, llama.model, llama.spec, 8, None)
    for a, b in zip(got.targets, want.targets, strict=True):
        assert a.module == b.module and torch.equal(a.lora_b, b.lora_b)


@pytest.mark.parametrize(("change", "match"), [
    ({"use_dora": True}, "DoRA"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"bias": "all"}, "bias='none'"),
    ({"lora_bias": True}, "lora_bias=False"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "IA3"),
])
def test_unsupported_features(llama, tmp_path, change, match):
    refused(llama, edit_config(copy_adapter(llama, tmp_path), **change), match)


@pytest.mark.parametrize("target", ["embed_tokens", "lm_head"])
def test_embedding_and_head_targets(llama, tmp_path, target):
    path = make_peft_adapter(llama.model_dir, tmp_path / target, r=4, target_modules=[target])
    refused(llama, path, "embedding")


def test_base_model_check(llama):
    refused(llama, llama.adapter, "was trained on .* not on the served model 'org/other'",
            expected_base="org/other")
    load_peft_adapter(llama.adapter, llama.model, llama.spec, 8, "org/other", check_base=False)
    load_peft_adapter(llama.adapter, llama.model, llama.spec, 8, str(llama.model_dir) + "/")
    load_peft_adapter(llama.adapter, llama.model, llama.spec, 8, f"someorg/{llama.model_dir.name}")


def test_the_transformers_backend_is_refused(llama):
    # (Tensor parallelism is served: tests/unit/test_lora_tensor_parallel.py.)
    with pytest.raises(AdapterError, match="Transformers backend"):
        load_peft_adapter(llama.adapter, llama.model, replace(llama.spec, family="transformers"), 8, None)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def test_a_quantized_base_takes_float_adapters(llama):
    """int8 weights (quantized_linear) with float adapters: off PEFT's float logits by no more
    than the int8 base alone is off the float base."""
    model, spec = load_rein(llama.model_dir, quantization="int8")
    assert any(getattr(m, "quantized", None) is not None for m in model.modules())
    seqs = sequences(spec.vocab_size)
    lora = enable_lora(model, max_loras=1, max_rank=8, device="cpu", dtype=torch.float32)
    lora.activate(0, load_peft_adapter(llama.adapter, model, spec, 8, None))
    got = prefill(model, spec, seqs, lora, [0, -1, 0, -1, 0])
    for i, seq in enumerate(seqs):
        base = prefill(model, spec, [seq])[0]
        base_error = relative_error(base, peft_logits(llama.model_dir, None, seq))
        if i % 2 == 0:   # the adapter's effect stands well above the int8 error
            assert relative_error(got[i], base) > 2 * (3 * base_error + 1e-3)
        want = peft_logits(llama.model_dir, llama.adapter if i % 2 == 0 else None, seq)
        assert relative_error(got[i], want) <= 3 * base_error + 1e-3, f"sequence {i}"
        assert base_error < 0.05
