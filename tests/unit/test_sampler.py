"""Tests for rein.engine.sampler: filters, penalties, logprobs, seeding, batch invariance.

All randomness comes from fixed seeds, so the statistical checks are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from rein.engine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingBatch,
    apply_penalties,
    argmax_rows,
    greedy_tokens,
    make_generator,
)
from rein.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_batch(params: list[SamplingParams], prompts=None, outputs=None,
               generators=None) -> SamplingBatch:
    if generators is None:
        generators = [None if p.temperature == 0 else make_generator(p.seed, CPU) for p in params]
    return SamplingBatch(
        params=params,
        generators=generators,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in params],
        output_token_ids=outputs if outputs is not None else [[] for _ in params],
    )


def sample_counts(logits_row: torch.Tensor, params: SamplingParams, n: int,
                  seed0: int = 0) -> torch.Tensor:
    """Draw n tokens for one logits row: n batch rows, each with its own seeded generator."""
    vocab = logits_row.shape[0]
    rows = [SamplingParams(**{**params.__dict__, "seed": seed0 + i}) for i in range(n)]
    out = Sampler()(logits_row.expand(n, vocab), make_batch(rows))
    return torch.bincount(torch.tensor(out.token_ids), minlength=vocab)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token of probability 0"
    expected = probs[support].double() * n
    return (((counts[support].double() - expected) ** 2) / expected).sum().item()


# Chi-square critical value for p = 0.001 at 7 degrees of freedom (8 tokens).
CHI2_CRIT_7DF = 24.32

LOGITS8 = torch.tensor([1.5, 0.3, -0.7, 2.2, 0.0, -1.8, 1.1, 0.6])


# --- greedy -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype):
    torch.manual_seed(0)
    logits = (torch.randn(64, 1000) * 3).to(dtype)
    # Ties (common in bf16): argmax must pick the first index, like torch.argmax.
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1
    expected = torch.argmax(logits, dim=-1).tolist()
    params = [SamplingParams(temperature=0.0) for _ in range(64)]
    out = Sampler()(logits, make_batch(params))
    assert out.token_ids == expected
    assert out.token_ids[3] == 10
    assert out.logprobs is None and out.top_logprobs is None
    # Same answer on the slow path (logprobs requested forces float32 + logsumexp).
    params = [SamplingParams(temperature=0.0, logprobs=2) for _ in range(64)]
    assert Sampler()(logits, make_batch(params)).token_ids == expected


def test_greedy_rows_mixed_with_random_rows_stay_argmax():
    torch.manual_seed(1)
    logits = torch.randn(10, 300)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, seed=i)
              for i in range(10)]
    out = Sampler()(logits, make_batch(params))
    expected = torch.argmax(logits, dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 10, 2)] == expected[1::2]


def test_input_logits_not_modified():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=5, min_p=0.1, seed=1,
                             repetition_penalty=1.3, presence_penalty=1.0, logprobs=3),
              SamplingParams(temperature=0.0, frequency_penalty=0.5),
              SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.0)]
    Sampler()(logits, make_batch(params, prompts=[[1, 2]] * 4, outputs=[[3, 3, 4]] * 4))
    assert torch.equal(logits, before)


# --- filters --------------------------------------------------------------------------

def test_top_k_1_equals_greedy_at_temperature_1():
    torch.manual_seed(3)
    for step in range(20):
        logits = torch.randn(16, 500) * 2
        params = [SamplingParams(temperature=1.0, top_k=1, seed=step * 100 + i) for i in range(16)]
        out = Sampler()(logits, make_batch(params))
        assert out.token_ids == torch.argmax(logits, dim=-1).tolist()


def test_tiny_top_p_always_picks_top_token():
    torch.manual_seed(4)
    logits = torch.randn(32, 400)
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(32)]
    assert Sampler()(logits, make_batch(params)).token_ids == torch.argmax(logits, -1).tolist()


def test_top_k_restricts_to_k_best_and_matches_renormalized_softmax():
    probs = torch.softmax(LOGITS8, -1)
    top3 = torch.topk(LOGITS8, 3).indices
    expected = torch.zeros(8)
    expected[top3] = probs[top3] / probs[top3].sum()
    counts = sample_counts(LOGITS8, SamplingParams(temperature=1.0, top_k=3), 6000)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(top3.tolist())
    assert chi_square(counts, expected) < 13.82  # 2 df, p = 0.001


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 needs tokens 0 and 1 (mass before 1 is 0.5 < 0.7,
    # mass before 2 is 0.8 >= 0.7).
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = sample_counts(logits, SamplingParams(temperature=1.0, top_p=0.7), 4000)
    assert counts[2] == 0 and counts[3] == 0
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8
    assert chi_square(counts, expected) < 10.83  # 1 df, p = 0.001


def test_min_p_filters_tokens_below_fraction_of_max():
    # min_p 0.2 with max prob 0.5: threshold 0.1 drops token 3 (0.05) only.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = sample_counts(logits, SamplingParams(temperature=1.0, min_p=0.2), 4000)
    assert counts[3] == 0
    assert (counts[:3] > 0).all()
    expected = torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95
    assert chi_square(counts, expected) < 13.82
    # min_p 0.7: only the top token survives.
    counts = sample_counts(logits, SamplingParams(temperature=1.0, min_p=0.7), 500)
    assert counts[0] == 500


def test_top_k_keeps_ties_at_the_cutoff():
    # Tokens 1 and 2 tie for 2nd place: top_k=2 keeps both (cutoff is a value, not a
    # position), so the result cannot depend on sort order.
    logits = torch.tensor([2.0, 1.0, 1.0, -5.0])
    counts = sample_counts(logits, SamplingParams(temperature=1.0, top_k=2), 2000)
    assert counts[1] > 0 and counts[2] > 0 and counts[3] == 0


# --- distribution and temperature ------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_sampling_matches_softmax_at_temperature(temperature):
    counts = sample_counts(LOGITS8, SamplingParams(temperature=temperature), 20000)
    assert chi_square(counts, torch.softmax(LOGITS8 / temperature, -1)) < CHI2_CRIT_7DF


def test_temperature_changes_the_distribution():
    # Sanity that the chi-square test has power: T=0.5 samples do NOT fit softmax at T=1,
    # and lower temperature concentrates mass on the top token.
    cold = sample_counts(LOGITS8, SamplingParams(temperature=0.5), 20000)
    hot = sample_counts(LOGITS8, SamplingParams(temperature=1.7), 20000)
    assert chi_square(cold, torch.softmax(LOGITS8, -1)) > 10 * CHI2_CRIT_7DF
    top = int(LOGITS8.argmax())
    assert cold[top] > hot[top] * 1.5


def test_unseeded_rows_use_global_rng():
    torch.manual_seed(5)
    n = 20000
    params = [SamplingParams(temperature=1.0) for _ in range(n)]
    batch = make_batch(params, generators=[None] * n)
    out = Sampler()(LOGITS8.expand(n, 8), batch)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=8)
    assert chi_square(counts, torch.softmax(LOGITS8, -1)) < CHI2_CRIT_7DF


# --- seeding and batch invariance ------------------------------------------------------

def _run_steps(target: SamplingParams, position: int, batch_size: int, steps: int,
               other_params: list[SamplingParams]) -> list[int]:
    """Tokens the target row gets over `steps`, placed at `position` among other rows.

    The target row's logits are the same in every scenario; the other rows' logits,
    params and generators change with the scenario.
    """
    vocab = 257
    target_logits = torch.Generator().manual_seed(1234)
    noise = torch.Generator().manual_seed(batch_size * 31 + position)
    target_gen = make_generator(target.seed, CPU)
    other_gens = [make_generator(1000 + j, CPU) for j in range(batch_size)]
    history: list[int] = []
    tokens = []
    for _ in range(steps):
        row = torch.randn(vocab, generator=target_logits) * 2
        logits = torch.randn(batch_size, vocab, generator=noise) * 2
        logits[position] = row
        params = [other_params[j % len(other_params)] for j in range(batch_size)]
        params[position] = target
        gens = [None if p.temperature == 0 else other_gens[j] for j, p in enumerate(params)]
        gens[position] = target_gen
        outputs = [[1, 2, 3] for _ in range(batch_size)]
        outputs[position] = list(history)
        prompts = [[4, 5] for _ in range(batch_size)]
        prompts[position] = [7, 8, 9]
        out = Sampler()(logits, SamplingBatch(params, gens, prompts, outputs))
        tokens.append(out.token_ids[position])
        history.append(out.token_ids[position])
    return tokens


OTHERS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.5),
    SamplingParams(temperature=1.2, top_k=7, logprobs=5),
    SamplingParams(temperature=0.6, min_p=0.3, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=1.0, top_k=300, frequency_penalty=1.0),
]


@pytest.mark.parametrize("target", [
    SamplingParams(temperature=1.0, seed=42),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7),
    SamplingParams(temperature=1.3, min_p=0.05, seed=11),
    SamplingParams(temperature=1.0, top_k=50, seed=3, repetition_penalty=1.2,
                   frequency_penalty=0.3, presence_penalty=0.2, logprobs=2),
])
def test_seeded_row_is_batch_invariant(target):
    steps = 25
    alone = _run_steps(target, 0, 1, steps, OTHERS)
    assert len(set(alone)) > 3  # actually random, not a degenerate constant
    scenarios = [(0, 5, OTHERS), (4, 5, OTHERS), (2, 9, OTHERS[2:]), (30, 64, OTHERS),
                 (1, 3, [SamplingParams(temperature=0.0)]),  # all-greedy neighbours
                 (0, 2, [SamplingParams(temperature=1.0, top_p=0.3)])]
    for position, size, others in scenarios:
        assert _run_steps(target, position, size, steps, others) == alone, (position, size)


def test_same_seed_same_tokens_different_seed_different_tokens():
    torch.manual_seed(6)
    logits = torch.randn(50, 1000)

    def run(seed):
        gen = make_generator(seed, CPU)
        out = []
        for step in range(50):
            batch = SamplingBatch([SamplingParams(temperature=1.0, seed=seed)], [gen], [[]], [[]])
            out.append(Sampler()(logits[step:step + 1], batch).token_ids[0])
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_make_generator():
    a = torch.rand(5, generator=make_generator(9, "cpu"))
    b = torch.rand(5, generator=make_generator(9, torch.device("cpu")))
    assert torch.equal(a, b)
    c = torch.rand(5, generator=make_generator(None, "cpu"))
    d = torch.rand(5, generator=make_generator(None, "cpu"))
    assert not torch.equal(c, d)


# --- penalties --------------------------------------------------------------------------

def test_penalties_follow_the_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0],
                           [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    params = [SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams()]
    prompts = [[0, 5], [0, 1]]
    outputs = [[1, 1, 3], [3]]
    got = apply_penalties(logits, params, prompts, outputs)
    # Row 0: seen = {0, 5} (prompt) | {1, 3} (output).
    #   repetition: 0: 2/2 = 1; 1: -1*2 = -2; 3: 3/2 = 1.5; 5: 0 stays 0.
    #   output counts {1: 2, 3: 1}: 1: -2 - 0.5 - 2*0.25 = -3; 3: 1.5 - 0.5 - 0.25 = 0.75.
    #   prompt-only tokens get no presence/frequency penalty.
    assert got[0].tolist() == [1.0, -3.0, 0.5, 0.75, -2.0, 0.0]
    assert torch.equal(got[1], logits[1])  # neutral params: unchanged
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0]))


def test_repetition_penalty_below_one_boosts_seen_tokens():
    logits = torch.tensor([[1.0, -1.0, 1.0]])
    got = apply_penalties(logits, [SamplingParams(repetition_penalty=0.5)], [[0]], [[1]])
    assert got.tolist() == [[2.0, -0.5, 1.0]]


def test_negative_presence_and_frequency_penalties():
    logits = torch.zeros(1, 4)
    got = apply_penalties(logits, [SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)],
                          [[0, 1, 2]], [[2, 2, 2]])
    assert got.tolist() == [[0.0, 0.0, 2.5, 0.0]]


def test_sampler_applies_penalties_for_greedy_and_logprobs():
    # Token 0 is the argmax, but it was generated 3 times; frequency 1.0 pushes it below 1.
    logits = torch.tensor([[3.0, 1.5, 0.0, -1.0],
                           [3.0, 1.5, 0.0, -1.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=4),
              SamplingParams(temperature=0.0, logprobs=4)]
    out = Sampler()(logits, make_batch(params, outputs=[[0, 0, 0], [0, 0, 0]]))
    assert out.token_ids == [1, 0]
    penalized = torch.tensor([0.0, 1.5, 0.0, -1.0])
    expected = torch.log_softmax(penalized, -1)
    assert out.top_logprobs[0][0][0] == 1
    got = dict(out.top_logprobs[0])
    for tok in range(4):
        assert got[tok] == pytest.approx(expected[tok].item(), abs=1e-6)
    assert out.logprobs[0] == pytest.approx(expected[1].item(), abs=1e-6)
    # Row without penalties: logprobs of the raw logits.
    assert out.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1)[0].item(), abs=1e-6)


def test_penalties_only_touch_rows_that_ask():
    torch.manual_seed(7)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=0.0, repetition_penalty=3.0, logprobs=0),
              SamplingParams(temperature=0.0, logprobs=0)]
    outputs = [[int(logits[0].argmax())], [int(logits[1].argmax())], [int(logits[2].argmax())]]
    out = Sampler()(logits, make_batch(params, outputs=outputs))
    raw = torch.log_softmax(logits, -1)
    for i in (0, 2):
        assert out.token_ids[i] == int(logits[i].argmax())
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
    penalized = apply_penalties(logits[1:2], [params[1]], [[]], [outputs[1]])
    assert out.token_ids[1] == int(penalized.argmax())


# --- logprobs ---------------------------------------------------------------------------

def test_logprobs_match_log_softmax_and_topk():
    torch.manual_seed(8)
    vocab = 500
    logits = torch.randn(6, vocab) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=1.0, seed=1, logprobs=20),
              SamplingParams(temperature=0.7, seed=2, logprobs=0),
              SamplingParams(temperature=1.0, seed=3),
              SamplingParams(temperature=0.5, top_k=4, seed=4, logprobs=1),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_batch(params))
    ref = torch.log_softmax(logits, -1)
    assert isinstance(out, SamplerOutput)
    assert len(out.logprobs) == 6 and len(out.top_logprobs) == 6
    for i, p in enumerate(params):
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
        k = p.logprobs or 0
        top = out.top_logprobs[i]
        assert len(top) == k
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        if k:
            ref_vals, ref_ids = torch.topk(ref[i], k)
            assert [t for t, _ in top] == ref_ids.tolist()
            assert values == pytest.approx(ref_vals.tolist(), abs=1e-5)
    # Greedy row: the chosen token is the top alternative.
    assert out.top_logprobs[0][0][0] == out.token_ids[0]


def test_logprobs_do_not_depend_on_temperature_or_filters():
    torch.manual_seed(9)
    logits = torch.randn(1, 100).expand(3, 100)
    params = [SamplingParams(temperature=0.0, logprobs=5),
              SamplingParams(temperature=0.2, top_p=0.5, seed=1, logprobs=5),
              SamplingParams(temperature=1.9, top_k=3, seed=2, logprobs=5)]
    out = Sampler()(logits, make_batch(params))
    assert out.top_logprobs[0] == out.top_logprobs[1] == out.top_logprobs[2]


def test_logprobs_none_when_nobody_asks_and_zero_means_chosen_only():
    logits = torch.randn(2, 30)
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_batch(params))
    assert out.logprobs is None and out.top_logprobs is None
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=0), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, make_batch(params))
    assert out.top_logprobs == [[], []]
    assert all(math.isfinite(v) and v <= 0 for v in out.logprobs)


def test_logprobs_with_masked_vocab_and_low_precision_input():
    # -inf logits (e.g. padded vocabulary) never get sampled; bf16 input is handled in fp32.
    torch.manual_seed(10)
    logits = torch.randn(4, 64).to(torch.bfloat16)
    logits[:, 40:] = float("-inf")
    params = [SamplingParams(temperature=1.0, seed=i, top_p=0.95, logprobs=2) for i in range(4)]
    out = Sampler()(logits, make_batch(params))
    assert all(t < 40 for t in out.token_ids)
    ref = torch.log_softmax(logits.float(), -1)
    for i, tok in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 5), make_batch([SamplingParams()]))


def test_penalties_accept_tensor_token_ids():
    torch.manual_seed(11)
    logits = torch.randn(2, 30)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4),
              SamplingParams(presence_penalty=-0.7, repetition_penalty=0.8)]
    prompts = [[1, 2, 3], [4, 4]]
    outputs = [[3, 5, 5], []]
    ref = apply_penalties(logits, params, prompts, outputs)
    as_tensors = apply_penalties(logits, params, [torch.tensor(p) for p in prompts],
                                 [torch.tensor(o, dtype=torch.long) for o in outputs])
    mixed = apply_penalties(logits, params, [torch.tensor(prompts[0]), prompts[1]], outputs)
    assert torch.equal(ref, as_tensors) and torch.equal(ref, mixed)


# -- the greedy fast path (NumPy's argmax on CPU float32) against torch's argmax ---------------------


def _hard_rows() -> torch.Tensor:
    """Rows where argmax conventions differ: ties, NaN, infinities, all -inf, negative zero."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([
        [1.0, 3.0, 3.0, 2.0, 3.0],          # ties: the first maximum
        [1.0, nan, 5.0, nan, 0.0],          # a NaN counts as the maximum: the first NaN
        [-inf, -inf, -inf, -inf, -inf],     # nothing allowed: index 0
        [inf, 1.0, inf, 0.0, -inf],
        [-0.0, 0.0, -1.0, -0.0, 0.0],       # -0.0 == 0.0: a tie
        [-5.0, -4.0, -3.0, -2.0, -1.0],
    ])
    return torch.cat([rows, torch.randn(64, 5), torch.randn(64, 5).round()])


@pytest.mark.parametrize("inference", [False, True])
def test_argmax_rows_matches_torch(inference):
    x = _hard_rows()
    with torch.inference_mode(inference):
        x = x.clone()
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
        assert greedy_tokens(x) == x.argmax(dim=-1).tolist()
        strided = torch.randn(8, 64)[:, ::3]   # not contiguous
        assert torch.equal(argmax_rows(strided), strided.argmax(dim=-1))


def test_argmax_rows_other_dtypes_use_torch():
    x = _hard_rows().to(torch.bfloat16)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert greedy_tokens(x) == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("extra", [
    {},                                        # the fast path itself
    {"logprobs": 0},                           # the general path, all rows greedy
    {"min_tokens": 1},                         # min_tokens met: the general path's early argmax
    {"logit_bias": {3: 0.0}},                  # a no-op bias: the general path processes it
])
def test_greedy_paths_agree(extra):
    """A batch of greedy rows gives torch's argmax of the logits whichever path the sampler takes
    (the fast one for plain rows, the general one when a row asks for more)."""
    logits = torch.cat([_hard_rows(), torch.randn(30, 5)]).repeat(1, 3)
    params = [SamplingParams(temperature=0, **extra) for _ in range(logits.shape[0])]
    outputs = [[1, 2] for _ in params]
    out = Sampler()(logits, make_batch(params, outputs=outputs))
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def _requests(params: list[SamplingParams]) -> list:
    from types import SimpleNamespace
    return [SimpleNamespace(sampling_params=p, generator=make_generator(i, CPU), prompt_token_ids=[1, 2, i],
                            output_token_ids=[3] * i, eos_token_ids=frozenset({4})) for i, p in enumerate(params)]


def test_batch_of_plain_greedy_requests_samples_as_the_full_batch():
    requests = _requests([SamplingParams(temperature=0) for _ in range(5)])
    lean = SamplingBatch.of(requests)
    assert lean.params == [r.sampling_params for r in requests] and not lean.output_token_ids
    full = SamplingBatch([r.sampling_params for r in requests], [r.generator for r in requests],
                         [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
                         [r.eos_token_ids for r in requests])
    logits = torch.randn(5, 40)
    assert Sampler()(logits, lean) == Sampler()(logits, full)


def test_the_sampler_takes_the_plain_greedy_check_of_a_batch_of_requests(monkeypatch):
    # `of` looked at every row's params: the sampler does not look again, either way.
    import rein.engine.sampler as sampler

    logits = torch.randn(4, 40)
    greedy = SamplingBatch.of(_requests([SamplingParams(temperature=0) for _ in range(4)]))
    sampled = SamplingBatch.of(_requests([SamplingParams(temperature=1.0, seed=1) for _ in range(4)]))
    assert greedy.plain_greedy is True and sampled.plain_greedy is False
    calls = []
    monkeypatch.setattr(sampler, "_plain_greedy", lambda params: calls.append(params) or False)
    assert Sampler()(logits, greedy).token_ids == logits.argmax(dim=-1).tolist()
    assert len(Sampler()(logits, sampled).token_ids) == 4
    assert not calls


@pytest.mark.parametrize("extra", [{"temperature": 1.0}, {"min_tokens": 3}, {"repetition_penalty": 1.3},
                                   {"logprobs": 1}, {"logit_bias": {2: 5.0}}])
def test_batch_of_requests_carries_every_list_a_row_may_need(extra):
    params = [SamplingParams(temperature=0) for _ in range(3)] + [SamplingParams(**({"temperature": 0} | extra))]
    requests = _requests(params)
    batch = SamplingBatch.of(requests)
    assert batch.generators == [r.generator for r in requests]
    assert batch.prompt_token_ids == [r.prompt_token_ids for r in requests]
    assert batch.output_token_ids == [r.output_token_ids for r in requests]
    assert batch.eos_token_ids == [r.eos_token_ids for r in requests]
