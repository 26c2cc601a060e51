"""The sampler's logit processors: logit_bias and min_tokens (rein.engine.sampler, step 1).

They act on the rows that set them only, vectorized over the batch, before penalties and
before logprobs (so logprobs describe the distribution a token is drawn from)."""

from __future__ import annotations

import pytest
import torch

from rein.engine.sampler import Sampler, SamplingBatch, make_generator
from rein.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
VOCAB = 50


def batch(params, outputs=None, eos=None) -> SamplingBatch:
    return SamplingBatch(
        params=params,
        generators=[None if p.temperature == 0 else make_generator(p.seed, CPU) for p in params],
        prompt_token_ids=[[] for _ in params],
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
        eos_token_ids=eos,
    )


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_logit_bias_forces_and_bans_greedy_tokens():
    x = logits(3)
    top = x.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={7: 100}),
              SamplingParams(temperature=0, logit_bias={top[1]: -100}),
              SamplingParams(temperature=0)]
    out = Sampler()(x, batch(params)).token_ids
    assert out[0] == 7
    assert out[1] != top[1] and out[1] == x[1].clone().index_fill_(0, torch.tensor([top[1]]), -1e9).argmax()
    assert out[2] == top[2]


def test_logprobs_are_those_of_the_biased_distribution():
    x = logits(2, seed=1)
    bias = {3: 2.5, 9: -1.0, 40: 100.0}
    params = [SamplingParams(temperature=0, logprobs=5, logit_bias=bias), SamplingParams(temperature=0, logprobs=5)]
    out = Sampler()(x, batch(params))
    biased = x[0].clone()
    for token, b in bias.items():
        biased[token] += b
    expected = torch.log_softmax(biased, dim=-1)
    assert out.token_ids[0] == 40
    assert out.logprobs[0] == pytest.approx(expected[40].item(), abs=1e-5)
    assert out.logprobs[0] > -1e-3   # forced: probability ~1
    vals, ids = expected.topk(5)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(vals.tolist(), abs=1e-5)
    # The row without a bias is untouched.
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(x[1], -1).max().item(), abs=1e-5)


def test_seeded_row_with_bias_is_batch_invariant_and_others_unchanged():
    x = logits(4, seed=2)
    biased = SamplingParams(temperature=1.0, seed=5, logit_bias={1: 3.0, 2: 3.0, 3: -100})
    plain = [SamplingParams(temperature=0.8, seed=s) for s in (10, 11, 12)]
    alone = Sampler()(x[1:2], batch([biased])).token_ids
    without = Sampler()(x[[0, 2, 3]], batch(plain)).token_ids
    mixed = Sampler()(x, batch([plain[0], biased, plain[1], plain[2]])).token_ids
    assert mixed[1] == alone[0]
    assert [mixed[0], mixed[2], mixed[3]] == without


def test_bias_of_minus_100_bans_under_sampling():
    x = torch.zeros(64, VOCAB)
    x[:, 4] = 5.0   # the favourite of every row
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={4: -100}) for s in range(64)]
    assert 4 not in Sampler()(x, batch(params)).token_ids


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = torch.zeros(4, VOCAB)
    x[:, 5] = 10.0    # EOS would win
    x[:, 6] = 9.0     # then a stop token id
    x[:, 7] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[6], logprobs=2)] * 3 + [
        SamplingParams(temperature=0, stop_token_ids=[6])]
    outputs = [[1], [1, 2], [1, 2, 3], []]
    out = Sampler()(x, batch(params, outputs=outputs, eos=[{5}] * 4))
    assert out.token_ids == [7, 7, 5, 5]
    # Masked tokens have logprob -inf: they are not among the alternatives.
    assert out.top_logprobs[0][0][0] == 7 and out.top_logprobs[0][1][0] not in (5, 6)
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(x[0, [i for i in range(VOCAB) if i not in (5, 6)]], -1).max().item(), abs=1e-5)
    assert out.top_logprobs[2][0][0] == 5


def test_min_tokens_mask_wins_over_a_positive_bias_and_ignore_eos_leaves_eos():
    x = torch.zeros(2, VOCAB)
    x[:, 5] = 10.0
    p = SamplingParams(temperature=0, min_tokens=2, logit_bias={5: 100})
    # Row 1: ignore_eos (the engine passes no EOS ids), so only stop ids would be masked.
    out = Sampler()(x, batch([p, p], outputs=[[1], [1]], eos=[{5}, frozenset()]))
    assert out.token_ids[0] != 5 and out.token_ids[1] == 5


def test_out_of_vocabulary_ids_are_skipped():
    x = logits(1, seed=3)
    p = SamplingParams(temperature=0, logit_bias={VOCAB + 5: 100}, min_tokens=1, stop_token_ids=[VOCAB + 1])
    assert Sampler()(x, batch([p], eos=[{VOCAB}])).token_ids == [x.argmax().item()]


def test_input_logits_not_modified_by_processors():
    x = logits(2, seed=4)
    before = x.clone()
    Sampler()(x, batch([SamplingParams(temperature=0, logit_bias={1: 50}, min_tokens=1)] * 2, eos=[{2}, {3}]))
    assert torch.equal(x, before)
