"""The CPU fast paths of the forward: oneDNN linears and packed weights (rein.model.architectures.linear)
as probed per dtype (rein.kernels.cpu_paths), the glibc allocator settings
(rein.model.cpu_allocator) and the flash-kernel prefill attention of the reference kernels,
each against the plain computation it replaces. The tests hold on every x86-64 CPU: they check
the path this one can run, and the fallback (REIN_CPU_FAST_PATHS=0, or a oneDNN that refuses)
on every machine."""

from __future__ import annotations

import math

import pytest
import torch

from rein.kernels import cpu_paths, reference
from rein.model import cpu_allocator
from rein.model.architectures import linear as linear_module
from rein.model.architectures.linear import Linear, linear

FLOAT32_ON_ONEDNN = cpu_paths.probe_onednn(torch.float32) is None
needs_onednn_float32 = pytest.mark.skipif(not FLOAT32_ON_ONEDNN, reason="float32 does not run on oneDNN here")


@pytest.fixture(autouse=True)
def fast_paths_on(cpu_fast_paths_on):
    """The fast paths on, whatever the suite runs with; a test that takes them off does so after."""


@pytest.fixture(params=["fast", "torch"])
def fast_paths(request):
    """Each test twice: with the paths this CPU can run, and with REIN_CPU_FAST_PATHS=0."""
    if request.param == "torch":
        request.getfixturevalue("cpu_fast_paths_off")
    return request.param


class OneDNNSpy:
    """Stands in for torch.ops.mkldnn, recording the row counts `_linear_pointwise` is called on."""

    def __init__(self, fail: bool = False):
        self.calls: list[torch.Size] = []
        self.fail = fail
        self.original = torch.ops.mkldnn

    def __getattr__(self, name):
        if name != "_linear_pointwise":
            return getattr(self.original, name)

        def op(*args):
            self.calls.append(args[0].shape)
            if self.fail:   # what oneDNN says on a CPU without the primitive
                raise RuntimeError("could not create a primitive descriptor for the inner product "
                                   "forward propagation primitive")
            return self.original._linear_pointwise(*args)
        return op


@pytest.mark.parametrize("rows", [1, 3, 4, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias, fast_paths):
    torch.manual_seed(rows)
    x = torch.randn(rows, 96)
    w = torch.randn(160, 96)
    b = torch.randn(160) if bias else None
    with torch.inference_mode():
        got = linear(x, w, b)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_keeps_leading_dims_in_low_precision(dtype, fast_paths):
    """On every CPU: oneDNN where this CPU has the primitive, F.linear where not (an AVX2-only
    CPU has none for bfloat16; there it used to raise)."""
    x = torch.randn(2, 5, 64, dtype=dtype)
    w = torch.randn(48, 64, dtype=dtype)
    with torch.inference_mode():
        got = linear(x, w)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, w).float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("dtype", cpu_paths.ONEDNN_DTYPES)
def test_probe_agrees_with_the_primitive(dtype):
    """A dtype is sent to oneDNN exactly when oneDNN's linear runs in it on this CPU."""
    x, w = torch.randn(8, 16).to(dtype), torch.randn(4, 16).to(dtype)
    try:
        torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        runs = True
    except RuntimeError:
        runs = False
    assert (dtype in cpu_paths.onednn_dtypes()) == runs


def test_a_cpu_without_the_primitive_falls_back(monkeypatch):
    """As on an AVX2-only CPU, whatever this one has: the probe sees oneDNN refuse, no linear
    is sent to it afterwards, and the load log says why."""
    spy = OneDNNSpy(fail=True)
    monkeypatch.setattr(linear_module.torch.ops, "mkldnn", spy)
    cpu_paths.reset()
    try:
        assert cpu_paths.onednn_dtypes() == frozenset()
        assert "linear: torch (bfloat16: no primitive on this CPU)" in cpu_paths.describe(torch.bfloat16)
        probes = len(spy.calls)
        x, w = torch.randn(2, 5, 64, dtype=torch.bfloat16), torch.randn(48, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            got = linear(x, w)
            assert linear_module.pack_weights(torch.nn.Sequential(Linear(8, 8))) == 0
        assert len(spy.calls) == probes
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w))
    finally:
        monkeypatch.undo()
        cpu_paths.reset()


def test_setting_turns_every_fast_path_off(cpu_fast_paths_off, monkeypatch):
    spy = OneDNNSpy()
    monkeypatch.setattr(linear_module.torch.ops, "mkldnn", spy)
    model = torch.nn.Sequential(Linear(16, 8))
    with torch.inference_mode():
        assert linear_module.pack_weights(model) == 0
        model(torch.randn(32, 16))
    assert spy.calls == [] and cpu_paths.onednn_dtypes() == frozenset()
    assert cpu_paths.describe(torch.float32).endswith(
        "linear: torch (float32: REIN_CPU_FAST_PATHS=0); attention, element-wise: torch (REIN_CPU_FAST_PATHS=0)")
    assert cpu_allocator._enabled() is False


def test_describe_names_the_paths_taken():
    text = cpu_paths.describe(torch.float32)
    assert ("linear: oneDNN packed (float32)" in text) == FLOAT32_ON_ONEDNN
    assert "attention, element-wise: rein C kernels (" in text   # gcc is on every machine rein tests on
    assert "attention, element-wise: torch (the C kernels take float32 only)" in cpu_paths.describe(torch.float16)
    assert "linear: torch (float16: oneDNN is used for float32 and bfloat16 only)" in cpu_paths.describe(torch.float16)


def test_linear_module_trains_through_f_linear():
    """Outside inference mode, with a weight that wants gradients, oneDNN's op (no autograd
    formula) must not be used: the module still backpropagates."""
    layer = Linear(32, 16)
    x = torch.randn(8, 32)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.shape == (16, 32)


@needs_onednn_float32
def test_linear_uses_onednn_from_min_rows(monkeypatch):
    cpu_paths.onednn_dtypes()   # the probe's own calls, before the spy
    spy = OneDNNSpy()
    monkeypatch.setattr(linear_module.torch.ops, "mkldnn", spy)
    w = torch.randn(8, 16)
    with torch.inference_mode():
        linear(torch.randn(linear_module.MIN_ROWS - 1, 16), w)
        linear(torch.randn(linear_module.MIN_ROWS, 16), w)
    assert spy.calls == [torch.Size([linear_module.MIN_ROWS, 16])]


@needs_onednn_float32
def test_packed_weights_give_the_same_outputs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(96, 160, bias=True), torch.nn.SiLU(), Linear(160, 96, bias=False))
    dense = [m.weight.detach().clone() for m in (model[0], model[2])]
    inputs = [torch.randn(rows, 96) for rows in (1, 3, 32, 300)] + [torch.randn(2, 5, 96)]
    with torch.inference_mode():
        want = [model(x) for x in inputs]
        assert linear_module.pack_weights(model) == 2
        assert linear_module.pack_weights(model) == 0          # already packed
        got = [model(x) for x in inputs]
    assert model[0].weight.is_mkldnn and model[0].weight.shape == dense[0].shape
    assert sum(p.numel() for p in model.parameters()) == sum(w.numel() for w in dense) + 160
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])   # tied head, untied head
def test_loaded_cpu_model_logits_equal_on_both_paths(tiny_models, arch, fast_paths):
    """Packed for oneDNN where float32 runs there, dense otherwise; the logits are the plain
    product with the head either way."""
    from rein.model.files import resolve_model
    from rein.model.loader import load_model
    from rein.model.spec import ModelSpec

    files = resolve_model(tiny_models(arch=arch))
    spec = ModelSpec.from_dir(files.directory)
    model = load_model(files, spec, 64, torch.float32, torch.device("cpu"))
    packed = fast_paths == "fast" and FLOAT32_ON_ONEDNN
    assert model.layers[0].mlp.down_proj.weight.is_mkldnn == packed
    hidden = torch.randn(5, spec.hidden_size)
    dense_head = model.embed_tokens.weight if model.lm_head is None else None
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    if arch == "qwen2":
        assert model.lm_head is None and (model.packed_tied_head is not None) == packed
        torch.testing.assert_close(logits, hidden @ dense_head.T, rtol=1e-5, atol=1e-5)
    else:
        assert model.packed_tied_head is None and model.lm_head.weight.is_mkldnn == packed
        assert logits.shape == (5, spec.vocab_size)


def test_pack_weights_leaves_other_dtypes_and_plain_linears():
    model = torch.nn.Sequential(Linear(8, 8).half(), torch.nn.Linear(8, 8))
    assert linear_module.pack_weights(model) == 0
    assert not model[0].weight.is_mkldnn and not model[1].weight.is_mkldnn


@pytest.mark.parametrize("features", [("avx2", "fma", "avx512f"), ("avx512f", "avx512_bf16"), ("amx_bf16",)])
def test_bfloat16_weights_are_packed_only_where_the_cpu_multiplies_bfloat16(monkeypatch, features):
    """Packed where oneDNN runs bfloat16 and the CPU has AVX-512-BF16 or AMX; elsewhere (oneDNN
    converting to float32 inside, unmeasured) the weights stay dense, as before."""
    monkeypatch.setattr(cpu_paths, "cpu_features", lambda: features)
    cpu_paths.reset()
    try:
        native = features != ("avx2", "fma", "avx512f")
        on_onednn = torch.bfloat16 in cpu_paths.onednn_dtypes()
        assert (torch.bfloat16 in cpu_paths.packed_dtypes()) == (on_onednn and native)
        model = torch.nn.Sequential(Linear(8, 8).bfloat16())
        assert linear_module.pack_weights(model) == (1 if on_onednn and native else 0)
        assert ("linear: oneDNN packed (bfloat16)" in cpu_paths.describe(torch.bfloat16)) == (on_onednn and native)
    finally:
        monkeypatch.undo()
        cpu_paths.reset()


needs_packed_bfloat16 = pytest.mark.skipif(torch.bfloat16 not in cpu_paths.packed_dtypes(),
                                           reason="bfloat16 weights are not packed on this CPU")


@needs_packed_bfloat16
def test_packed_bfloat16_weights_give_torchs_bfloat16_outputs():
    """Against torch's own bfloat16 F.linear on the dense weights: both round the products'
    float32 sums to bfloat16, so they differ by the summation order, within a bfloat16 step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(96, 160, bias=True), Linear(160, 96, bias=False)).bfloat16()
    dense = [(m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in model]
    inputs = [torch.randn(rows, 96, dtype=torch.bfloat16) for rows in (1, 3, 32, 300)] + \
        [torch.randn(2, 5, 96, dtype=torch.bfloat16)]
    with torch.inference_mode():
        assert linear_module.pack_weights(model) == 2
        for x in inputs:
            want = x
            for weight, bias in dense:
                want = torch.nn.functional.linear(want, weight, bias)
            got = model(x)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert all(m.weight.is_mkldnn for m in model)


@needs_packed_bfloat16
def test_a_bfloat16_model_loads_packed_with_its_tied_head(tiny_models):
    from rein.model.files import resolve_model
    from rein.model.loader import load_model
    from rein.model.spec import ModelSpec

    files = resolve_model(tiny_models(arch="qwen2"))
    spec = ModelSpec.from_dir(files.directory)
    model = load_model(files, spec, 64, torch.bfloat16, torch.device("cpu"))
    assert model.layers[0].mlp.down_proj.weight.is_mkldnn and model.packed_tied_head is not None
    hidden = torch.randn(5, spec.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
    want = torch.nn.functional.linear(hidden, model.embed_tokens.weight)
    torch.testing.assert_close(logits.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_keep_freed_memory_can_be_disabled(monkeypatch):
    from rein.core.settings import get_settings

    monkeypatch.setattr(cpu_allocator, "_mode", "default")
    monkeypatch.setenv("REIN_CPU_MALLOPT", "0")
    get_settings.cache_clear()
    assert cpu_allocator.keep_freed_memory() is False
    monkeypatch.delenv("REIN_CPU_MALLOPT")
    get_settings.cache_clear()
    applied = cpu_allocator.keep_freed_memory()
    if applied:   # glibc: applied once, then a no-op that still reports success
        assert cpu_allocator.keep_freed_memory() is True


def naive_attention(q, k, v, positions, scale):
    """q [Tq, H, d] at `positions`, k/v [L, kvh, d]: causal softmax attention, head by head."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for h in range(heads):
        kh, vh = k[:, h // (heads // kv_heads)], v[:, h // (heads // kv_heads)]
        scores = (q[:, h] @ kh.T) * scale
        scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions[:, None], -math.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


@pytest.mark.parametrize("prefix", [0, 5, 19])
def test_prefill_attention_with_and_without_cached_prefix(prefix):
    """Two requests back to back, each a chunk after `prefix` cached tokens: the flash-kernel
    path (is_causal without a prefix, a bool mask with one) equals plain causal attention."""
    torch.manual_seed(prefix)
    heads, kv_heads, dim, block = 6, 2, 16, 4
    chunks = [7, 12]
    k_cache = torch.zeros(32, block, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    tables, queries, expected = [], [], []
    next_block = 0
    for n in chunks:
        total = prefix + n
        blocks = list(range(next_block, next_block + -(-total // block)))
        next_block += len(blocks)
        tables.append(blocks + [0] * (10 - len(blocks)))
        k = torch.randn(total, kv_heads, dim)
        v = torch.randn(total, kv_heads, dim)
        slots = torch.tensor([blocks[p // block] * block + p % block for p in range(total)])
        reference.store_kv(k, v, k_cache, v_cache, slots)
        q = torch.randn(n, heads, dim)
        queries.append(q)
        expected.append(naive_attention(q, k, v, torch.arange(prefix, total), dim**-0.5))
    got = reference.paged_prefill_attention(
        torch.cat(queries), k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
        torch.tensor([0, chunks[0], sum(chunks)], dtype=torch.int32),
        torch.tensor([prefix + n for n in chunks], dtype=torch.int32), dim**-0.5)
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
