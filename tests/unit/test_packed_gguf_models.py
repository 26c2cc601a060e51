"""A model whose projections are GGUF Q5_K, Q6_K, Q5_0 and Q5_1 blocks, held packed at 5 and 6
bits (rein.kernels.packed_bits) in the engine, against the same model as a float checkpoint of
the blocks dequantized by the gguf package: the same greedy tokens, logprobs within float32
rounding. And the bytes held per weight: about the file's, not a byte per weight.

The blocks come from tests/gguf_kquants.py (the gguf package writes no k-quants) and reach the
engine through the loader's quantize-at-load seam, each projection repacked from its GGUF bytes
by rein.model.quant.gguf_blocks exactly as the GGUF getter does; reading a GGUF file's tensors is
tests/unit/test_gguf_* and tests/real/test_quantized_gguf.py's (Gemma 3's Q4_K_M holds Q5_0 and
Q6_K).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize
from test_quantized_models import checkpoint, is_projection, run, variant

from rein.fixtures.tiny_gguf import quantize
from rein.kernels.quantized import CpuPanels
from rein.model import loader
from rein.model.architectures.linear import Linear
from rein.model.quant.gguf_blocks import held_bytes, repack

LOGPROB_TOLERANCE = 1e-3
KV = 16 << 20   # the small preset's 8 layers


def gguf_type(name: str) -> str:
    """A Q5_K_M-like mix: layer 0's q/k/v all Q5_K, layer 1's all Q6_K, later ones mixed (Q5_K
    beside a Q6_K v, as _M files have, which stack widened to 8 bits); o and gate/up alternate;
    down_proj (1408 columns, not whole 256-blocks) Q5_0 / Q5_1, as llama.cpp falls back."""
    layer = int(name.split(".")[2])
    projection = name.split(".")[-2]
    if projection == "down_proj":
        return "Q5_0" if layer % 2 else "Q5_1"
    if projection in ("q_proj", "k_proj", "v_proj"):
        if layer >= 2 and projection == "v_proj":
            return "Q6_K"
        return "Q6_K" if layer == 1 else "Q5_K"
    if projection == "o_proj":
        return "Q6_K" if layer % 2 else "Q5_K"
    return "Q5_K" if layer % 2 else "Q6_K"


@pytest.fixture(scope="module")
def blocks(tiny_models):
    """The small llama's projections as GGUF bytes, and its float checkpoint of them dequantized."""
    source = tiny_models("llama", preset="small")
    raw, floats = {}, {}
    for name, t in checkpoint(source).items():
        if not is_projection(name):
            floats[name] = t
            continue
        kind = gguf_type(name)
        data = quantize(t.float().numpy(), kind)
        raw[name] = (data, kind)
        floats[name] = torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).astype(np.float32)).to(t.dtype)
    return source, raw, floats


def gguf_getter(raw):
    """Stands in for quantized_at_load: each projection asked for quantized is its GGUF bytes
    repacked (what rein.model.loader's GGUF getter hands out)."""

    def wrap(get, method, report):
        def lookup(name, shard=None, quantized=False):
            if not quantized or name not in raw:
                return get(name, shard)
            data, kind = raw[name]
            weight = repack(data, kind, data.shape[0], get(name).shape[1])
            report.quantized[kind] += 1
            return weight

        return lookup

    return wrap


def test_packed_q5_q6_model_gives_the_dequantized_models_tokens(blocks, tmp_path, monkeypatch):
    source, raw, floats = blocks
    reference = variant(source, tmp_path / "reference", floats)
    monkeypatch.setattr(loader, "quantized_at_load", gguf_getter(raw))
    engine, tokens, logprobs = run(source, "int8", kv_cache_memory=KV)   # "int8" only opens the seam
    held = {name: m.quantized for name, m in engine.runner.model.named_modules()
            if isinstance(m, Linear) and m.quantized is not None}
    assert len(held) == 4 * engine.spec.num_layers
    bits = {name: w.bits for name, w in held.items()}
    # Packed where every stacked part has one form; a mixed q/k/v (Q5_K beside Q6_K) widened.
    assert bits["layers.0.self_attn.qkv_proj"] == 5 and bits["layers.1.self_attn.qkv_proj"] == 6
    assert bits["layers.2.self_attn.qkv_proj"] == 8
    assert {bits[f"layers.{i}.mlp.down_proj"] for i in range(2)} == {5}
    assert {bits[f"layers.{i}.mlp.gate_up_proj"] for i in range(2)} == {5, 6}
    assert all(isinstance(w, CpuPanels) for w in held.values())
    monkeypatch.undo()
    _, want_tokens, want_logprobs = run(reference, kv_cache_memory=KV)
    assert tokens == want_tokens
    error = max(abs(a - b) for i in logprobs for a, b in zip(logprobs[i], want_logprobs[i], strict=True))
    assert error < LOGPROB_TOLERANCE


# Bytes held per weight, scales included, at most (held: 0.6875, 0.75, 0.7031, 0.8203).
# A byte per weight -- the form before packing -- fails every one of them.
HELD_LIMITS = {"Q5_0": 0.70, "Q5_1": 0.76, "Q5_K": 0.72, "Q6_K": 0.85}


@pytest.mark.parametrize("kind", sorted(HELD_LIMITS))
def test_held_bytes_per_weight_are_the_files(kind):
    rows, cols = 64, 1024
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.05
    data = quantize(w, kind)
    weight = repack(data, kind, rows, cols)
    panels = CpuPanels.from_weight(weight)
    for held in (weight, panels):
        per_weight = held.nbytes() / (rows * cols)
        assert per_weight <= HELD_LIMITS[kind], f"{kind} {type(held).__name__}: {per_weight:.3f} bytes a weight"
    assert weight.nbytes() == panels.nbytes() == held_bytes(kind, rows, cols)
    # The file's bytes; Q5_K's 6-bit sub-block factors are held a byte each (+4 bytes a block).
    assert held_bytes(kind, rows, cols) == data.nbytes + (rows * cols // 256 * 4 if kind == "Q5_K" else 0)
    torch.testing.assert_close(panels.dequantize(), weight.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("qtype, bits", [("Q5_K", 5), ("Q6_K", 6)])
def test_a_gguf_file_of_k_quants_runs_as_the_file_dequantized(tiny_models, tmp_path, qtype, bits):
    """A GGUF file (rein.fixtures.tiny_gguf) whose matrices are Q5_K or Q6_K -- the embedding,
    q/k/v, o, gate/up; down_proj's 1408 columns are not whole 256-blocks and stay F32 -- read
    by rein's GGUF loader: held packed, the same greedy tokens as the file dequantized."""
    from rein.fixtures.tiny_gguf import write_gguf

    path = write_gguf(tiny_models("llama", preset="small"), tmp_path / f"{qtype}.gguf", qtype)
    engine, tokens, logprobs = run(path, kv_cache_memory=KV)
    model = engine.runner.model
    held = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    assert len(held) == 3 * engine.spec.num_layers + 1   # qkv, o, gate/up; the LM head
    assert {(w.source, w.bits) for w in held} == {(qtype, bits)}
    assert model.embed_tokens.quantized.bits == bits
    _, want_tokens, want_logprobs = run(path, "none", kv_cache_memory=KV)
    assert tokens == want_tokens
    error = max(abs(a - b) for i in logprobs for a, b in zip(logprobs[i], want_logprobs[i], strict=True))
    assert error < LOGPROB_TOLERANCE
