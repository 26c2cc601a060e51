"""rein's CPU LoRA kernel (csrc/lora_cpu.c through rein.kernels.cpu_native.lora_apply) and the
grouped torch path beside it (rein.model.lora.layers._apply_torch), each against a per-token
torch reference, in each build a CPU may get: this CPU's (AVX-512 here), AVX2 without AVX-512
(-march=haswell) and the x86-64 baseline's plain loops."""

import pytest
import torch
from kernel_builds import use_c_kernels

from rein.core.settings import get_settings
from rein.kernels import cpu_native
from rein.model.lora.layers import CHUNK_TOKENS, LoRAPart, TokensBySlot, _apply_torch


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("lora-kernels")


@pytest.fixture(autouse=True, params=["native", "haswell", "x86-64"])
def march(request, build_root, monkeypatch):
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


def adapters(slots, rank, in_features, cols, ranks=None, seed=0):
    """Stacks A [slots, rank, in] and B [slots, cols, rank], slot s of rank ranks[s] zero-padded
    to `rank`, views of A.T and B.T (as LoRAPart keeps them on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.zeros(slots, in_features, rank).transpose(1, 2)
    lora_b = torch.zeros(slots, rank, cols).transpose(1, 2)
    for s in range(slots):
        r = rank if ranks is None else ranks[s]
        lora_a[s, :r] = torch.randn(r, in_features, generator=gen)
        lora_b[s, :, :r] = torch.randn(cols, r, generator=gen) * 0.1
    return lora_a, lora_b


def reference(x, out, offset, lora_a, lora_b, token_slots, live):
    """Token by token: out[t, offset:offset + N] += B[s] @ (A[s] @ x[t]) where s is live."""
    want = out.clone()
    cols = lora_b.shape[1]
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0 and live[s]:
            want[t, offset:offset + cols] += lora_b[s].double() @ (lora_a[s].double() @ x[t].double())
    return want


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    bound = 1e-5 * (1 + want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= bound, f"max error {err:.3g} over {bound:.3g}"


def run_kernel(x, out, offset, lora_a, lora_b, token_slots, live):
    batch = TokensBySlot.prepare(token_slots, torch.device("cpu"))
    got = out.clone()
    assert cpu_native.lora_apply(x, got, offset, lora_a, lora_b, batch.order, batch.chunks, live), \
        "the kernel fell back"
    return got


CASES = {
    # name: (tokens, slots, in, cols, rank, token slots: "mixed" | "one" | "none")
    "decode-mixed": (64, 8, 96, 80, 16, "mixed"),
    "odd-sizes": (37, 5, 67, 45, 7, "mixed"),            # tails of the 4-token and 16-column loops
    "one-slot-for-all": (50, 4, 64, 48, 8, "one"),       # chunks of CHUNK_TOKENS of one slot
    "long-runs": (3 * CHUNK_TOKENS + 5, 2, 64, 33, 4, "runs"),
    "base-only": (12, 3, 32, 16, 4, "none"),
}


def token_slots_for(kind, tokens, slots, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "mixed":
        return torch.randint(-1, slots, (tokens,), generator=gen)
    if kind == "one":
        return torch.full((tokens,), slots - 1)
    if kind == "runs":
        return torch.cat([torch.zeros(tokens // 2, dtype=torch.int64), torch.ones(tokens - tokens // 2,
                                                                                   dtype=torch.int64)])
    return torch.full((tokens,), -1)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_the_per_token_reference(case):
    tokens, slots, in_features, cols, rank, kind = CASES[case]
    lora_a, lora_b = adapters(slots, rank, in_features, cols)
    x = torch.randn(tokens, in_features)
    out = torch.randn(tokens, cols)
    token_slots = token_slots_for(kind, tokens, slots)
    live = torch.ones(slots, dtype=torch.uint8)
    got = run_kernel(x, out, 0, lora_a, lora_b, token_slots, live)
    assert_close(got, reference(x, out, 0, lora_a, lora_b, token_slots, live).float())
    if kind == "none":
        assert torch.equal(got, out)


def test_zero_padded_ranks_strided_rows_and_an_offset_into_a_fused_output():
    """Adapters of ranks 3, 16 and 9 padded to 16; x a view whose rows are wider than `in`; the
    products land in the columns [40, 40 + 50) of a wider output (a fused projection's part),
    every other column untouched; a slot that is not live adds nothing."""
    slots, rank, in_features, cols, offset = 4, 16, 72, 50, 40
    lora_a, lora_b = adapters(slots, rank, in_features, cols, ranks=[3, 16, 9, 16])
    wide = torch.randn(29, in_features + 11)
    x = wide[:, 5:5 + in_features]
    assert not x.is_contiguous()
    out = torch.randn(29, offset + cols + 24)
    token_slots = token_slots_for("mixed", 29, slots, seed=3)
    live = torch.tensor([1, 1, 1, 0], dtype=torch.uint8)
    assert (token_slots == 3).any() and (token_slots == -1).any()
    got = run_kernel(x, out, offset, lora_a, lora_b, token_slots, live)
    assert_close(got, reference(x, out, offset, lora_a, lora_b, token_slots, live).float())
    assert torch.equal(got[:, :offset], out[:, :offset]) and torch.equal(got[:, offset + cols:], out[:, offset + cols:])
    assert torch.equal(got[token_slots == 3], out[token_slots == 3])
    # The padding is inert: the same adapters unpadded give the same products.
    for s, r in enumerate([3, 16, 9]):
        rows = token_slots == s
        delta = (x[rows] @ lora_a[s, :r].T) @ lora_b[s, :, :r].T
        assert_close(got[rows, offset:offset + cols], out[rows, offset:offset + cols] + delta)


def test_the_grouped_torch_path_equals_the_reference():
    """The path REIN_CPU_FAST_PATHS=0 and CUDA take, through a LoRAPart as the model fills it."""
    slots, rank, in_features, cols, offset = 5, 8, 40, 24, 16
    lora_a, lora_b = adapters(slots, rank, in_features, cols, ranks=[8, 2, 8, 5, 8])
    part = LoRAPart(offset, cols, in_features, slots, rank, torch.device("cpu"), torch.float32)
    for s in (0, 1, 3, 4):
        part.lora_a[s], part.lora_b[s] = lora_a[s], lora_b[s]
        part.held.add(s)
        part.live[s] = 1
    x = torch.randn(33, in_features)
    out = torch.randn(33, offset + cols + 8)
    for kind in ("mixed", "one", "none"):
        token_slots = token_slots_for(kind, 33, slots, seed=4)
        got = out.clone()
        _apply_torch(x, got, part, TokensBySlot.prepare(token_slots, torch.device("cpu")))
        assert_close(got, reference(x, out, offset, part.lora_a, part.lora_b, token_slots, part.live).float())


def test_what_the_kernel_does_not_take_is_left_to_torch():
    """False, and the output untouched: not float32, a rank above the kernel's limit, a chunk
    longer than it takes, slots, runs or tokens out of range, shapes that do not match."""
    lora_a, lora_b = adapters(2, 4, 16, 8)
    x, out = torch.randn(6, 16), torch.randn(6, 8)
    batch = TokensBySlot.prepare(torch.tensor([0, 1, 0, -1, 1, 1]), torch.device("cpu"))
    live = torch.ones(2, dtype=torch.uint8)
    before = out.clone()

    def applies(x=x, lora_a=lora_a, lora_b=lora_b, chunks=batch.chunks, offset=0):
        return cpu_native.lora_apply(x, out, offset, lora_a, lora_b, batch.order, chunks, live)

    assert not applies(x=x.to(torch.bfloat16))
    assert not applies(lora_a=lora_a.to(torch.bfloat16))
    assert not applies(offset=1)                                   # past the output's columns
    assert not applies(lora_a=lora_a[:, :, :8])                    # in 8 against x's 16
    assert not applies(lora_a=lora_a.contiguous())                 # A's rows contiguous: not its layout
    assert not applies(lora_b=lora_b.contiguous())
    big = cpu_native.library().lora_max_rank() + 1
    assert not applies(lora_a=torch.zeros(2, 16, big).transpose(1, 2), lora_b=torch.zeros(2, big, 8).transpose(1, 2))
    too_long = torch.tensor([[0, 0, cpu_native.lora_max_chunk() + 1]], dtype=torch.int64)
    assert not applies(chunks=too_long)
    assert not applies(chunks=torch.tensor([[2, 0, 1]]))           # slot 2 of 2
    assert not applies(chunks=torch.tensor([[0, 4, 6]]))           # past the 5 adapted tokens
    assert not cpu_native.lora_apply(x, out, 0, lora_a, lora_b, torch.tensor([0, 6]), torch.tensor([[0, 0, 2]]),
                                     live)                         # token 6 of 6
    assert torch.equal(out, before)
    assert applies()


def test_fast_paths_off_runs_torch(cpu_fast_paths_off):
    lora_a, lora_b = adapters(1, 4, 16, 8)
    batch = TokensBySlot.prepare(torch.zeros(3, dtype=torch.int64), torch.device("cpu"))
    assert not cpu_native.lora_apply(torch.randn(3, 16), torch.randn(3, 8), 0, lora_a, lora_b, batch.order,
                                     batch.chunks, torch.ones(1, dtype=torch.uint8))
