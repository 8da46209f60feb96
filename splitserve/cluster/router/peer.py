"""Peer fetch (issue 19, DESIGN.md 6: peers are a tier): a decode worker that prefills a
prompt itself may first import a longer prefix that another worker holds, in its pool or
its host/disk tiers, over the KV transfer layer instead of recomputing it. The rule is
the tiers' rule one hop further: fetch only when predicted faster than recomputing.

For decode worker d, holder w (any other worker, any role), both hits capped to leave
the prompt's last token to compute, and N = w's capped hit in tokens:

    gain(w) = prefill_s(d) - prefill_d(T - N)          d's own hit -> N tokens cached
    cost(w) = step(w) + tier_load(w)                   w's engine thread holds the prefix
            + latency + (N - cached(d)) * kv_bytes_per_token   between two steps (nothing
              / bandwidth                                       queues or is computed)

A holder is a candidate when its hit is at least `peer_min_blocks` longer than d's; the
one with the largest gain - cost is taken when gain > cost.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from splitserve.cluster.router.config import KVLayout, RouterConfig
from splitserve.cluster.router.cost_model import PrefillCostModel
from splitserve.cluster.router.placement import PeerFetch, RouteDecision
from splitserve.cluster.router.scoring import Scores


class PeerOption(NamedTuple):
    """The best holder for one local decision."""

    column: int  # the holder's index into the scores
    num_tokens: int  # N: the prefix it exports, whole blocks, below the prompt's end
    gain_s: float  # d's prefill time the prefix saves
    cost_s: float  # the holder's step and tier loads, and the transfer


def best_peer(s: Scores, hit_blocks: np.ndarray, load_s: np.ndarray | None, d: int,
              num_tokens: int, prefill: PrefillCostModel, config: RouterConfig,
              kv: KVLayout) -> PeerOption | None:
    """The holder worth fetching from for decode worker `d` (an index into `s`), or None.
    `hit_blocks` and `load_s` are what the route computed: every worker's hit in blocks,
    pool plus tier extension, and the seconds its tier part takes to load (None: no
    worker reported a tier)."""
    bs = kv.block_size
    # NOTE: the engine always computes the last token, so the prefix leaves one behind.
    capped = np.minimum(hit_blocks, (num_tokens - 1) // bs)
    is_candidate = capped - capped[d] >= config.peer_min_blocks
    is_candidate[d] = False
    if not is_candidate.any():
        return None
    n = capped * bs  # [num_workers] tokens each worker could export
    a, b, c = prefill.coefficients
    uncached = num_tokens - n  # >= 1: Quadratic's value is predict()'s
    gain = s.prefill_s[d] - np.maximum(a + uncached * (b + uncached * c), 0.0)
    # Only what d lacks crosses the wire: d keeps its own cached prefix.
    transfer = (config.transfer_latency_s + (n - s.num_cached_tokens[d])
                * (kv.kv_bytes_per_token / config.transfer_bandwidth_bytes_s))
    # The holder exports between two of its steps (engine.hold_prefix): its queue of
    # waiting prompts does not delay it, its current step does.
    cost = s.step_s + transfer
    if load_s is not None:
        cost = cost + load_s
    net = np.where(is_candidate, gain - cost, -np.inf)
    w = int(np.argmax(net))  # ties: the first registered holder
    if not net[w] > 0.0:
        return None
    return PeerOption(w, int(n[w]), float(gain[w]), float(cost[w]))


def with_peer(decision: RouteDecision, option: PeerOption,
              worker_ids: list[str]) -> RouteDecision:
    """`decision` (local) importing `option`'s prefix first: N tokens count as cached,
    and the prediction trades the prefill time saved for the fetch's."""
    assert decision.prefill_worker is None, "a prefill worker uses its own hit"
    peer = PeerFetch(worker_ids[option.column], option.num_tokens, option.cost_s)
    return dataclasses.replace(
        decision, num_cached_tokens=option.num_tokens, peer=peer,
        predicted_s=decision.predicted_s - option.gain_s + option.cost_s)
