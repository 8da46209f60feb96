"""Scores one request against every worker at once (DESIGN.md 5; router.py decides with
the scores). Each worker's request-independent terms sit in one column of
`WorkerColumns`, rebuilt whenever that worker changes, so a route costs a few dozen
numpy operations over all workers instead of a Python loop per worker (64 workers: a
route takes ~60 us instead of ~250 us on a 2-core machine).

    columns   [NUM_TERMS, capacity]   row t = one term, column w = one worker
    Scores    arrays [num_workers]    in the order of `WorkerColumns.worker_ids`

Costs are seconds (lower is better). For worker w with `cached` prompt tokens in the
index (the last block is always recomputed, as the engine does) and `u = T - cached`:

    prefill(w) = full(T) - locality_weight * (full(T) - full(u))      full = cost model
    load(w)    = queue(w) + step(w) + stall(w)
                 queue: w's waiting and prefilling prompts through its cost model,
                        the ones a step shares its budget among counted up to u tokens
                        each (queue_wait)
                 step:  one decode step with w's running sequences + this one
                 stall: local prefill only: num_running * full(u) / tpot_window_tokens,
                        the TPOT its running sequences lose (the prefill's time spread
                        over the tokens their TPOT is averaged over)
    recent(w)  = predicted seconds of the prompts routed to w to prefill locally within
                 the TPOT horizon (tpot_window_tokens * tpot_slo_s: the time a sequence
                 takes for the tokens its TPOT is averaged over, at the SLO)
    memory(w)  = memory_pressure_s * x / (1 - x), x = KV usage with the prompt placed
    local(D)       = prefill(D) + load_weight * load(D) + memory_weight * memory(D)
    remote(P, D)   = prefill(P) + load_weight * queue(P) + memory_weight * memory(P)
                   + transfer(KV bytes of D's uncached tokens)
                   + load_weight * step(D) + memory_weight * memory(D)
    peer(D, W)     = with peer_fetch, a local D may import the N-token prefix W holds
                   (pool or tiers, >= peer_min_blocks longer than D's) when gain =
                   prefill(D) - full(T - N) > cost = step(W) + tier load(W)
                   + transfer(N - D's cached); the largest gain - cost wins (peer.py;
                   W holds the prefix between two steps, nothing queued or computed)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from splitserve.cluster.router.config import KVLayout, RouterConfig


class WorkerTerms(NamedTuple):
    """What scoring a worker needs that does not depend on the request."""

    a: float  # prefill seconds = a + b*t + c*t^2 for t uncached tokens (clamped at 0)
    b: float
    c: float
    queued_seqs: int  # prompts waiting or in prefill there
    queued_tokens: int  # their tokens still to compute
    shared_slots: int  # prompts a new one shares the prefill budget with (partial prefills - 1)
    step_s: float  # one decode step with one more sequence than now
    num_running: int
    recent_prefill_s: float  # local prefills placed here within the TPOT horizon
    pace_s: float  # its decode-only steps' interval while a prefill borrows its core (or 0)
    num_free_blocks: int
    num_blocks_total: int
    has_seq_room: bool  # running + waiting < max_num_seqs
    is_prefill: bool  # Role.PREFILL: prefills for others, never decodes


NUM_TERMS = len(WorkerTerms._fields)


class WorkerColumns:
    """WorkerTerms of every worker as columns of one array (swap-remove keeps them dense)."""

    def __init__(self, capacity: int = 64) -> None:
        self.worker_ids: list[str] = []
        self._col: dict[str, int] = {}
        self._data = np.zeros((NUM_TERMS, capacity))

    def __len__(self) -> int:
        return len(self.worker_ids)

    def set(self, worker_id: str, terms: WorkerTerms) -> None:
        col = self._col.get(worker_id)
        if col is None:
            col = self._col[worker_id] = len(self.worker_ids)
            self.worker_ids.append(worker_id)
            if col == self._data.shape[1]:
                self._data = np.concatenate([self._data, np.zeros_like(self._data)], axis=1)
        self._data[:, col] = terms

    def remove(self, worker_id: str) -> None:
        col = self._col.pop(worker_id, None)
        if col is None:
            return
        last = len(self.worker_ids) - 1
        if col != last:
            moved = self.worker_ids[last]
            self._data[:, col] = self._data[:, last]
            self.worker_ids[col] = moved
            self._col[moved] = col
        self.worker_ids.pop()

    def column_of(self, worker_id: str) -> int:
        return self._col[worker_id]

    def view(self) -> np.ndarray:
        """[NUM_TERMS, num_workers] (a view: valid until the next set/remove)."""
        return self._data[:, :len(self.worker_ids)]


@dataclass(slots=True)
class Scores:
    """Every worker scored for one request; arrays [num_workers], times in seconds."""

    num_cached_tokens: np.ndarray  # int: prompt tokens cached there (last block excluded)
    prefill_s: np.ndarray  # cost model for the uncached tokens
    credit_s: np.ndarray  # prefill time the cached prefix saves
    queue_s: np.ndarray
    step_s: np.ndarray
    transfer_s: np.ndarray  # KV of the uncached tokens over the wire
    local_cost: np.ndarray  # prefill here and decode here
    local_saving_s: np.ndarray  # what the cached prefix takes off local_cost
    remote_prefill_cost: np.ndarray  # prefill here for another worker
    remote_decode_cost: np.ndarray  # decode here after a remote prefill
    can_decode: np.ndarray  # bool: within budget and not a prefill worker
    can_prefill: np.ndarray  # bool: within budget and a prefill worker
    within_tpot: np.ndarray  # bool: a local prefill keeps running decodes in tpot_slo_s


def queue_wait(a: np.ndarray, b: np.ndarray, c: np.ndarray, queued_seqs: np.ndarray,
               queued_tokens: np.ndarray, shared_slots: np.ndarray,
               uncached: np.ndarray) -> np.ndarray:
    """Seconds of prefill work ahead of an `uncached`-token prompt, the queued prompts taken
    as equal (`queued_tokens / queued_seqs` each): the scheduler shares each step among
    up to `shared_slots` + 1 prompts (engine/scheduler.py), so the first `shared_slots`
    queued ones delay it only by what they compute while it does (up to its own length);
    those behind them in the queue, by all of theirs."""
    seqs = np.maximum(queued_seqs, 0.0)
    length = np.ceil(queued_tokens / np.maximum(seqs, 1.0))
    shared = np.minimum(seqs, np.maximum(shared_slots, 0.0))
    overlap = np.minimum(length, uncached)
    full = lambda t: np.maximum(a + t * (b + t * c), 0.0)  # noqa: E731
    wait = shared * full(overlap) + (seqs - shared) * full(length)
    return np.where((seqs > 0) & (queued_tokens > 0), wait, 0.0)


def score(terms: np.ndarray, hit_blocks: np.ndarray, num_tokens: int,
          config: RouterConfig, kv: KVLayout, load_s: np.ndarray | None = None) -> Scores:
    """Scores a `num_tokens` prompt of which worker w holds `hit_blocks[w]` leading
    blocks, some below its pool to be loaded first in `load_s[w]` seconds; `terms` is
    `WorkerColumns.view()`."""
    (a, b, c, queued_seqs, queued_tokens, shared_slots, step_s, running, recent_s, pace_s, free,
     total, has_room, is_prefill) = terms
    bs = kv.block_size
    # NOTE: the engine always recomputes the prompt's last token, so a hit on every block
    # still leaves the last block to compute.
    cached = np.minimum(hit_blocks * bs, (num_tokens - 1) // bs * bs)
    uncached = num_tokens - cached
    need_blocks = -(-num_tokens // bs) - cached // bs
    fits = (has_room > 0) & (need_blocks <= free)
    total = np.maximum(total, 1.0)
    usage = (total - free + need_blocks) / total
    memory_s = config.memory_pressure_s * usage / np.maximum(1.0 - usage, 1.0 / total)
    prefill_s = np.maximum(a + uncached * (b + uncached * c), 0.0)
    queue_s = queue_wait(a, b, c, queued_seqs, queued_tokens, shared_slots, uncached)
    if load_s is not None:  # loading a prefix from a tier below the pool is prefill time
        prefill_s = prefill_s + load_s
    credit_s = np.maximum(a + num_tokens * (b + num_tokens * c), 0.0) - prefill_s
    window = config.tpot_window_tokens
    stall_s = running * prefill_s / window
    if config.tpot_slo_s is None:
        within_tpot = np.ones_like(fits)
    else:
        # This prefill and the local ones placed here lately all stall the running decodes,
        # and the sequences that arrive while they run: an idle worker is no exception. A
        # pacing worker's sequences get a token per pace, not per step, before any stall.
        within_tpot = (np.maximum(step_s, pace_s) + (recent_s + prefill_s) / window
                       <= config.tpot_slo_s)
    transfer_s = (config.transfer_latency_s
                  + uncached * (kv.kv_bytes_per_token / config.transfer_bandwidth_bytes_s))
    lw, mw, locality = config.load_weight, config.memory_weight, config.locality_weight
    prefill_cost = prefill_s + (1.0 - locality) * credit_s
    mem_cost = mw * memory_s
    is_prefill = is_prefill > 0
    return Scores(
        num_cached_tokens=cached.astype(np.int64), prefill_s=prefill_s, credit_s=credit_s,
        queue_s=queue_s, step_s=step_s, transfer_s=transfer_s,
        local_cost=prefill_cost + lw * (queue_s + step_s + stall_s) + mem_cost,
        # The hit shortens the prefill and, with it, the stall of running decodes.
        local_saving_s=locality * credit_s * (1.0 + lw * running / window),
        remote_prefill_cost=prefill_cost + lw * queue_s + mem_cost,
        remote_decode_cost=transfer_s + lw * step_s + mem_cost,
        can_decode=fits & ~is_prefill, can_prefill=fits & is_prefill, within_tpot=within_tpot)


def argmin_where(values: np.ndarray, mask: np.ndarray) -> int | None:
    """Index of the smallest value where `mask` holds (the first on ties); None if none."""
    if not mask.any():
        return None
    return int(np.argmin(np.where(mask, values, np.inf)))
