"""LoRA adapters in llama.cpp's GGUF form (rein.model.lora.gguf_adapter): a PEFT adapter written
as convert_lora_to_gguf.py writes it (tests/lora_support.py's peft_to_gguf) gives rein the
same weights, and the same logits as transformers + PEFT on that PEFT adapter; and every GGUF
rein refuses, refused with a message that says why."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lora_support import make_peft_adapter, peft_logits, peft_to_gguf
from test_lora_model import assert_close, load_rein, prefill, sequences

from rein.model.lora import AdapterError, enable_lora, load_peft_adapter

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
MAX_RANK = 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, tiny_models, tmp_path_factory):
    """Two adapters (attention at rank 8; everything at rank 16 with o_proj at rank 4), each as
    PEFT wrote it and as llama.cpp's converter would, on llama (q/k rows reordered by the
    converter) and qwen2 (not)."""
    arch = request.param
    model_dir = tiny_models(arch)
    out = tmp_path_factory.mktemp(f"lora-gguf-{arch}")
    peft = {
        "attn8": make_peft_adapter(model_dir, out / "attn8", r=8, target_modules=ATTENTION, lora_alpha=16, seed=5),
        "all16": make_peft_adapter(model_dir, out / "all16", r=16, target_modules=ATTENTION + MLP, lora_alpha=8,
                                   seed=6, rank_pattern={"o_proj": 4}),
    }
    ggufs = {name: peft_to_gguf(path, model_dir, out / f"{name}.gguf") for name, path in peft.items()}
    model, spec = load_rein(model_dir)
    return SimpleNamespace(arch=arch, model_dir=model_dir, out=out, peft=peft, ggufs=ggufs, model=model, spec=spec)


def load(case, path: Path, max_rank: int = MAX_RANK):
    return load_peft_adapter(path, case.model, case.spec, max_rank, str(case.model_dir))


def test_the_gguf_gives_the_peft_adapters_weights(case):
    for name in case.peft:
        got, want = load(case, case.ggufs[name]), load(case, case.peft[name])
        assert got.rank == want.rank and len(got.targets) == len(want.targets)
        for a, b in zip(*(sorted(w.targets, key=lambda t: (t.module, t.start)) for w in (got, want)), strict=True):
            assert (a.module, a.layer, a.start, a.stop) == (b.module, b.layer, b.start, b.stop)
            torch.testing.assert_close(a.lora_a, b.lora_a, rtol=0, atol=0)
            torch.testing.assert_close(a.lora_b, b.lora_b, rtol=1e-6, atol=1e-7)


def test_the_converter_reorders_llamas_q_and_k_rows_of_b(case):
    """What the loader undoes: the file's B of attn_q is PEFT's with its rows reordered (llama), or
    PEFT's as it is (qwen2), so the weights test above fails if the loader gets this wrong."""
    from gguf import GGUFReader
    from safetensors.torch import load_file

    stored = {t.name: np.array(t.data) for t in GGUFReader(str(case.ggufs["attn8"])).tensors}
    peft = load_file(str(case.peft["attn8"] / "adapter_model.safetensors"))
    for proj, short in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v")):
        want = peft[f"base_model.model.model.layers.0.self_attn.{proj}.lora_B.weight"].numpy()
        file_b = stored[f"blk.0.{short}.weight.lora_b"]
        assert file_b.shape == want.shape
        reordered = case.arch == "llama" and proj != "v_proj"
        assert np.array_equal(file_b, want) != reordered, proj
        assert np.array_equal(np.sort(file_b, axis=None), np.sort(want, axis=None))


def test_a_mixed_batch_matches_peft(case):
    """Both GGUF adapters and the base in one forward, row by row against transformers + PEFT
    on the PEFT adapters."""
    seqs = sequences(case.spec.vocab_size)
    lora = enable_lora(case.model, max_loras=2, max_rank=MAX_RANK, device="cpu", dtype=torch.float32)
    lora.activate(0, load(case, case.ggufs["attn8"]))
    lora.activate(1, load(case, case.ggufs["all16"]))
    try:
        plan = ["attn8", None, "all16", "all16", "attn8"]
        got = prefill(case.model, case.spec, seqs, lora, [{"attn8": 0, "all16": 1}.get(n, -1) for n in plan])
    finally:
        lora.deactivate(0)
        lora.deactivate(1)
    for i, name in enumerate(plan):
        want = peft_logits(case.model_dir, case.peft[name] if name else None, seqs[i])
        assert_close(got[i], want, f"{case.arch} sequence {i} under {name}")
        if name is not None:
            assert (want - peft_logits(case.model_dir, None, seqs[i])).abs().max() > 1e-2


# -- refusals (on llama) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_models, tmp_path_factory):
    model_dir = tiny_models("llama")
    out = tmp_path_factory.mktemp("lora-gguf-errors")
    model, spec = load_rein(model_dir)
    adapter = make_peft_adapter(model_dir, out / "good", r=8, target_modules=ATTENTION + MLP, seed=7)
    return SimpleNamespace(model_dir=model_dir, model=model, spec=spec, adapter=adapter, out=out)


def refused(llama, path: Path, match: str, max_rank: int = MAX_RANK) -> None:
    with pytest.raises(AdapterError, match=match):
        load_peft_adapter(path, llama.model, llama.spec, max_rank, None)


def converted(llama, tmp_path: Path, **kwargs) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return peft_to_gguf(llama.adapter, llama.model_dir, tmp_path / "adapter.gguf", **kwargs)


@pytest.mark.parametrize(("outtype", "tolerance"), [("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 8e-3)])
def test_16_bit_and_q8_0_tensors(llama, tmp_path, outtype, tolerance):
    path = converted(llama, tmp_path, outtype=outtype)
    if outtype == "q8_0":   # the converter's q8_0: A's rows (64 wide) in blocks, B's (8) in f16
        from gguf import GGMLQuantizationType, GGUFReader

        kinds = {t.name.rsplit(".", 1)[-1]: t.tensor_type for t in GGUFReader(str(path)).tensors}
        assert kinds == {"lora_a": GGMLQuantizationType.Q8_0, "lora_b": GGMLQuantizationType.F16}
    got = load_peft_adapter(path, llama.model, llama.spec, MAX_RANK, None)
    want = load_peft_adapter(llama.adapter, llama.model, llama.spec, MAX_RANK, None)
    for a, b in zip(*(sorted(w.targets, key=lambda t: (t.module, t.start)) for w in (got, want)), strict=True):
        assert a.module == b.module and a.lora_a.dtype == torch.float32
        for x, y in ((a.lora_a, b.lora_a), (a.lora_b, b.lora_b)):
            error = (x - y).abs().max().item() / y.abs().max().item()
            assert 0 < error <= tolerance, (a.module, error)


def test_a_directory_holding_one_gguf(llama, tmp_path):
    folder = tmp_path / "adapter"
    folder.mkdir()
    converted(llama, folder, outtype="f16")
    weights = load_peft_adapter(folder, llama.model, llama.spec, MAX_RANK, None)
    assert weights.name == "adapter" and weights.rank == 8 and len(weights.targets) == 2 * 7
    shutil.copy(folder / "adapter.gguf", folder / "copy.gguf")
    refused(llama, folder, "holds 2 GGUF files")
    # a PEFT directory that also holds a converted file is read as PEFT (f32 there, not the f16 file)
    peft = Path(shutil.copytree(llama.adapter, tmp_path / "peft"))
    shutil.copy(folder / "adapter.gguf", peft / "adapter.gguf")
    got = load_peft_adapter(peft, llama.model, llama.spec, MAX_RANK, None)
    want = load_peft_adapter(llama.adapter, llama.model, llama.spec, MAX_RANK, None)
    assert all(torch.equal(a.lora_b, b.lora_b) for a, b in zip(got.targets, want.targets, strict=True))


def test_a_base_model_file(llama, tmp_path):
    refused(llama, converted(llama, tmp_path, extra={"general.type": None}), "is a model, not a LoRA adapter")
    refused(llama, converted(llama, tmp_path, extra={"general.type": "model"}), "is a model, not a LoRA adapter")


def test_an_adapter_of_another_kind(llama, tmp_path):
    refused(llama, converted(llama, tmp_path, extra={"adapter.type": "control_vector"}),
            "'control_vector' adapter .*LoRA adapters only")


def test_another_architecture(llama, tmp_path):
    refused(llama, converted(llama, tmp_path, architecture="qwen2"),
            "architecture 'qwen2' .* served model \\(LlamaForCausalLM\\) is 'llama'")


def test_rank_above_the_maximum(llama, tmp_path):
    refused(llama, converted(llama, tmp_path), r"rank 8 .*--max-lora-rank 8 or more", max_rank=4)


def test_tensors_rein_does_not_apply(llama, tmp_path):
    norm = np.ones(64, dtype=np.float32)
    refused(llama, converted(llama, tmp_path, tensors={"blk.0.attn_norm.weight": norm}),
            "blk.0.attn_norm.weight.*plain LoRA")
    a, b = np.zeros((4, 64), np.float32), np.zeros((256, 4), np.float32)
    refused(llama, converted(llama, tmp_path / "e", tensors={"token_embd.weight.lora_a": a,
                                                             "token_embd.weight.lora_b": b}),
            "token_embd.weight .*embedding")
    refused(llama, converted(llama, tmp_path / "l", tensors={"blk.7.attn_q.weight.lora_a": a,
                                                             "blk.7.attn_q.weight.lora_b": b[:64]}),
            "blk.7.attn_q.weight, which the served model .* has no projection for")
    refused(llama, converted(llama, tmp_path / "m", tensors={"blk.1.attn_output.weight.lora_c": a}),
            "blk.1.attn_output.weight.lora_c")


def test_a_missing_half_and_wrong_shapes(llama, tmp_path):
    path = converted(llama, tmp_path, tensors={"blk.1.attn_q.weight.lora_b": np.zeros((64, 4), np.float32)})
    refused(llama, path, r"lora_a \(8, 64\) and .lora_b \(64, 4\) .* do not share a rank")
    path = converted(llama, tmp_path / "s", tensors={"blk.1.attn_q.weight.lora_b": np.zeros((32, 8), np.float32)})
    refused(llama, path, r"model.layers.1.self_attn.q_proj has lora_A \(8, 64\) and lora_B \(32, 8\).*gives 64 "
                         r"outputs")
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "half.gguf"), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 8.0)
    writer.add_tensor("blk.0.attn_v.weight.lora_a", np.zeros((8, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    refused(llama, tmp_path / "half.gguf", "blk.0.attn_v.weight has no .lora_b tensor")


def test_a_damaged_file(llama, tmp_path):
    path = converted(llama, tmp_path)
    path.write_bytes(path.read_bytes()[:-100])
    refused(llama, path, "truncated or damaged")


def rewritten(source: Path, out: Path, alpha: float) -> Path:
    """`source` with another adapter.lora.alpha."""
    import gguf

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for tensor in gguf.GGUFReader(str(source)).tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_the_scaling_is_llama_cpps(llama, tmp_path):
    """alpha / r (alpha 16, r 8 here: 2), and alpha 0 (llama.cpp's "no alpha") a scale of 1."""
    path = converted(llama, tmp_path)
    scaled = load_peft_adapter(path, llama.model, llama.spec, MAX_RANK, None)
    peft = load_peft_adapter(llama.adapter, llama.model, llama.spec, MAX_RANK, None)
    plain = load_peft_adapter(rewritten(path, tmp_path / "alpha0.gguf", 0.0), llama.model, llama.spec, MAX_RANK,
                              None)
    halved = load_peft_adapter(rewritten(path, tmp_path / "alpha8.gguf", 8.0), llama.model, llama.spec, MAX_RANK,
                               None)
    in_order = [sorted(w.targets, key=lambda t: (t.module, t.start)) for w in (scaled, peft, plain, halved)]
    for a, b, c, d in zip(*in_order, strict=True):
        torch.testing.assert_close(a.lora_b, b.lora_b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c.lora_b * 2, a.lora_b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(d.lora_b * 2, a.lora_b, rtol=1e-6, atol=1e-7)


def test_the_served_model_checks_come_first(llama, tmp_path):
    """The Transformers backend is refused for a GGUF adapter as for PEFT's."""
    from dataclasses import replace

    path = converted(llama, tmp_path)
    with pytest.raises(AdapterError, match="Transformers backend"):
        load_peft_adapter(path, llama.model, replace(llama.spec, family="transformers"), MAX_RANK, None)
