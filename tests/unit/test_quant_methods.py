"""rein.model.quant.methods: int8 / int4 quantization at load, and AWQ / GPTQ checkpoints
repacked into QuantizedWeight.

The AWQ and GPTQ checks pack random integers with small packers written here from the formats'
definitions (AutoAWQ's WQLinear_GEMM.from_linear, AutoGPTQ's QuantLinear.pack, GPTQModel's
v2 -> v1 export), independently of the code under test, and want the repacked weight to
dequantize bit for bit to scales * (q - zero). No installed library carries an AWQ / GPTQ
unpacker to compare with: transformers hands both formats to gptqmodel, which is not installed
(nor are autoawq, auto_gptq, optimum or vllm); hand-decoded words anchor the orders instead.
"""

from __future__ import annotations

import pytest
import torch

from rein.kernels.quantized import QuantizedWeight
from rein.model.quant.methods import (
    QuantizationConfig,
    awq_weight,
    gptq_weight,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    read_quantization_config,
)

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ: nibble i of a word holds column 8c + this[i]


def _int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> the int32 a checkpoint stores (same bits)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_along_last(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """[r, 8c] integers -> int32 [r, c]; nibble i of word c holds value 8c + order[i]."""
    v = values.to(torch.int64).view(values.shape[0], -1, 8)
    words = torch.zeros(v.shape[:2], dtype=torch.int64)
    for i, column in enumerate(order):
        words |= (v[:, :, column] & 0xF) << (4 * i)
    return _int32(words)


def awq_pack(q: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [out, in], zero [out, in/group] -> AutoAWQ gemm qweight [in, out/8], qzeros [in/group, out/8]."""
    return _pack_along_last(q.t(), AWQ_PACK_ORDER), _pack_along_last(zero.t(), AWQ_PACK_ORDER)


def gptq_pack_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] -> AutoGPTQ qweight [in/8, out]: word r holds input rows 8r..8r+7, lowest bits first."""
    v = q.t().to(torch.int64).reshape(-1, 8, q.shape[0])
    words = torch.zeros(v.shape[0], v.shape[2], dtype=torch.int64)
    for j in range(8):
        words |= v[:, j] << (4 * j)
    return _int32(words)


def gptq_pack_zeros_v2(zero: torch.Tensor) -> torch.Tensor:
    """zero [out, in/group] -> qzeros [in/group, out/8], sequential nibbles, the zeros themselves."""
    return _pack_along_last(zero.t(), list(range(8)))


def gptq_pack_zeros_v1_autogptq(zero: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's pack: `zeros -= 1`, then sequential nibbles (zeros 1..15 only; a 0 corrupts the word)."""
    assert int(zero.min()) >= 1
    return _pack_along_last(zero.t() - 1, list(range(8)))


def gptq_pack_zeros_v1_gptqmodel(zero: torch.Tensor) -> torch.Tensor:
    """GPTQModel's v1 export: the v2 words minus 0x11111111, a packed subtract that borrows where a zero is 0."""
    return _int32(gptq_pack_zeros_v2(zero).to(torch.int64) - 0x11111111)


def random_checkpoint(out: int, inp: int, group: int, zero_low: int = 0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, inp), generator=gen)
    zero = torch.randint(zero_low, 16, (out, inp // group), generator=gen)
    # fp16 scales over a few orders of magnitude, stored [in/group, out] as the checkpoints do
    magnitude = 10.0 ** torch.randint(-4, 1, (inp // group, out), generator=gen).float()
    scales = ((torch.rand(inp // group, out, generator=gen) + 0.05) * magnitude).half()
    assert (scales > 0).all()
    return q, zero, scales


def expected_dense(q: torch.Tensor, zero: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """scales * (q - zero) in float32, per the formats' definition, [out, in]."""
    s = scales.t().float().repeat_interleave(group, dim=1)
    z = zero.repeat_interleave(group, dim=1)
    return s * (q - z).float()


# --- pack_nibbles -------------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(1, 32), (5, 64), (7, 256)])
def test_pack_nibbles_round_trips_through_integers(rows, cols):
    q = torch.randint(0, 16, (rows, cols), generator=torch.Generator().manual_seed(rows * cols))
    packed = pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, cols // 2)
    weight = QuantizedWeight(4, packed, torch.ones(rows, 1), None, cols, rows, cols)
    assert torch.equal(weight.integers(), q.to(torch.int32))


def test_pack_nibbles_layout_low_then_high_within_each_run():
    q = torch.zeros(1, 64, dtype=torch.int64)
    q[0, 3], q[0, 3 + 16], q[0, 32 + 5], q[0, 32 + 21] = 1, 2, 3, 4
    packed = pack_nibbles(q)[0]
    assert packed[3] == 0x21 and packed[16 + 5] == 0x43
    assert int(packed.sum()) == 0x21 + 0x43


def test_pack_nibbles_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_nibbles(torch.zeros(2, 48, dtype=torch.int64))
    with pytest.raises(ValueError, match="0..15"):
        pack_nibbles(torch.full((2, 32), 16))


# --- int8 / int4 at load ---------------------------------------------------------------------

def _within_half_step(weight: QuantizedWeight, w: torch.Tensor) -> None:
    step = weight.scale.repeat_interleave(weight.group, dim=1)
    err = (weight.dequantize() - w).abs()
    assert not torch.isnan(weight.dequantize()).any()
    # half a step, and float32 rounding of the arithmetic on top
    assert (err <= step / 2 * (1 + 1e-5) + 1e-6 * w.abs()).all(), float((err - step / 2).max())


def test_quantize_int8_within_half_a_step_and_zero_rows():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 16).unsqueeze(1)
    w[4] = 0.0
    weight = quantize_int8(w.to(torch.bfloat16).float())
    assert (weight.bits, weight.group, weight.offset, weight.source) == (8, 96, None, "int8")
    assert weight.q.dtype == torch.int8 and weight.scale.shape == (16, 1)
    _within_half_step(weight, w.to(torch.bfloat16).float())
    assert torch.equal(weight.dequantize()[4], torch.zeros(96))
    # the row's largest |w| maps to +-127 exactly
    assert int(weight.integers().abs().amax(dim=1).min()) == 0
    assert int(weight.integers().abs().amax(dim=1)[torch.arange(16) != 4].min()) == 127


@pytest.mark.parametrize("group", [32, 64, 128, -1, None])
def test_quantize_int4_within_half_a_step(group):
    w = torch.randn(12, 256, generator=torch.Generator().manual_seed(2)) * 0.05 + 0.01
    weight = quantize_int4(w, group)
    want_group = 256 if group in (-1, None) else group
    assert (weight.bits, weight.group, weight.source) == (4, want_group, f"int4-g{want_group}")
    assert weight.q.dtype == torch.uint8 and weight.offset is not None
    _within_half_step(weight, w)
    # min and max of each group are reached: 0 and 15 both used
    ints = weight.integers().view(12, -1, want_group)
    assert (ints.amin(dim=2) == 0).all() and (ints.amax(dim=2) == 15).all()


def test_quantize_int4_constant_groups_and_zero_rows_are_exact():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    w[0] = 0.0
    w[1, :32] = 0.75
    w[2, 32:] = -3.0
    weight = quantize_int4(w, 32)
    dense = weight.dequantize()
    assert not torch.isnan(dense).any()
    assert torch.equal(dense[0], torch.zeros(64))
    assert torch.equal(dense[1, :32], torch.full((32,), 0.75))
    assert torch.equal(dense[2, 32:], torch.full((32,), -3.0))
    _within_half_step(weight, w)


def test_quantize_int4_bad_groups_raise_with_the_fix():
    w = torch.randn(8, 96)
    with pytest.raises(ValueError, match=r"group 48 does not suit weight \(8, 96\).*multiple of 32"):
        quantize_int4(w, 48)
    with pytest.raises(ValueError, match=r"group 64 does not suit weight \(8, 96\).*divides the 96"):
        quantize_int4(w, 64)
    with pytest.raises(ValueError, match=r"\(8, 48\) has 48 columns.*use int8"):
        quantize_int4(torch.randn(8, 48), -1)
    with pytest.raises(ValueError, match="float"):
        quantize_int4(torch.ones(8, 64, dtype=torch.int32))


# --- AWQ --------------------------------------------------------------------------------------

def test_awq_hand_decoded_word_follows_the_interleaved_order():
    # One word 0x76543210: nibble i holds i, and nibble i is output column AWQ_PACK_ORDER[i].
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32).repeat(32, 1)     # [in 32, out/8 1]
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    weight = awq_weight(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), 32)
    column_values = weight.integers()[:, 0].tolist()                           # output rows 0..7
    assert column_values == [0, 4, 1, 5, 2, 6, 3, 7]


@pytest.mark.parametrize("out, inp, group", [(8, 32, 32), (24, 128, 64), (64, 256, 128), (16, 96, -1), (8, 64, 16)])
def test_awq_weight_dequantizes_exactly(out, inp, group):
    g = inp if group == -1 else group
    q, zero, scales = random_checkpoint(out, inp, g, seed=out + inp)
    qweight, qzeros = awq_pack(q, zero)
    assert qweight.shape == (inp, out // 8) and qzeros.shape == (inp // g, out // 8)
    weight = awq_weight(qweight, qzeros, scales, group)
    assert (weight.rows, weight.cols, weight.group, weight.source) == (out, inp, g, "awq")
    assert weight.bits == (8 if g % 32 else 4)            # a group of 16 keeps a byte per integer
    assert torch.equal(weight.integers(), q.to(torch.int32))
    assert torch.equal(weight.dequantize(), expected_dense(q, zero, scales, g))


def test_awq_shape_mismatch_names_the_shapes():
    q, zero, scales = random_checkpoint(16, 128, 64)
    qweight, qzeros = awq_pack(q, zero)
    with pytest.raises(ValueError, match=r"group 32 want qzeros \(4, 2\)"):
        awq_weight(qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="8 bits"):
        awq_weight(qweight, qzeros, scales, 64, bits=8)


# --- GPTQ -------------------------------------------------------------------------------------

def test_gptq_hand_decoded_word_is_sequential_along_the_input():
    qweight = torch.tensor([[0x76543210]], dtype=torch.int32).repeat(4, 1)      # [in/8 4, out 1] ...
    qweight = qweight.repeat(1, 8)                                              # ... out 8
    qzeros = torch.zeros(1, 1, dtype=torch.int32)
    weight = gptq_weight(qweight, qzeros, torch.ones(1, 8, dtype=torch.float16), None, 32, checkpoint_format="gptq_v2")
    assert weight.integers()[0, :8].tolist() == list(range(8))
    assert weight.integers()[0, 8:16].tolist() == list(range(8))


@pytest.mark.parametrize("out, inp, group", [(8, 32, 32), (24, 128, 64), (64, 256, 128), (16, 96, -1)])
@pytest.mark.parametrize("packer", ["autogptq_v1", "gptqmodel_v1", "v2"])
def test_gptq_weight_dequantizes_exactly(out, inp, group, packer):
    g = inp if group == -1 else group
    # AutoGPTQ's v1 pack cannot hold a zero of 0 (it writes -1 into a whole word); the others can
    q, zero, scales = random_checkpoint(out, inp, g, zero_low=1 if packer == "autogptq_v1" else 0, seed=out * inp)
    if packer == "gptqmodel_v1":
        zero[0, 0] = 0          # a borrow across nibbles, the case a per-nibble +1 gets wrong
    qweight = gptq_pack_qweight(q)
    qzeros = {"autogptq_v1": gptq_pack_zeros_v1_autogptq, "gptqmodel_v1": gptq_pack_zeros_v1_gptqmodel,
              "v2": gptq_pack_zeros_v2}[packer](zero)
    fmt = "gptq_v2" if packer == "v2" else "gptq"
    g_idx = torch.arange(inp, dtype=torch.int32) // g
    assert qweight.shape == (inp // 8, out) and qzeros.shape == (inp // g, out // 8)
    weight = gptq_weight(qweight, qzeros, scales, g_idx, group, checkpoint_format=fmt)
    assert (weight.rows, weight.cols, weight.group, weight.bits, weight.source) == (out, inp, g, 4, "gptq")
    assert torch.equal(weight.integers(), q.to(torch.int32))
    assert torch.equal(weight.dequantize(), expected_dense(q, zero, scales, g))
    # the default format is v1, and g_idx may be absent
    if fmt == "gptq":
        assert torch.equal(gptq_weight(qweight, qzeros, scales, None, group).dequantize(), weight.dequantize())


def test_gptq_symmetric_v1_zero_is_eight():
    q, zero, scales = random_checkpoint(16, 64, 32)
    zero.fill_(8)
    qzeros = gptq_pack_zeros_v1_autogptq(zero)
    assert int(qzeros[0, 0]) == 0x77777777
    weight = gptq_weight(gptq_pack_qweight(q), qzeros, scales, None, 32)
    assert torch.equal(weight.dequantize(), expected_dense(q, zero, scales, 32))


def test_gptq_bf16_scales_are_exact():
    q, zero, scales = random_checkpoint(8, 64, 32)
    scales = scales.float().to(torch.bfloat16)
    weight = gptq_weight(gptq_pack_qweight(q), gptq_pack_zeros_v2(zero), scales, None, 32, checkpoint_format="gptq_v2")
    assert torch.equal(weight.dequantize(), expected_dense(q, zero, scales, 32))


def test_gptq_act_order_is_refused():
    q, zero, scales = random_checkpoint(8, 64, 32)
    qweight, qzeros = gptq_pack_qweight(q), gptq_pack_zeros_v2(zero)
    act_order = (torch.arange(64) // 32).flip(0).to(torch.int32)
    with pytest.raises(ValueError, match="act-order .* not supported.*desc_act=False"):
        gptq_weight(qweight, qzeros, scales, act_order, 32)


def test_gptq_refuses_other_bits_formats_and_shapes():
    q, zero, scales = random_checkpoint(8, 64, 32)
    qweight, qzeros = gptq_pack_qweight(q), gptq_pack_zeros_v2(zero)
    with pytest.raises(ValueError, match="GPTQ with 8 bits is not supported"):
        gptq_weight(qweight, qzeros, scales, None, 32, bits=8)
    with pytest.raises(ValueError, match="'marlin'"):
        gptq_weight(qweight, qzeros, scales, None, 32, checkpoint_format="marlin")
    with pytest.raises(ValueError, match=r"group 64 want qzeros \(1, 1\)"):
        gptq_weight(qweight, qzeros, scales, None, 64)
    with pytest.raises(ValueError, match="does not divide the 64"):
        gptq_weight(qweight, qzeros, scales, None, 48)


# --- config.json -------------------------------------------------------------------------------

def test_read_quantization_config_none_without_one():
    assert read_quantization_config({"model_type": "llama"}) is None
    assert read_quantization_config({"model_type": "llama", "quantization_config": None}) is None


def test_read_quantization_config_awq():
    config = {"model_type": "llama", "quantization_config": {
        "quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": ["visual"]}}
    assert read_quantization_config(config) == QuantizationConfig(
        "awq", 4, 128, "gemm", zero_point=True, modules_to_not_convert=("visual",))
    # the quantization_config dict itself, and "version" left out (gemm is AutoAWQ's default)
    assert read_quantization_config({"quant_method": "AWQ", "bits": 4, "group_size": 64}).group_size == 64


def test_read_quantization_config_gptq():
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    assert read_quantization_config({"quantization_config": base}) == QuantizationConfig(
        "gptq", 4, 128, "gptq", sym=True, desc_act=False)
    v2 = read_quantization_config({"quantization_config": {**base, "checkpoint_format": "gptq_v2", "sym": False}})
    assert (v2.checkpoint_format, v2.sym) == ("gptq_v2", False)
    assert read_quantization_config({"quantization_config": {**base, "format": "gptq_v2"}}).checkpoint_format == "gptq_v2"
    # act-order is read, not refused here: gptq_weight refuses a permuted g_idx per weight
    assert read_quantization_config({"quantization_config": {**base, "desc_act": True}}).desc_act


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, 'AWQ version "gemv"'),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, 'AWQ version "marlin"'),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "exllama"}, 'AWQ version "exllama"'),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point false"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "AWQ with 8 bits"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "GPTQ with 8 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, 'format "marlin"'),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, 'method "bitsandbytes"'),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, 'method "fp8"'),
])
def test_read_quantization_config_refuses_what_rein_cannot_read(quant, message):
    with pytest.raises(ValueError, match=message) as info:
        read_quantization_config({"quantization_config": quant})
    assert "rein reads AWQ" in str(info.value)
