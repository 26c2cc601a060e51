"""Token bitmask application (rein.engine.structured.kernels): the torch implementation against a
plain loop, and the Triton kernel against the torch one.

Without a GPU the Triton kernel runs under the interpreter on CPU tensors (TRITON_INTERPRET
must be set before triton.jit defines the kernel, so before the module is imported), with
tiny shapes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from rein.engine.structured.kernels import apply_token_bitmask, apply_token_bitmask_torch  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def random_case(batch: int, vocab: int, mask_rows: int, words: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (mask_rows, words), dtype=torch.int32, generator=g)
    rows = torch.randperm(batch, generator=g)[:mask_rows].tolist()
    return logits, bitmask, rows


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for k, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < bitmask.shape[1] and (int(bitmask[k, word]) >> (token % 32)) & 1
            if not allowed:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("batch,vocab,mask_rows,words", [
    (1, 64, 1, 2),        # whole words
    (3, 70, 2, 3),        # a vocabulary that ends inside a word; a subset of rows
    (4, 100, 4, 3),       # all rows, the mask covers fewer tokens (96) than the logits
    (5, 33, 0, 2),        # no constrained row
])
def test_torch_matches_the_loop(batch, vocab, mask_rows, words):
    logits, bitmask, rows = random_case(batch, vocab, mask_rows, words, seed=vocab)
    expected = reference(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)


def test_torch_path_on_inference_tensors():
    with torch.inference_mode():
        logits = torch.zeros(2, 40)
    bitmask = torch.tensor([[1, 0]], dtype=torch.int32)
    apply_token_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0]


def test_rows_and_mask_must_agree():
    with pytest.raises(ValueError):
        apply_token_bitmask(torch.zeros(2, 32), torch.zeros((2, 1), dtype=torch.int32), [0])
    with pytest.raises(ValueError):
        apply_token_bitmask(torch.zeros(1, 32), torch.zeros((1, 1), dtype=torch.int64), [0])


@pytest.mark.parametrize("batch,vocab,mask_rows,words,dtype", [
    (3, 70, 2, 3, torch.float32),
    (2, 1500, 2, 47, torch.float32),     # two blocks of the kernel, the last partial
    (4, 100, 3, 3, torch.float16),
])
def test_triton_matches_torch(batch, vocab, mask_rows, words, dtype):
    pytest.importorskip("triton")
    from rein.engine.structured.triton_bitmask import apply_token_bitmask_triton

    logits, bitmask, rows = random_case(batch, vocab, mask_rows, words, seed=batch * vocab)
    logits = logits.to(dtype)
    expected = logits.clone()
    apply_token_bitmask_torch(expected, bitmask, rows)
    got = logits.to(DEVICE)
    apply_token_bitmask_triton(got, bitmask.to(DEVICE), rows)
    assert torch.equal(got.cpu(), expected)
