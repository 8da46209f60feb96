"""Token-budget scheduler (vLLM-v1 style).

Each request's `num_computed_tokens` catches up with `num_tokens`; each step hands out
at most `max_num_batched_tokens`. Decodes take one token each; the budget they leave is
split among the prompts being prefilled (running ones mid-prompt, then waiting ones in
arrival order), max-min fairly (`fair_shares`): a short prompt that arrives while a long
one is in its chunked prefill runs beside it instead of waiting for all of it (no
head-of-line blocking). A waiting prompt joins while at most `max_num_partial_prefills`
prompts end the step unfinished, and only if it fits the step or is shorter than a prompt
in prefill: sharing is shortest-first at heart, so a queue of equal prompts is still
served first come, first served (sharing them would delay them all). When blocks run
out the newest running request is preempted and will recompute. Prefix hits and imported
KV just start a request with some tokens already computed. With `max_step_ms` the budget
is also what the measured speed fits in that time (engine/step_budget.py). Chunk
boundaries never change results (batch-invariant kernels).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice

from splitserve.config import SchedulerConfig
from splitserve.engine.batch import RunnerOutput, SampleSpec, ScheduledBatch, ScheduledSeq
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.step_budget import StepBudget
from splitserve.kv_cache import BlockHash, KVCacheManager

# Brings a request's prefix up from the tiers below the pool (engine/kv_tiers.py):
# (block hashes, tokens, tenant) -> blocks promoted into the prefix cache.
Promote = Callable[[Sequence[BlockHash], int, "str | None"], int]


def fair_shares(needs: Sequence[int], budget: int) -> list[int]:
    """Max-min fair split of `budget` tokens among prompts that need `needs` tokens each
    (water-filling): a prompt needing less than an even share gets all it needs, the others
    split the rest evenly, the earliest (lowest index) taking the tokens that do not divide."""
    if sum(needs) <= budget:
        return list(needs)
    shares = list(needs)
    order = sorted(range(len(needs)), key=needs.__getitem__)
    left = max(budget, 0)
    for k, i in enumerate(order):
        even, spare = divmod(left, len(needs) - k)
        if needs[i] > even:
            for j, rest in enumerate(sorted(order[k:])):
                shares[rest] = even + (j < spare)
            break
        left -= needs[i]
    return shares


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests whose prompt KV will be imported; blocks are reserved in arrival order.
        self.awaiting_kv: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.promote: Promote | None = None  # set when the engine has tiers below its pool
        self.step_budget = (None if config.max_step_ms is None else
                            StepBudget(config.max_step_ms / 1000, config.max_num_batched_tokens))

    # -- admission and removal ------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.status == RequestStatus.WAITING_FOR_KV:
            self.awaiting_kv[req.request_id] = req
        else:
            self.waiting.append(req)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (abort, stop string, error); frees its blocks unless held."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return None
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.awaiting_kv.pop(request_id, None)
        self._retire(req)
        return req

    def _retire(self, req: Request) -> None:
        del self.requests[req.request_id]
        # Only a request that ended well keeps its KV for export (an aborted or failed
        # one's may be incomplete).
        if not (req.hold_kv and req.status <= RequestStatus.FINISHED_LENGTH):
            self.kv.free(req.request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def decode_only(self) -> bool:
        return not self.waiting and all(
            r.num_tokens - r.num_computed_tokens <= 1 for r in self.running)

    # -- scheduling -------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        if self.step_budget is not None:
            num_decodes = sum(r.num_tokens - r.num_computed_tokens <= 1 for r in self.running)
            budget = self.step_budget.tokens(num_decodes)
        self.reserve_import_blocks()
        shares = self._prefill_shares(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget,
                          shares.get(req.request_id, budget))
            if num_new <= 0:  # a prompt whose share of this step is nothing
                i += 1
                continue
            while self.kv.allocate(req.request_id, req.num_computed_tokens + num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted_ids.append(victim.request_id)
                if victim is req:
                    break
            else:
                batch.seqs.append(self._scheduled_seq(req, num_new))
                budget -= num_new
                i += 1
        if batch.preempted_ids:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            share = shares.get(req.request_id, 0)
            if share <= 0:  # no room among this step's partial prefills
                break
            if self.promote is not None:
                self.promote(req.block_hashes, req.num_tokens, req.tenant)
            hit = self.kv.computed_prefix(req.block_hashes, req.num_tokens)
            num_computed = len(hit) * self.block_size
            num_new = min(req.num_tokens - num_computed, budget, share)
            if self.kv.allocate(req.request_id, num_computed + num_new, hit) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_computed
            req.num_cached_tokens = min(num_computed, req.num_prompt_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.seqs.append(self._scheduled_seq(req, num_new))
            budget -= num_new
        return batch

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A finished step's size and wall time (feeds the time budget, if any)."""
        if self.step_budget is not None:
            self.step_budget.observe(num_tokens, seconds)

    def _prefill_shares(self, budget: int) -> dict[str, int]:
        """This step's tokens for each prompt in prefill (request id -> tokens; decodes are
        not in it): running prompts first, then waiting ones in arrival order while the
        shares leave at most `max_num_partial_prefills` prompts unfinished, give each at
        least one token, and the newcomer fits the step or is shorter than a prompt
        already in it. A waiting prompt's need counts its cached prefix as computed
        (it may find less at admission: it then takes less)."""
        ids: list[str] = []
        needs: list[int] = []
        for req in self.running:
            left = req.num_tokens - req.num_computed_tokens
            if left > 1:
                ids.append(req.request_id)
                needs.append(left)
            else:
                budget -= max(left, 0)
        shares = fair_shares(needs, budget)
        room = self.config.max_num_seqs - len(self.running)
        for req in islice(self.waiting, max(room, 0)):
            hit = self.kv.computed_prefix(req.block_hashes, req.num_tokens)
            trial_needs = [*needs, req.num_tokens - len(hit) * self.block_size]
            trial = fair_shares(trial_needs, budget)
            num_partial = sum(share < need for share, need in zip(trial, trial_needs))
            if 0 in trial or num_partial > self.config.max_num_partial_prefills:
                break
            # Sharing pays only for a prompt shorter than one in prefill (it then ends
            # first); one that is not takes what the others leave (first come, first
            # served: a queue of equal prompts is served one by one, not all slowly).
            if sum(trial_needs) > budget and needs and trial_needs[-1] >= max(needs):
                left = budget - sum(needs)
                if left > 0:
                    ids.append(req.request_id)
                    shares = [*needs, left]
                break
            ids.append(req.request_id)
            needs, shares = trial_needs, trial
        return dict(zip(ids, shares))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def reserve_import_blocks(self) -> None:
        """Pre-allocates prompt blocks for requests waiting for KV, reusing local prefix hits."""
        for req in self.awaiting_kv.values():
            if self.kv.block_table(req.request_id):
                continue
            end = req.kv_import_end
            if self.promote is not None:
                self.promote(req.block_hashes, end, req.tenant)
            hit = self.kv.computed_prefix(req.block_hashes, end)
            if self.kv.allocate(req.request_id, end, hit) is None:
                return  # keep arrival order: later ones wait too
            req.num_computed_tokens = len(hit) * self.block_size
            req.num_cached_tokens = req.num_computed_tokens

    def _scheduled_seq(self, req: Request, num_new: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        reaches_end = start + num_new == req.num_tokens
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:start + num_new],
            start_pos=start,
            block_table=self.kv.block_table(req.request_id),
            sample=self._sample_spec(req) if reaches_end else None)

    def _sample_spec(self, req: Request) -> SampleSpec:
        params = req.params
        banned: list[int] = []
        if req.num_output_tokens < params.min_tokens:
            banned = sorted({*params.stop_token_ids,
                             *([] if params.ignore_eos else req.eos_token_ids)})
        return SampleSpec(params=params, seed=req.seed, output_pos=req.num_output_tokens,
                          prompt_token_ids=req.prompt_token_ids,
                          output_token_ids=req.output_token_ids, banned_token_ids=banned)

    # -- results ------------------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, result: RunnerOutput) -> list[Request]:
        """Advances the scheduled requests; returns those that got a token (some finished)."""
        updated: list[Request] = []
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens,
                                 req.cache_root, req.tenant)
            sampled = result.sampled.get(seq.request_id)
            if sampled is None:
                continue
            self.append_token(req, sampled.token_id)
            updated.append(req)
        return updated

    def append_token(self, req: Request, token_id: int) -> None:
        """Appends a sampled token and applies the token-level stop conditions."""
        req.append_output_token(token_id, self.block_size)
        params = req.params
        if token_id in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token_id
        elif not params.ignore_eos and token_id in req.eos_token_ids \
                and req.num_output_tokens > params.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH
        if req.is_finished:
            if req in self.running:
                self.running.remove(req)
            self._retire(req)

    # -- imported KV --------------------------------------------------------------------------
    def commit_imported(self, req: Request, first_token_id: int | None) -> None:
        """The imported KV is in place: the request runs from its first output token on
        (`first_token_id`), or, after a prefix import, prefills the rest of its prompt here
        (None; as a running request mid-prefill, so its imported blocks stay its own)."""
        del self.awaiting_kv[req.request_id]
        req.num_computed_tokens = req.kv_import_end
        self.kv.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens,
                             req.cache_root, req.tenant)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if first_token_id is None:
            req.num_cached_tokens = req.num_computed_tokens  # a peer's hit is a hit
        else:
            self.append_token(req, first_token_id)

    def fail_import(self, request_id: str, recompute: bool) -> Request | None:
        """The request's import failed: its reserved blocks go back to the pool and it
        waits to be prefilled here (`recompute`) or ends FINISHED_ERROR. None if it was
        not waiting for KV."""
        req = self.awaiting_kv.pop(request_id, None)
        if req is None:
            return None
        self.kv.free(request_id)
        req.num_computed_tokens = 0
        req.kv_prefix_end = None
        if recompute:
            req.status = RequestStatus.WAITING
            self.waiting.append(req)
        else:
            req.status = RequestStatus.FINISHED_ERROR
            del self.requests[request_id]
        return req

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        for req in self.running:
            assert req.status == RequestStatus.RUNNING, req
            assert req.num_computed_tokens <= req.num_tokens, req
        for req in self.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), req
            assert not self.kv.block_table(req.request_id), f"{req.request_id} waits holding blocks"
