"""The Triton fused MoE (rein.kernels.triton_moe) against its torch reference,
rein.model.architectures.moe.grouped_experts. Without a GPU it runs under the Triton interpreter on
CPU tensors (TRITON_INTERPRET set before the kernels are defined), tiny shapes."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels import triton_moe  # noqa: E402
from rein.model.architectures.moe import grouped_experts, route  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
F32, F16 = torch.float32, torch.float16
TOL = {F32: dict(atol=1e-5, rtol=1e-5), F16: dict(atol=2e-2, rtol=2e-2)}


def case(tokens, experts, top_k, hidden=32, inter=24, dtype=F32, seed=0, skip_expert=None):
    """Activations, stacked experts and a routing of `tokens` tokens; `skip_expert` gets no token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9
    weights, ids = route(logits, top_k, renormalize=True)
    to = dict(device=DEVICE)
    return (x.to(dtype=dtype, **to), gate_up.to(dtype=dtype, **to), down.to(dtype=dtype, **to),
            weights.to(**to), ids.to(**to))


@pytest.mark.parametrize("tokens, experts, top_k", [
    (1, 4, 2),     # one decode token
    (5, 8, 2),     # a few tokens, most experts idle
    (40, 4, 2),    # 80 pairs > 16 per expert: 64-row tiles
    (7, 3, 3),     # every expert on every token
])
def test_fused_experts_equal_the_grouped_torch_path(tokens, experts, top_k):
    x, gate_up, down, weights, ids = case(tokens, experts, top_k)
    want = grouped_experts(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    got = triton_moe.fused_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got.cpu(), want, **TOL[F32])


def test_fused_experts_with_an_idle_expert_and_odd_sizes():
    x, gate_up, down, weights, ids = case(9, 5, 2, hidden=40, inter=20, skip_expert=2)
    assert not (ids == 2).any()
    want = grouped_experts(x.cpu(), gate_up.cpu(), down.cpu(), weights.cpu(), ids.cpu())
    torch.testing.assert_close(triton_moe.fused_experts(x, gate_up, down, weights, ids).cpu(), want, **TOL[F32])


def test_fused_experts_in_half_precision():
    x, gate_up, down, weights, ids = case(6, 4, 2, dtype=F16)
    want = grouped_experts(x.float().cpu(), gate_up.float().cpu(), down.float().cpu(), weights.cpu(), ids.cpu())
    got = triton_moe.fused_experts(x, gate_up, down, weights, ids)
    assert got.dtype == F16
    torch.testing.assert_close(got.float().cpu(), want, **TOL[F16])


def test_alignment_puts_every_pair_once_in_single_expert_tiles():
    ids = torch.tensor([[0, 2], [2, 1], [0, 2], [3, 0]], device=DEVICE)
    block_m = 4
    sorted_ids, block_experts, padded_total = triton_moe.align_by_expert(ids, 5, block_m)
    num_pairs = ids.numel()
    total = int(padded_total.item())
    assert total == 4 * block_m   # experts 0, 1, 2, 3 each fill one padded tile; expert 4 none
    real = sorted_ids[sorted_ids < num_pairs].tolist()
    assert sorted(real) == list(range(num_pairs))
    flat = ids.reshape(-1).tolist()
    for tile in range(total // block_m):
        pairs = [p for p in sorted_ids[tile * block_m:(tile + 1) * block_m].tolist() if p < num_pairs]
        assert pairs and all(flat[p] == int(block_experts[tile]) for p in pairs)
    assert (sorted_ids[total:] == num_pairs).all()


def test_shapes_are_checked_before_launch():
    x, gate_up, down, weights, ids = case(3, 4, 2)
    with pytest.raises(ValueError, match="expert shapes"):
        triton_moe.fused_experts(x, gate_up, down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="routing weights"):
        triton_moe.fused_experts(x, gate_up, down, weights[:, :1], ids)
