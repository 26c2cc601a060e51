"""Prompt logprobs (SamplingParams.prompt_logprobs = k, vLLM's parameter; OpenAI's legacy
completions return them with `echo` and `logprobs`).

Prompt token i (i >= 1) is scored by the logits the model computes at position i - 1:
its logprob there plus the k most likely tokens. The first prompt token has no context,
so its entry is None. The model runner finds the positions of a step's prefill chunks
that score a prompt token (only for requests asking for it: every other request keeps
getting the logits of its last position only) and calls `score_prompt_tokens` on their
final hidden states; the engine gathers the entries chunk by chunk on the request.

The logits are the model's raw ones: logit_bias, min_tokens and penalties act on the
next-token choice, not on how likely the given prompt was (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rein.engine.step_outputs import TokenLogprob

# Rows scored at a time: [rows, vocab] float32 logits exist only for one slice, so a long
# prefill chunk of a 150k-vocabulary model needs ~150 MB here, not gigabytes.
SLICE_ROWS = 256


def score_prompt_tokens(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                        rows: list[int], targets: list[int], ks: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per entry of `rows`: hidden row `rows[j]` scores token `targets[j]`
    with `ks[j]` top alternatives (sorted by logprob, descending)."""
    device = hidden.device
    out: list[TokenLogprob] = []
    for lo in range(0, len(rows), SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, len(rows))
        idx = torch.tensor(rows[lo:hi], dtype=torch.long).to(device, non_blocking=True)
        logits = compute_logits(hidden.index_select(0, idx)).float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        tgt = torch.tensor(targets[lo:hi], dtype=torch.long).to(device, non_blocking=True)
        chosen = (logits.gather(1, tgt.unsqueeze(1)) - lse).squeeze(1).tolist()
        k_max = min(max(ks[lo:hi]), logits.shape[1])
        if k_max:
            vals, ids = logits.topk(k_max, dim=-1)
            vals = (vals - lse).tolist()
            ids = ids.tolist()
        for j in range(hi - lo):
            k = ks[lo + j]
            top = list(zip(ids[j][:k], vals[j][:k], strict=True)) if k else []
            out.append(TokenLogprob(targets[lo + j], chosen[j], top))
    return out
