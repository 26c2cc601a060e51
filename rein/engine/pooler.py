"""Embedding requests inside the engine: prefill-only requests that end with a pooled vector.

An embedding request is an ordinary `Request` with a `PoolingState` in `request.pooling`.
The scheduler prefills it like any prompt (in chunks under the token budget, next to
decodes and other prefills of the same step); the model runner hands this module the
final hidden states (after the model's last norm, where the LM head would read them) of
the request's rows of each step, and never computes its logits:

* last-token pooling keeps the row of the prompt's last position, computed in the step
  that finishes the prompt (the prefix cache never skips it, so it works with caching);
* mean pooling adds every chunk's rows to a float32 running sum; a chunk starting at
  position 0 starts the sum again (a preempted request is recomputed from the start);
* CLS pooling keeps the row of position 0.

Mean and CLS need positions the prefix cache would skip, so those requests do not look
it up (`Request.skip_prefix_cache`). When the prompt is done the scheduler finishes the
request (Scheduler.update) and the engine makes its one output, whose `embedding` is the
vector: normalized, cut to `dimensions` (Matryoshka) and normalized again, as the model's
pooling config and the request say.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rein.engine.errors import EngineRequestError
from rein.engine.request import Request
from rein.engine.sampling_params import SamplingParams
from rein.engine.step_outputs import RequestOutput
from rein.model.pooling_config import CLS, LAST, MEAN, PoolingError, PoolingParams

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine

# The (unused) sampling settings of an embedding request: it never samples.
_NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class PoolingState:
    """An embedding request's pooling: settings, and the sum so far (mean pooling)."""

    pooling_type: str
    normalize: bool
    dimensions: int | None
    running_sum: torch.Tensor | None = None   # mean: float32 sum of the rows computed so far
    first: torch.Tensor | None = None         # cls: position 0's row


def add_pooling_request(engine: LLMEngine, request_id: str, token_ids: list[int], params: PoolingParams,
                        priority: int = 0) -> Request:
    """Queue an embedding request (the engine's add_request, given PoolingParams)."""
    try:
        engine.pooling_config.check(params)
    except PoolingError as exc:
        raise EngineRequestError(str(exc), param=exc.param) from None
    if len(token_ids) > engine.max_model_len:
        raise EngineRequestError(
            f"This model's maximum context length is {engine.max_model_len} tokens, but the input has "
            f"{len(token_ids)} tokens. Please shorten the input.", param="input")
    normalize, dimensions = engine.pooling_config.resolve(params)
    pooling_type = engine.pooling_config.pooling_type
    request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=_NO_SAMPLING,
                      priority=priority)
    request.pooling = PoolingState(pooling_type, normalize, dimensions)
    request.skip_prefix_cache = pooling_type != LAST
    engine.requests[request_id] = request
    engine.scheduler.add(request)
    return request


def gather(hidden: torch.Tensor, spans: list[tuple[Request, int, int, int, int]]) -> list[tuple[Request, torch.Tensor]]:
    """Take what each embedding request needs from this step's hidden states [T, hidden].

    `spans`: (request, first row, end row, first position, end position) of each embedding
    request in the step. Returns the requests whose prompt this step finished, each with
    its pooled (not yet normalized) float32 vector. Rows are copied: the hidden-state
    buffer is reused by the next step (CUDA graphs)."""
    done = []
    for request, row_start, row_end, start, end in spans:
        state: PoolingState = request.pooling
        finished = end >= request.num_prompt_tokens
        if state.pooling_type == MEAN:
            chunk = hidden[row_start:row_end].to(torch.float32).sum(dim=0)
            state.running_sum = chunk if start == 0 or state.running_sum is None else state.running_sum + chunk
            if finished:
                done.append((request, state.running_sum / request.num_prompt_tokens))
        elif state.pooling_type == CLS:
            if start == 0:
                state.first = hidden[row_start].to(torch.float32, copy=True)
            if finished:
                done.append((request, state.first))
        elif finished:
            done.append((request, hidden[row_end - 1].to(torch.float32, copy=True)))
    return done


def finish_vector(vector: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """The embedding of a pooled vector: cut to `dimensions` (Matryoshka), then L2-normalized
    when `normalize` (so a cut vector is normalized again, as vLLM and OpenAI do)."""
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
    return vector


def pooled_outputs(done: list[tuple[Request, torch.Tensor]]) -> list[RequestOutput]:
    """The one finished output of each embedding request whose prompt is done (the scheduler
    ended them: Scheduler.update), with its vector."""
    outputs = []
    for request, pooled in done:
        state: PoolingState = request.pooling
        vector = finish_vector(pooled, state.normalize, state.dimensions)
        outputs.append(RequestOutput(
            request_id=request.request_id, new_token_ids=[], text_delta="", finished=True, finish_reason="stop",
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=0,
            num_cached_tokens=request.num_cached_tokens, embedding=vector.cpu().tolist()))
    return outputs
