"""One request's placement: what the router is asked (`RouteRequest`) and what it
answers (`RouteDecision`, with a `RouteReason`)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from splitserve.kv_cache.block_hash import BlockHash

from splitserve.cluster.router.config import DisaggPolicy
from splitserve.cluster.router.scoring import Scores


@dataclass(slots=True)
class RouteRequest:
    """What the router needs of a request."""

    request_id: str
    # Hashes of the prompt's full blocks, chained under the request's namespace root.
    block_hashes: list[BlockHash]
    num_prompt_tokens: int
    tenant: str | None = None
    disagg: DisaggPolicy | None = None  # None: the router's policy


class RouteReason(IntEnum):
    """Why a decision was made; reasons from FORCED_REMOTE on use a prefill worker."""

    AGGREGATED = 0  # no prefill workers: the cheapest worker prefills and decodes
    FORCED_LOCAL = 1  # policy NEVER
    LOCAL_FASTER = 2
    LOCAL_PREFIX_HIT = 3  # local won only thanks to the decode worker's cached prefix
    PREFILL_POOL_SATURATED = 4  # every prefill worker is over budget
    FORCED_REMOTE = 5  # policy ALWAYS
    REMOTE_FASTER = 6
    TPOT_BUDGET = 7  # local was cheaper but would push D's decodes over tpot_slo_s


@dataclass(frozen=True, slots=True)
class PeerFetch:
    """A prefix the decode worker imports from another worker's pool or tiers before it
    prefills the rest itself (a local decision only: a remote prefill worker is already
    chosen for its own hit)."""

    worker: str  # holds the prefix; exports it (ExportPrefix) without computing it
    num_tokens: int  # the prefix [0, num_tokens): whole blocks, below the prompt's end
    predicted_s: float  # the holder's queue + its tier loads + one step + the transfer


@dataclass(slots=True)
class RouteDecision:
    """Where a request goes; `prefill_worker` None: the decode worker prefills (after
    importing `peer`'s prefix, when set)."""

    decode_worker: str
    prefill_worker: str | None
    reason: RouteReason
    predicted_s: float  # queue + prefill (+ transfer) + first decode step, unweighted
    num_cached_tokens: int  # prompt tokens cached on the worker that prefills (or fetched)
    peer: PeerFetch | None = None

    @staticmethod
    def local(scores: Scores, d: int, worker_ids: list[str],
              reason: RouteReason) -> RouteDecision:
        """Worker `d` (an index into `scores`) prefills and decodes."""
        predicted = scores.queue_s[d] + scores.prefill_s[d] + scores.step_s[d]
        return RouteDecision(worker_ids[d], None, reason, float(predicted),
                             int(scores.num_cached_tokens[d]))

    @staticmethod
    def remote(scores: Scores, p: int, d: int, worker_ids: list[str],
               reason: RouteReason) -> RouteDecision:
        """Worker `p` computes the prompt and ships the KV to `d`, which decodes."""
        predicted = (scores.queue_s[p] + scores.prefill_s[p] + scores.transfer_s[d]
                     + scores.step_s[d])
        return RouteDecision(worker_ids[d], worker_ids[p], reason, float(predicted),
                             int(scores.num_cached_tokens[p]))
