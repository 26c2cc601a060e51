"""Decides, every step, which requests run and how many of their tokens are computed.

One rule for everything (as in vLLM v1): a request's `num_computed_tokens` catches up to
its `num_tokens` under a per-step token budget. A new prompt is prefilled in chunks when
it does not fit the budget, a decoding request asks for one token, and a preempted
request simply starts again from zero computed tokens (recompute).

A waiting request whose leading tokens are in the prefix cache (rein.engine.block_pool)
takes those blocks and starts computing after them (except one asking for prompt logprobs:
cached positions have no logits). When the next block it lacks is one a running request is computing now
(the same leading tokens, not registered yet: two lines of a batch with one system prompt,
admitted together), it waits in its place in the queue until that block is cached, instead
of computing the same tokens alongside.

A request with n > 1 choices counts as n sequences against max_num_seqs from its
admission on (the slots of its future choices are kept while it prefills), and `fork`
turns it into n running choices once its prompt is computed: they share its full KV
blocks (reference counts) and each gets a copy of the partly filled last one.

Order: every request has a rank, `priority * priority_aging_steps + arrival step` (then
arrival order and choice index), lower first. Waiting requests are admitted in rank order
and running requests are kept in rank order: the step serves them best first, and when the
block pool runs dry the worst-ranked running request is preempted (its blocks freed, sent
back to the waiting queue) until the better one fits. With one priority this is first come,
first served.

Priority preemption: when the best waiting request does not fit (max_num_seqs or the free
blocks) and a running request has both a worse priority value and a worse rank, the worst
such request is preempted to make room (taken out of this step's batch if it was in it),
until the waiting one fits; nothing is preempted when even all of them would not make
room. A preempted request's full blocks stay in the prefix cache when caching is on (they
were registered as they were computed, and freed blocks are handed out least recently freed
first), so it resumes by cache hits and recomputes only its last, partly filled block.

LoRA adapters (`max_loras`, when the engine serves them): the running requests use at most
`max_loras` distinct adapters, so every step fits the model's adapter slots. A waiting request
of another adapter is passed over (it keeps its place in the queue) until the running requests
of some adapter are done; base-model requests and those of running adapters behind it go ahead.

Blocks: the scheduler asks its KV cache manager (rein.engine.kv_cache_manager) for them and
gives them back; the manager keeps the block pool and the windowed layers' storage in step.

After a step, `update` applies everything the step did to the requests (as vLLM v1's
`update_from_output`): computed tokens, the prefix cache's new blocks and the windows' moves,
the forks of n > 1 requests, each sampled token and the stops it causes (finished requests
leave and free their blocks), finished embedding requests. The engine then only makes outputs.
Under async scheduling (rein.engine.async_scheduling) `schedule_ahead` plans a step of plain
decodes before the update of the step in flight, only where `schedule` would plan the same after it.

No starvation — an aging rule, not a reserved share: the rank counts a priority level as
`priority_aging_steps` engine steps of waiting. A request with priority 6 ranks as if it had
arrived 6 x aging steps later than it did, so a stream of priority-0 requests arriving
more than that many steps after it ranks behind it: it is admitted before them and they
cannot preempt it any more. Every request's wait is bounded (about priority x aging steps
beyond first come, first served), and it is still one static key, so the waiting queue
stays a heap. Aging was chosen over a reserved share of slots for batch work because a
share keeps slots from interactive requests even when they queue, which is the latency this
serves, while aging gives interactive requests every slot for a bounded time. Steps, not
seconds, are the clock so that the order is deterministic (a busy step lasts some 10-50 ms).

Interactive step budget (`interactive_step_budget`: by default 4 on a CPU, off on CUDA, where a
step's time hardly grows with its batch; rein.engine.config): while a request with
interactive priority (below PRIORITY_BATCH) is running or waiting, the batch-priority work of
a step is held to that many tokens (a decode counts 1, a prefill chunk its length; the
interactive requests' own tokens are not counted). On a CPU a step's time grows with its
tokens, so this keeps the steps interactive requests share close to their idle cost. Batch
requests left out of a step stay running and keep their blocks (paused, not preempted:
they resume where they were); better-ranked ones get the budget first, a prefill is chunked
to it, and waiting batch requests are admitted only within it (an interactive request
waiting behind them is still admitted). Batch work never stops: it gets the budget every
step, and its decodes all run again at the first step without interactive requests. Its
prefill chunks stay within HOLD_PREFILL_FACTOR x the budget for INTERACTIVE_HOLD_STEPS more
steps: interactive requests come in runs (a conversation's turns, a user's next question),
and one arriving then waits for the step in progress, which without the hold could be a full
step of batch prefill, many times a decode step's time. The factor was measured
(bench/priority.py, docs/benchmarks.md): holding batch prefill to the budget itself cost the
batch a fifth of its throughput, and 8x the budget raised the chats' median by a third; over
four runs at 4x the batch kept 0.86-0.98x of its throughput and the chats' median was
1.24-1.81x idle. Outside the hold, with a budget set, a step's batch prefill still stays within
BATCH_PREFILL_STEP_TOKENS (256; or HOLD_PREFILL_FACTOR x the budget, if more): the first chats of
a run, before any hold, otherwise arrived during a step of max_num_batched_tokens (2,048) of
batch prefill and waited 1-2 s for it, 10-17x their idle latency on the small bench model. A
prefill of 256 tokens a step costs a CPU little throughput, its time being mostly compute that
grows with its tokens (bench/priority.py, docs/benchmarks.md).
"""

from __future__ import annotations

import bisect
import heapq
import time

from rein.core.priorities import PRIORITY_BATCH
from rein.engine.block_pool import BlockPool
from rein.engine.encoder_cache import EncoderCache
from rein.engine.kv_cache_manager import KVCacheManager
from rein.engine.request import Request, RequestStatus
from rein.engine.scheduler_output import ModelOutput, ScheduledRequest, SchedulerOutput, StepUpdate
from rein.engine.window_blocks import WindowBlocks

# A priority level counts as this many engine steps of waiting (see the module docstring).
DEFAULT_PRIORITY_AGING_STEPS = 128
# After the last interactive request, batch prefill chunks stay within HOLD_PREFILL_FACTOR x
# the interactive step budget for INTERACTIVE_HOLD_STEPS steps (about 1-3 s of 10-50 ms steps;
# the module docstring).
INTERACTIVE_HOLD_STEPS = 64
HOLD_PREFILL_FACTOR = 4
# With an interactive step budget, a step's batch prefill never passes this many tokens (or
# HOLD_PREFILL_FACTOR x the budget, if more), interactive requests or not: the first interactive
# request of a run then waits for at most such a step, not for max_num_batched_tokens of batch
# prefill (the module docstring).
BATCH_PREFILL_STEP_TOKENS = 256


class Scheduler:
    """Queues, the per-step plan and the state changes after each step (module docstring).
    `kv_cache`: the KV cache manager; a bare BlockPool (with `windows`, its windowed map, if
    any) is wrapped in one, for tests and tools that build the pieces themselves.
    `max_model_len`: a request that reaches it ends with `length` (None: no such limit).
    `max_loras`: the most distinct LoRA adapters among the running requests (None: no LoRA)."""

    def __init__(self, kv_cache: KVCacheManager | BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 priority_aging_steps: int = DEFAULT_PRIORITY_AGING_STEPS,
                 windows: WindowBlocks | None = None, interactive_step_budget: int | None = None,
                 max_model_len: int | None = None, max_loras: int | None = None,
                 encoder_cache: EncoderCache | None = None, max_num_encoder_tokens: int | None = None,
                 image_tokens_whole_chunk: bool = False) -> None:
        if priority_aging_steps < 1:
            raise ValueError(f"priority_aging_steps must be at least 1, got {priority_aging_steps}")
        if interactive_step_budget is not None and interactive_step_budget < 0:
            raise ValueError(f"interactive_step_budget must be at least 0, got {interactive_step_budget}")
        if isinstance(kv_cache, BlockPool):
            kv_cache = KVCacheManager(kv_cache, windows)
        elif windows is not None and windows is not kv_cache.windows:
            raise ValueError("give the windowed blocks to the KV cache manager, not the scheduler")
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.priority_aging_steps = priority_aging_steps
        # Batch-priority tokens a step may hold while interactive requests are in (None: no limit).
        self.interactive_step_budget = interactive_step_budget
        self._num_waiting_interactive = 0   # waiting requests with priority below PRIORITY_BATCH
        self._interactive_step = -INTERACTIVE_HOLD_STEPS - 1   # the last step with interactive requests in
        self.running: list[Request] = []   # by rank, best first
        self._waiting: list[tuple[tuple[int, int, int], Request]] = []  # heap by rank
        self._num_waiting = 0
        self.num_preemptions = 0
        self.num_priority_preemptions = 0
        self.num_steps = 0   # the aging clock: schedule() calls
        # Sequence slots kept for the choices running n > 1 requests will fork into.
        self._reserved_seqs = 0
        # Images (see `_fit_images`): the encoder's outputs by image, its per-step budget of image
        # tokens, and whether the model needs each image's tokens in one chunk.
        self.encoder_cache = encoder_cache
        self.max_num_encoder_tokens = max_num_encoder_tokens or max_num_batched_tokens
        self.image_tokens_whole_chunk = image_tokens_whole_chunk
        self._encoder_budget = self.max_num_encoder_tokens
        self._encoding: set[str] = set()

    @property
    def pool(self) -> BlockPool:
        """The KV cache manager's block pool (read it; ask the manager for blocks)."""
        return self.kv_cache.pool

    @property
    def windows(self) -> WindowBlocks | None:
        """The KV cache manager's windowed map, if the windowed layers have storage of their own."""
        return self.kv_cache.windows

    # -- queue ---------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.arrival_step < 0:
            request.arrival_step = self.num_steps
        self._push_waiting(request)

    def rank(self, request: Request) -> tuple[int, int, int]:
        """Lower runs first: priority aged by the steps since arrival (one static key, see
        the module docstring), then first come first served (the choices of one request
        arrived together: by index)."""
        return (request.priority * self.priority_aging_steps + request.arrival_step,
                request.arrival_order, request.index)

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self._waiting, (self.rank(request), request))
        self._num_waiting += 1
        self._num_waiting_interactive += request.priority < PRIORITY_BATCH

    def _batch_budget(self) -> tuple[int | None, bool]:
        """This step's budget for batch-priority tokens and whether decodes are outside it: the
        interactive step budget while an interactive request is running or waiting;
        HOLD_PREFILL_FACTOR times it, for prefill chunks alone, in the INTERACTIVE_HOLD_STEPS
        after; else BATCH_PREFILL_STEP_TOKENS (or more) for prefill chunks alone; None without
        an interactive step budget (no limit beyond the step's)."""
        budget = self.interactive_step_budget
        if budget is None:
            return None, False
        if self._num_waiting_interactive > 0 or any(r.priority < PRIORITY_BATCH for r in self.running):
            self._interactive_step = self.num_steps
            return budget, False
        if self.num_steps - self._interactive_step <= INTERACTIVE_HOLD_STEPS:
            return budget * HOLD_PREFILL_FACTOR, True
        return max(BATCH_PREFILL_STEP_TOKENS, budget * HOLD_PREFILL_FACTOR), True

    def _add_running(self, request: Request) -> None:
        # Kept sorted by rank (ranks never change), so the worst is always last.
        bisect.insort(self.running, request, key=self.rank)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort): it leaves its queue and frees its blocks."""
        if request.status.finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._reserved_seqs -= request.num_unforked_choices
        else:
            # Left in the heap; skipped when it reaches the top.
            self._num_waiting -= 1
            self._num_waiting_interactive -= request.priority < PRIORITY_BATCH
        request.status = status
        self._release(request)

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running, scheduled, block_size = self.running, out.scheduled, self.kv_cache.block_size
        batch_budget, decodes_free = self._batch_budget()
        self._encoder_budget, self._encoding = self.max_num_encoder_tokens, set()
        # This loop runs for every running request every step (at batch 256 a good share of a
        # host-bound step): the common case, a decode whose next token fits its last block, is
        # kept to plain reads. (`_grow` only pops requests behind this one off `running`, which
        # the list iterator then never reaches.)
        for request in running:
            if budget <= 0:
                break
            computed = request.num_computed_tokens
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            num_new = num_tokens - computed
            if num_new > budget:
                num_new = budget
            capped = batch_budget is not None and request.priority >= PRIORITY_BATCH \
                and not (decodes_free and num_new == 1)   # a decode in the hold: not counted
            if capped:
                if batch_budget <= 0:
                    continue   # paused for this step: it stays running and keeps its blocks
                num_new = min(num_new, batch_budget)
            if request.images is not None and computed < len(request.prompt_token_ids):
                num_new = self._fit_images(request, computed, num_new)
                if num_new == 0:
                    continue   # its next image waits for the encoder's budget (or a whole chunk)
            if capped:
                batch_budget -= num_new
            end = computed + num_new
            # A decode whose next token still fits its last block needs no new block.
            if end > len(request.block_ids) * block_size and not self._grow(request, num_new, out):
                break  # the request itself was preempted; everyone after it already was
            scheduled.append(ScheduledRequest(request, computed, num_new, end == num_tokens))
            budget -= num_new

        # No newcomers in a step whose running requests outgrew the pool: they would be
        # preempted next. (Preempting for a better-ranked newcomer is what admits it.)
        outgrew = bool(out.preempted)
        deferred = []   # batch requests passed over this step for an interactive one behind them
        while self._waiting and not outgrew:
            request = self._waiting[0][1]
            if request.status.finished:
                heapq.heappop(self._waiting)
                continue
            capped = batch_budget is not None and request.priority >= PRIORITY_BATCH
            if capped and batch_budget <= 0:
                if self._num_waiting_interactive <= 0:
                    break
                deferred.append(heapq.heappop(self._waiting))
                continue
            if request.status == RequestStatus.PREEMPTED and any(p is request for p in out.preempted):
                break   # preempted in this step to make room: not back before the next one
            if request.lora_request is not None and not self._adapter_fits(request):
                deferred.append(heapq.heappop(self._waiting))
                continue   # its adapter would be one too many: base and running adapters' requests go ahead
            if budget <= 0:
                # Worse requests' chunks used the budget up: the worst of them skips this step.
                refund = self._unschedule_worse(request, out)
                if not refund:
                    break
                budget += refund
                continue
            # n > 1: room for all its choices, or an empty engine when n > max_num_seqs
            # (the choices that do not fit then wait: see `fork`).
            forks = request.num_unforked_choices
            seqs = len(self.running) + self._reserved_seqs
            if seqs >= self.max_num_seqs or (forks and self.running and seqs + 1 + forks > self.max_num_seqs):
                refund = self._make_room(request, out)
                if refund is None:
                    break
                budget += refund
                continue
            # Blocks another request already computed for the same leading tokens; at least
            # the last token is always computed, since its logits give the next token.
            # Prompt logprobs need the logits of every prompt position, and mean/CLS pooling
            # every prompt position's hidden state: no lookup for them (vLLM's rule).
            kv = self.kv_cache
            max_cached = (request.num_tokens - 1) // block_size \
                if kv.enable_caching and request.prompt_logprobs is None \
                and not request.skip_prefix_cache else 0
            cached = kv.find_cached(request, max_cached)
            if len(cached) < max_cached and self._computing_prefix(request, len(cached)):
                break   # its next block is being computed by a running request: a cache hit soon
            if cached and request.images is not None and self.image_tokens_whole_chunk:
                cached = self._whole_image_prefix(request, cached)
            computed = len(cached) * block_size if cached else request.num_computed_tokens
            num_new = min(request.num_tokens - computed, budget, batch_budget if capped else budget)
            if request.images is not None and computed < request.num_prompt_tokens:
                num_new = self._fit_images(request, computed, num_new)
                if num_new == 0:
                    break   # its first image waits for the encoder's budget: next step
            needed = kv.blocks_for(computed + num_new) - len(request.block_ids) - len(cached)
            if not kv.can_allocate(needed, cached):
                refund = self._make_room(request, out)
                if refund is None:
                    break
                budget += refund
                continue
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            if capped:
                batch_budget -= num_new
            else:
                self._num_waiting_interactive -= request.priority < PRIORITY_BATCH
            if cached:
                self._take_cached(request, cached)
            if kv.enable_caching and request.num_preemptions == 0:
                out.prefix_cache_queries += request.num_prompt_tokens
                out.prefix_cache_hits += request.num_cached_tokens
            kv.allocate(request, needed)
            request.status = RequestStatus.RUNNING
            self._add_running(request)
            self._reserved_seqs += forks
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        for entry in deferred:
            heapq.heappush(self._waiting, entry)
        self.kv_cache.cover((s.request, s.end) for s in scheduled)
        return out

    def schedule_ahead(self, plan: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling (rein.engine.async_scheduling): the next step's plan while `plan`'s
        forward is still running, before its tokens are known, or None when that plan could
        differ from the one `schedule` would make after `update`, so the caller waits instead.

        Planned ahead only where the next step is plain: every running request samples in
        `plan`, nothing waits, and each gets one decode token at the position `plan` ends it on
        (the token `plan` samples, which the caller appends before the step runs). Requests that
        `plan`'s token ends by length are left out (their end is known now); those that end by a
        stop or end-of-sequence token are in it, and the caller drops their rows. Refused (None)
        where the plan would differ from `schedule`'s: a request waiting (it could be admitted
        when one ends), a request not in `plan` or still in its prompt, the step budget or the
        free blocks short of the decodes (`schedule` would preempt), windowed layers with storage
        of their own (their windows move after each step), or an interactive step budget with
        both interactive and batch requests running (`schedule` would pause batch decodes); and
        when `plan`'s tokens end every request by length (nothing to plan)."""
        running = self.running
        if self._num_waiting or len(running) > self.max_num_batched_tokens or self.windows is not None:
            return None
        ends: dict[int, int] = {}
        for s in plan.scheduled:
            if not s.samples:
                return None
            if not s.request.status.finished:
                ends[id(s.request)] = s.end
        if len(ends) != len(running):
            return None
        if self.interactive_step_budget is not None:
            interactive = sum(r.priority < PRIORITY_BATCH for r in running)
            if 0 < interactive < len(running):
                return None
        kv, max_len = self.kv_cache, self.max_model_len
        block_size = kv.block_size
        decodes: list[tuple[Request, int]] = []
        new_blocks = 0
        for request in running:
            end = ends.get(id(request))
            if end is None:
                return None
            params = request.sampling_params
            num_output = len(request.output_token_ids) + 1   # with the token `plan` samples
            if num_output >= params.max_tokens or (max_len is not None and end + 1 >= max_len):
                continue   # that token ends it (length): `schedule` would not have it
            decodes.append((request, end))
            new_blocks += end >= len(request.block_ids) * block_size
        if not decodes or new_blocks > kv.num_free:
            return None
        self.num_steps += 1
        self._batch_budget()   # its clock (the last step with interactive requests), as `schedule`'s
        out = SchedulerOutput()
        scheduled = out.scheduled
        for request, end in decodes:
            if end >= len(request.block_ids) * block_size:
                kv.allocate(request, 1)
            ahead = ScheduledRequest(request, end, 1)
            ahead.samples = True   # its input token is the one `plan` samples
            scheduled.append(ahead)
        return out

    def _fit_images(self, request: Request, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the request computes this step given its
        images: a chunk stops before an image whose embeddings are neither cached nor affordable
        within the step's encoder budget (an image larger than the whole budget runs alone in a
        step), and, for a model that needs an image's tokens in one chunk, before an image the
        chunk would cut. The images it covers and that are not cached are counted as encoded this
        step (the model runner encodes them). 0: nothing this step."""
        end = start + num_new
        cache = self.encoder_cache
        for item in request.images.overlapping(start, end):
            if self.image_tokens_whole_chunk and item.end > end:
                return item.offset - start if item.offset > start else 0
            if item.key in self._encoding or (cache is not None and item.key in cache):
                continue
            alone = self._encoder_budget == self.max_num_encoder_tokens   # nothing encoded yet this step
            if item.length > self._encoder_budget and not alone:
                return item.offset - start if item.offset > start else 0
            self._encoder_budget -= item.length
            self._encoding.add(item.key)
        return num_new

    def _whole_image_prefix(self, request: Request, cached: list[int]) -> list[int]:
        """Cached blocks trimmed so that computing resumes at an image's start, never inside it
        (a model whose image tokens attend to each other both ways computes an image in one chunk)."""
        size = self.kv_cache.block_size
        computed = len(cached) * size
        for item in request.images.items:
            if item.offset < computed < item.end:
                return cached[:item.offset // size]
        return cached

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the LoRA `request` may run beside the running requests: its adapter is one of
        theirs, or they use fewer than max_loras adapters."""
        lora_id = request.lora_int_id
        running = {r.lora_int_id for r in self.running if r.lora_request is not None}
        return lora_id in running or len(running) < (self.max_loras or 0)

    def _computing_prefix(self, request: Request, num_cached: int) -> bool:
        """Whether a running request is computing the waiting `request`'s next uncached block
        (block `num_cached` of the same leading tokens) and has not registered it yet. The
        waiting request then waits for it -- a step or a few, in rank order -- and takes it
        from the prefix cache, rather than computing the same tokens alongside."""
        end = (num_cached + 1) * self.kv_cache.block_size
        leading = None
        for running in self.running:
            if (running.num_computed_tokens >= end or running.num_prompt_tokens < end
                    or running.cache_root != request.cache_root):
                continue   # computed it already (it is cached, or never will be), never will, or another adapter
            leading = leading if leading is not None else request.key_tokens(0, end)
            if running.key_tokens(0, end) == leading:
                return True
        return False

    def _make_room(self, request: Request, out: SchedulerOutput) -> int | None:
        """Preempt the worst running request that both has a worse priority value and ranks
        behind the waiting `request`, which does not fit; returns the step budget that frees
        (its share of this step, if it was scheduled), or None when there is no such request
        or preempting all of them would still not make room (then nothing is preempted)."""
        victims = self._worse_running(request)
        if not victims:
            return None
        # Would preempting every candidate make room? Sequences exactly; blocks at most (a
        # shared block is freed only with its last holder), so this may still be optimistic.
        # (An n > 1 request may start in an empty engine even when n > max_num_seqs.)
        seqs_after = len(self.running) + self._reserved_seqs - sum(1 + v.num_unforked_choices for v in victims)
        if len(self.running) > len(victims) and seqs_after + 1 + request.num_unforked_choices > self.max_num_seqs:
            return None
        # Its first chunk, not counting cache hits (which only lower the need).
        first_chunk_end = min(request.num_tokens, request.num_computed_tokens + self.max_num_batched_tokens)
        blocks_needed = self.kv_cache.blocks_for(first_chunk_end) - len(request.block_ids)
        if blocks_needed > self.kv_cache.num_free + sum(len(v.block_ids) for v in victims):
            return None
        victim = victims[0]
        self.running.remove(victim)
        refund = self._unschedule(victim, out)
        self._preempt(victim)
        out.preempted.append(victim)
        out.priority_preemptions += 1
        self.num_priority_preemptions += 1
        return refund

    def _worse_running(self, request: Request) -> list[Request]:
        """The running requests that rank behind `request` and have a worse priority value:
        those it may preempt, worst first."""
        rank = self.rank(request)
        worse = []
        for running in reversed(self.running):   # sorted by rank: those behind it are at the end
            if self.rank(running) <= rank:
                break
            if running.priority > request.priority:
                worse.append(running)
        return worse

    def _unschedule_worse(self, request: Request, out: SchedulerOutput) -> int:
        """Take the worst request that `request` may preempt out of this step's batch (it
        stays running and keeps its blocks); returns the budget that frees, 0 if none."""
        for victim in self._worse_running(request):
            refund = self._unschedule(victim, out)
            if refund:
                return refund
        return 0

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput) -> int:
        scheduled = out.scheduled
        for i in range(len(scheduled) - 1, -1, -1):
            if scheduled[i].request is request:
                return scheduled.pop(i).num_new_tokens
        return 0

    def _take_cached(self, request: Request, blocks: list[int]) -> None:
        self.kv_cache.take_cached(request, blocks)
        request.num_computed_tokens = len(blocks) * self.kv_cache.block_size
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)

    def register_computed_blocks(self, request: Request) -> None:
        """Offer the request's newly completed blocks to the prefix cache (`update` does it
        after each step; tests that drive the scheduler alone call it)."""
        self.kv_cache.register_computed(request)

    def _grow(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Give `request` blocks for `num_new` more tokens, preempting the newest running
        requests as needed. False if `request` itself had to be preempted."""
        kv = self.kv_cache
        needed = kv.blocks_for(request.num_computed_tokens + num_new) - len(request.block_ids)
        while needed > kv.num_free:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        kv.allocate(request, needed)
        return True

    # -- after the step ----------------------------------------------------------------------------

    def update(self, plan: SchedulerOutput, output: ModelOutput, appended: bool = False) -> StepUpdate:
        """Apply what the step of `plan` computed (`output`) to its requests, in this order:
        computed tokens (and with them the prefix cache's new blocks and the windows' moves),
        prompt logprobs, the forks of n > 1 requests, then each sampled token: appended, and
        the stop it causes, if any, ends its choice (its blocks go back at once; the request
        ends with its last choice). Embedding requests whose prompt is done end last.
        `appended`: the sampled tokens are in the requests' outputs already (async scheduling
        appends them before the next step runs, rein.engine.async_scheduling)."""
        kv = self.kv_cache
        block_size, caching, windows = kv.block_size, kv.enable_caching, kv.windows
        for s in plan.scheduled:
            request = s.request
            request.num_computed_tokens = end = s.end
            # `mark_computed`'s own test, inline: most steps fill no block of most requests.
            if windows is not None or (caching and end // block_size > request.num_registered_blocks):
                kv.mark_computed(request)
        if output.prompt_logprobs:
            for request, first, entries in output.prompt_logprobs:
                # A recompute after preemption scores the same tokens again: replace them.
                del request.prompt_logprobs[first:]
                request.prompt_logprobs.extend(entries)
        # Measured after the forward, before forks and stops change who holds what.
        if self.running:
            update = StepUpdate(kv_utilization=kv.slot_utilization(self.running), kv_usage=kv.usage)
        else:
            update = StepUpdate()
        for parent, children in output.forks:
            self.fork(parent, children)
        now = time.monotonic()
        ended, stop_strings, complete, max_len = update.ended, output.stop_strings, output.complete, self.max_model_len
        for row, (request, token) in enumerate(zip(output.sampled, output.token_ids, strict=True)):
            if not appended:
                request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            status = request.check_stop(token, stop_strings.get(row) if stop_strings else None, max_len)
            if complete and row in complete:
                status = RequestStatus.FINISHED_STOPPED   # the grammar is complete: nothing may follow
            if status is None:
                continue
            self.finish(request, status)
            group = request.group
            if group is not None:   # the request ends with its last choice
                group.num_unfinished -= 1
                if group.num_unfinished:
                    continue
            ended.add(row)
        for request in output.pooled:
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        return update

    def fork(self, parent: Request, children: list[Request]) -> list[tuple[int, int]]:
        """Start `children` (choices 1..n-1 of the running `parent`, whose prompt was just
        computed) as running requests; `update` calls it for the step's forks.

        Each child shares the parent's full blocks (one more reference each) and gets a new
        block for the parent's partly filled last one, if any: the returned (source,
        destination) block pairs are copied in the KV cache before the next forward (the KV
        cache manager queues them for the model runner; copy-on-write done up front, since
        every choice writes its next token there). A child that finds no free block, or no
        sequence slot (n > max_num_seqs), waits instead, like a preempted request: it
        recomputes the prompt and its first token when admitted (finding the prompt's cached
        blocks, with prefix caching)."""
        self._reserved_seqs -= parent.num_unforked_choices
        parent.group.forked = True
        for child in children:   # the same age as their parent
            child.arrival_step = parent.arrival_step
        kv = self.kv_cache
        copies: list[tuple[int, int]] = []
        for child in children:
            if len(self.running) >= self.max_num_seqs or not kv.can_fork(parent):
                child.num_preemptions = 1   # its usage numbers are the parent's, counted already
                child.status = RequestStatus.PREEMPTED
                self._push_waiting(child)
                continue
            copy = kv.fork(parent, child)
            if copy is not None:
                copies.append(copy)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self._add_running(child)
        return copies

    def _preempt(self, request: Request) -> None:
        self._reserved_seqs -= request.num_unforked_choices
        self._release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._push_waiting(request)

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
