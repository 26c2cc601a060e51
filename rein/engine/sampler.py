"""Turn one decoding step's logits into chosen tokens (and their logprobs).

The engine calls `Sampler()(logits, batch)` once per step with a [B, V] logits tensor
and one `SamplingBatch` row per request that samples this step. The pipeline follows
vLLM / OpenAI semantics:

1. Logit processors on the raw logits (float32), for the rows that set them:
   - ``logit_bias``: each listed token's bias is added to its logit (OpenAI: -100
     effectively bans a token, +100 all but forces it);
   - ``min_tokens``: while a row has fewer output tokens than that, its EOS ids (unless
     ``ignore_eos``) and ``stop_token_ids`` are set to -inf, so it cannot stop.
2. Penalties (vLLM applies them after the processors too):
   - repetition penalty (HF / vLLM): for every token seen in the prompt OR the output,
     positive logits are divided by the penalty and non-positive ones multiplied by it;
   - presence / frequency penalty (OpenAI): on output tokens only,
     ``logit -= presence * (count > 0) + frequency * count``.
3. Logprobs, from the *processed and penalized* logits at temperature 1, before
   temperature and top-k / top-p / min-p. So a token's logprob is the model's own
   log-probability (identical to ``log_softmax(logits)`` when no bias, min_tokens or
   penalty is set) and does not change with the request's temperature or filters; -inf
   only appears where the model, a ban or the min_tokens mask put it. vLLM v1 reports
   "raw" logprobs (before all of step 1 and 2) by default; rein reports the distribution
   the token is actually drawn from (vLLM's "processed" mode, minus temperature), which
   keeps the logprob of a greedy choice equal to the top logprob, gives a forced token a
   logprob near 0, and lets a classifier bias its label tokens up and read their relative
   probabilities among the top logprobs (equal biases keep their ratios).
4. Greedy rows (temperature 0): argmax of the processed, penalized logits.
5. Random rows: temperature scaling, then top-k, top-p (on the top-k survivors), then
   min-p, then one draw.

Prompt logprobs (SamplingParams.prompt_logprobs) are not computed here but from the raw
logits of the prompt positions (rein.engine.prompt_logprobs), as vLLM does.

Batch invariance is the design constraint that shapes the sampling code: a seeded
request must get the same tokens whatever else shares its batch. Therefore
  - every filter reduces to one per-row cutoff *logit value* ("keep tokens whose logit
    is >= cutoff") computed only from that row, so ties at the cutoff are kept as a
    whole and the result does not depend on sort order or on which code path the rest
    of the batch forced (top-k via topk vs via full sort give the same cutoff);
  - the randomness of a row is one ``exponential_`` draw of exactly V numbers from the
    row's own generator (no draw size depends on B), and the token is chosen with the
    exponential race / Gumbel-max trick: ``argmax(x - log q)`` with ``q ~ Exp(1)``,
    which samples from ``softmax(x)`` exactly.
Everything else is vectorized over the batch; the only per-row Python work is reading
the params and the generator draws. The draws (`draw_exponential`) and the temperature,
filters and race (`race`) are also what the whole-step decode graphs run
(rein.engine.cuda_graphs), for the rows that need nothing else (`samples_on_device`), so a
token is the same whichever path sampled it. Work no row needs is skipped; with all rows greedy,
no logprobs, no bias, no min_tokens and no penalties the step is a single argmax of the
input.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from rein.engine.sampling_params import SamplingParams

# Temperatures below this are treated as greedy (as vLLM does): dividing by them would
# only turn sampling into an argmax with extra float noise.
GREEDY_TEMPERATURE_EPS = 1e-5

# Smallest Exp(1) draw we let through: exponential_ can return exactly 0 (probability
# ~2^-24 per element, i.e. often with a 150k vocabulary), and -log(0) = inf would turn a
# masked -inf logit into NaN, which argmax treats as the maximum.
_MIN_EXP_DRAW = torch.finfo(torch.float32).tiny


@dataclass
class SamplingBatch:
    """What the engine passes per step: one entry per row of the logits tensor.

    `generators[i]` is the row's own generator (see `make_generator`), on the logits'
    device; None is fine for greedy rows. A random row with None draws from torch's
    global RNG instead (still correct, but not reproducible and not batch-invariant).
    `prompt_token_ids[i]` is only read for rows with a repetition penalty and
    `output_token_ids[i]` only for rows with any penalty or an unmet `min_tokens` (its
    length is the row's output count), so the engine may pass empty sequences for other
    rows. Either may be a list or a 1-D integer tensor. `eos_token_ids[i]` (the request's
    EOS ids, empty with ignore_eos) is only read for rows still short of `min_tokens`;
    None means no EOS ids (only the rows' stop_token_ids are held back). `plain_greedy`:
    whether every row is plain greedy, when the maker knows it (`of`); None: `Sampler` looks.
    """

    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    prompt_token_ids: list[Sequence[int]]
    output_token_ids: list[Sequence[int]]
    eos_token_ids: list[Collection[int]] | None = None
    plain_greedy: bool | None = None

    @classmethod
    def of(cls, requests: Sequence[Any]) -> SamplingBatch:
        """The batch of the engine's requests (rein.engine.request.Request), their own lists
        (not copied). When every row is plain greedy (`Sampler` then reads only `params`), the
        per-row lists are left empty: building them was a good share of a large batch's step."""
        params = [r.sampling_params for r in requests]
        if _plain_greedy(params):
            return cls(params, [], [], [], plain_greedy=True)
        return cls(params, [r.generator for r in requests], [r.prompt_token_ids for r in requests],
                   [r.output_token_ids for r in requests], [r.eos_token_ids for r in requests], plain_greedy=False)


@dataclass
class SamplerOutput:
    """The step's result, one entry per row.

    `logprobs` is None when no row asked for logprobs; otherwise it holds the chosen
    token's logprob for every row (also for rows that did not ask, which the engine
    should simply ignore). `top_logprobs` is None when no row asked; otherwise per row
    up to `params.logprobs` (token_id, logprob) pairs sorted by logprob descending, and
    [] for rows whose `logprobs` is 0 or None.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, or with fresh OS entropy when None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE_EPS


def _plain_greedy(params: Sequence[SamplingParams]) -> bool:
    """Whether every row is greedy with nothing to process first: no logprobs, logit_bias,
    min_tokens or penalties (a row with min_tokens, met or not, takes the general path, which
    looks at its output count)."""
    return _unprocessed(params, greedy=True)


def samples_on_device(params: Sequence[SamplingParams]) -> bool:
    """Whether every row needs only greedy, temperature, top-k, top-p and min-p: what the
    whole-step decode graphs (rein.engine.cuda_graphs) sample; the others (logprobs, logit_bias,
    min_tokens, penalties) need this module's host-side steps."""
    return _unprocessed(params, greedy=False)


def _unprocessed(params: Sequence[SamplingParams], greedy: bool) -> bool:
    """Whether no row asks for logprobs, logit_bias, min_tokens or penalties (and, with `greedy`,
    every row is greedy). One plain loop: it runs for every row of every step."""
    for p in params:
        if ((greedy and p.temperature >= GREEDY_TEMPERATURE_EPS) or p.logprobs is not None or p.logit_bias
                or p.min_tokens or p.needs_penalties):
            return False
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, as torch's: the first maximum, a NaN counting as the maximum. A CPU
    float32 tensor goes through NumPy, whose vectorized argmax is some 15x faster than torch's
    (1.2 ms vs 80 us for [256, 2048] on one thread; bench/host_step.py) with the same answers."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and not x.requires_grad:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """`argmax_rows(logits)` as a list of token ids."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _flat_tokens(
    seqs: Sequence[Sequence[int]], num_cols: int, device: torch.device
) -> torch.Tensor:
    """Flat index ``row * num_cols + token`` of every token in `seqs` (row = position).

    One flat index vector instead of a padded [R, L] matrix: no padding column, and a
    single host-to-device copy for the token ids.
    """
    lengths = [len(s) for s in seqs]
    if all(isinstance(s, torch.Tensor) for s in seqs):
        tokens = torch.cat([s.reshape(-1).to(device=device, dtype=torch.long) for s in seqs])
    else:
        flat = list(chain.from_iterable(
            s.tolist() if isinstance(s, torch.Tensor) else s for s in seqs))
        tokens = torch.tensor(flat, dtype=torch.long, device=device)
    # output_size spares a device sync on CUDA (repeat_interleave cannot know it).
    rows = torch.repeat_interleave(
        torch.arange(len(seqs), device=device),
        torch.tensor(lengths, dtype=torch.long, device=device),
        output_size=tokens.numel(),
    )
    return rows * num_cols + tokens


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Return float32 [R, V] logits with repetition, frequency and presence penalties.

    Every row is processed (rows without penalties come back unchanged, since the
    neutral values 1 / 0 are exact identities); `Sampler` only passes rows that need it.
    The input is not modified.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    out = logits.float()
    if num_rows == 0:
        return out.clone()

    # Output-token counts [R, V]: one scatter_add over the flat indices of all rows.
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    if any(len(s) for s in output_token_ids):
        idx = _flat_tokens(output_token_ids, vocab, device)
        counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float32))
    counts = counts.view(num_rows, vocab)
    in_output = counts > 0

    pen = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
        dtype=torch.float32, device=device,
    )
    rep, freq, pres = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]

    rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep_rows:
        # Tokens seen in the prompt count for the repetition penalty only; prompts are
        # read just for the rows that use it, since they can be long.
        seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
        rep_set = set(rep_rows)
        prompts = [prompt_token_ids[i] if i in rep_set else () for i in range(num_rows)]
        if any(len(s) for s in prompts):
            seen[_flat_tokens(prompts, vocab, device)] = True
        seen = seen.view(num_rows, vocab) | in_output
        factor = torch.where(seen, rep, torch.ones_like(rep))
        out = torch.where(out > 0, out / factor, out * factor)

    return out - freq * counts - pres * in_output


def _filter_cutoffs(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor,
                    min_p: torch.Tensor, k_max: int, need_p: bool,
                    need_min_p: bool) -> torch.Tensor:
    """Per-row logit cutoff [S] combining top-k, top-p and min-p (-inf: keep all).

    `x` holds temperature-scaled logits; `top_k` (None when no row uses top-k) is 0 for
    rows without top-k, including top_k >= V, and `k_max` its largest value. Each
    filter's cutoff is a value taken from the row itself, so the kept set is
    "logit >= cutoff" (ties at the cutoff all kept) whichever path computed it.
    """
    neg_inf = torch.full((x.shape[0],), float("-inf"), device=x.device)
    cutoff = neg_inf

    # Descending values: a full sort when top-p needs the whole distribution, else topk
    # of the largest k requested, which gives the same leading values.
    if need_p:
        desc = x.sort(dim=-1, descending=True).values
    elif top_k is not None:
        desc = x.topk(k_max, dim=-1).values
    else:
        desc = x.amax(dim=-1, keepdim=True)
    row_max = desc[:, 0]

    if top_k is not None:
        kth = desc.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        cutoff = torch.where(top_k > 0, kth, neg_inf)

    if need_p:
        # top-p acts on the top-k survivors, renormalized.
        if top_k is not None:
            desc = desc.masked_fill(desc < cutoff.unsqueeze(1), float("-inf"))
        probs = desc.softmax(dim=-1)
        # Keep a token while the mass strictly before it is < top_p (vLLM's rule); the
        # top token is always kept.
        mass_before = probs.cumsum(dim=-1) - probs
        n_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=-1).clamp(min=1)
        pth = desc.gather(1, (n_keep - 1).unsqueeze(1)).squeeze(1)
        # top_p == 1 must be a no-op even where the float cumsum falls short of 1.
        cutoff = torch.maximum(cutoff, torch.where(top_p < 1.0, pth, neg_inf))

    if need_min_p:
        # p >= min_p * p_max  <=>  logit >= max_logit + log(min_p); log(0) = -inf keeps all.
        # Renormalizing after top-k / top-p does not change the ratio to p_max.
        cutoff = torch.maximum(cutoff, row_max + torch.log(min_p))
    return cutoff


def filter_knobs(params: SamplingParams, vocab: int) -> tuple[float, int, float, float]:
    """A random row's (temperature, top_k, top_p, min_p) as the tensor code reads them: top_k >= V
    keeps everything, so it is off (0)."""
    return params.temperature, params.top_k if params.top_k < vocab else 0, params.top_p, params.min_p


def needs_filters(params: SamplingParams) -> bool:
    """Whether a random row uses top-k, top-p or min-p (else the race runs on the scaled logits)."""
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def draw_exponential(q: torch.Tensor, rows: Sequence[int], generators: Sequence[torch.Generator | None]) -> None:
    """Fill rows `rows` of `q` ([*, V] float32) with Exp(1) noise, each from its own generator
    (`generators`, aligned with `rows`): exactly V draws per row, so a row's randomness depends
    neither on its position nor on the batch. Rows without a generator draw from torch's global
    RNG (not reproducible). The eager Sampler and the whole-step decode graphs
    (rein.engine.cuda_graphs), which draw into a static buffer before a replay, both call this."""
    unseeded = []
    for row, gen in zip(rows, generators, strict=True):
        if gen is None:
            unseeded.append(row)
        else:
            q[row].exponential_(generator=gen)
    if unseeded:
        if len(unseeded) == q.shape[0]:
            q.exponential_()
        else:
            u_idx = torch.tensor(unseeded, dtype=torch.long, device=q.device)
            q[u_idx] = torch.empty(len(unseeded), q.shape[1], device=q.device).exponential_()


def race(x: torch.Tensor, knobs: torch.Tensor, top_k: torch.Tensor | None, q: torch.Tensor, k_max: int,
         need_p: bool, need_min_p: bool) -> torch.Tensor:
    """One token per row of `x` ([S, V] float32 logits): temperature (`knobs[:, 0]`), then top-k
    (`top_k`, 0 = off; None when no row uses it, `k_max` its largest value), top-p (`knobs[:, 1]`)
    and min-p (`knobs[:, 2]`) as one per-row cutoff, then the exponential race with the Exp(1)
    noise `q` (overwritten). Fixed shapes and no host reads: the whole-step decode graphs capture
    it (with need_p and need_min_p set, which leave the rows that do not use them unchanged)."""
    x = x / knobs[:, 0:1]
    if top_k is not None or need_p or need_min_p:
        cutoff = _filter_cutoffs(x, top_k, knobs[:, 1], knobs[:, 2], k_max, need_p, need_min_p)
        x = x.masked_fill(x < cutoff.unsqueeze(1), float("-inf"))
    # argmax(x - log q) == argmax(softmax(x) / q): the exponential race picks token i
    # with probability softmax(x)_i, with no softmax needed.
    return argmax_rows(x - q.clamp_min_(_MIN_EXP_DRAW).log_())


class Sampler:
    """Stateless: all per-request state (generators, token history) lives in the batch."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        params = batch.params
        num_rows, vocab = logits.shape
        if len(params) != num_rows:
            raise ValueError(f"batch has {len(params)} rows but logits have {num_rows}")
        device = logits.device

        # `of` looked already (a pass over every row's params: a share of a large batch's step).
        if batch.plain_greedy if batch.plain_greedy is not None else _plain_greedy(params):
            return SamplerOutput(greedy_tokens(logits), None, None)

        greedy = [is_greedy(p) for p in params]
        want_logprobs = any(p.logprobs is not None for p in params)
        pen_rows = [i for i, p in enumerate(params) if p.needs_penalties]
        # Rows with a bias or a min_tokens still to reach: min_tokens is almost always 0,
        # so the length is only looked at for rows that set it.
        proc_rows = [i for i, p in enumerate(params)
                     if p.logit_bias or (p.min_tokens and len(batch.output_token_ids[i]) < p.min_tokens)]

        if all(greedy) and not want_logprobs and not pen_rows and not proc_rows:
            return SamplerOutput(greedy_tokens(logits), None, None)   # min_tokens already met

        # float32 view of the input; never written in place (it may alias `logits`).
        x = logits.float()
        if proc_rows:
            x = self._process(x, batch, proc_rows)
        if pen_rows:
            x = self._penalize(x, batch, pen_rows)

        sample_rows = [i for i in range(num_rows) if not greedy[i]]
        greedy_rows = [i for i in range(num_rows) if greedy[i]]
        if not sample_rows:
            tokens = argmax_rows(x)
        elif not greedy_rows:
            tokens = self._sample(x, batch, sample_rows)
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=device)
            g_idx = torch.tensor(greedy_rows, dtype=torch.long, device=device)
            s_idx = torch.tensor(sample_rows, dtype=torch.long, device=device)
            tokens[g_idx] = argmax_rows(x.index_select(0, g_idx))
            tokens[s_idx] = self._sample(x.index_select(0, s_idx), batch, sample_rows)

        if not want_logprobs:
            return SamplerOutput(tokens.tolist(), None, None)
        logprobs, top_logprobs = self._logprobs(x, tokens, params)
        return SamplerOutput(tokens.tolist(), logprobs, top_logprobs)

    @staticmethod
    def _process(x: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """`x` with logit_bias added and the min_tokens mask applied to `rows` (out of place).

        Both become flat indices into the [B, V] logits, so the whole batch takes one
        index_add and one index_fill whatever mix of rows asked for what. Ids outside the
        vocabulary are skipped (the engine refuses them in logit_bias; a stop token id
        past the logits cannot be sampled anyway)."""
        vocab = x.shape[1]
        bias_idx: list[int] = []
        bias_val: list[float] = []
        mask_idx: list[int] = []
        for i in rows:
            p = batch.params[i]
            base = i * vocab
            if p.logit_bias:
                for token, bias in p.logit_bias.items():
                    if 0 <= token < vocab:
                        bias_idx.append(base + token)
                        bias_val.append(bias)
            if p.min_tokens and len(batch.output_token_ids[i]) < p.min_tokens:
                eos = batch.eos_token_ids[i] if batch.eos_token_ids is not None else ()
                mask_idx.extend(base + t for t in set(eos).union(p.stop_token_ids) if 0 <= t < vocab)
        flat = x.reshape(-1).clone()
        device = x.device
        if bias_idx:
            flat.index_add_(0, torch.tensor(bias_idx, dtype=torch.long, device=device),
                            torch.tensor(bias_val, dtype=torch.float32, device=device))
        if mask_idx:
            # After the bias: a min_tokens mask wins over a positive bias on an EOS id.
            flat.index_fill_(0, torch.tensor(mask_idx, dtype=torch.long, device=device), float("-inf"))
        return flat.view_as(x)

    @staticmethod
    def _penalize(x: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """`x` with penalties applied to `rows` only (out of place)."""
        sub_params = [batch.params[i] for i in rows]
        prompts = [batch.prompt_token_ids[i] for i in rows]
        outputs = [batch.output_token_ids[i] for i in rows]
        if len(rows) == x.shape[0]:
            return apply_penalties(x, sub_params, prompts, outputs)
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)
        penalized = apply_penalties(x.index_select(0, idx), sub_params, prompts, outputs)
        return x.index_copy(0, idx, penalized)

    @staticmethod
    def _sample(x: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """One token per row of `x` ([S, V], penalized float32); `rows` maps to the batch."""
        params = [batch.params[i] for i in rows]
        num, vocab = x.shape
        device = x.device
        rows_knobs = [filter_knobs(p, vocab) for p in params]
        # One host-to-device copy for the float knobs of all rows.
        knobs = torch.tensor([[t, p, m] for t, _, p, m in rows_knobs], dtype=torch.float32, device=device)
        top_ks = [k for _, k, _, _ in rows_knobs]
        k_max = max(top_ks)
        top_k = torch.tensor(top_ks, dtype=torch.long, device=device) if k_max else None
        q = torch.empty(num, vocab, dtype=torch.float32, device=device)
        draw_exponential(q, range(num), [batch.generators[i] for i in rows])
        return race(x, knobs, top_k, q, k_max, need_p=any(p < 1.0 for _, _, p, _ in rows_knobs),
                    need_min_p=any(m > 0.0 for _, _, _, m in rows_knobs))

    @staticmethod
    def _logprobs(
        x: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """Chosen-token logprob for every row, top alternatives for rows asking > 0."""
        lse = torch.logsumexp(x, dim=-1)
        chosen = (x.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse).tolist()
        top: list[list[tuple[int, float]]] = [[] for _ in params]
        top_rows = [i for i, p in enumerate(params) if p.logprobs]
        if top_rows:
            k_max = min(max(params[i].logprobs for i in top_rows), x.shape[1])
            idx = torch.tensor(top_rows, dtype=torch.long, device=x.device)
            vals, ids = x.index_select(0, idx).topk(k_max, dim=-1)  # sorted descending
            vals = (vals - lse.index_select(0, idx).unsqueeze(1)).tolist()
            ids = ids.tolist()
            for j, i in enumerate(top_rows):
                k = params[i].logprobs
                top[i] = list(zip(ids[j][:k], vals[j][:k], strict=True))
        return chosen, top
