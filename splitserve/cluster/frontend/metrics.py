"""Prometheus metrics of the frontend (DESIGN.md 8), all named `splitserve_*`.

Latencies follow vLLM's benchmark definitions: TTFT = arrival -> first token streamed;
TPOT = (E2E - TTFT) / (output tokens - 1); ITL = every gap between streamed tokens.
Worker-side numbers (KV blocks, batch sizes, prefix hits, transfers) arrive in load and
transfer reports and are recorded here with a `worker` label.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from splitserve.cluster.frontend.flight import Flight
from splitserve.cluster.protocol import LoadReport, StepTiming, TierUsage
from splitserve.errors import KVImportError, KVTransferError
from splitserve.transfer.telemetry import TransferSide, TransferTelemetry

_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5,
            2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                  0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class DropReason(str, Enum):
    """Why the control plane dropped a frame or a connection: the fixed label values of
    `splitserve_control_frames_dropped_total{reason}`."""
    HANDSHAKE = "handshake"  # not CURVE, not our server key, not ZeroMQ at all
    UNKNOWN_KEY = "unknown_key"  # a CURVE client whose key the launcher did not register
    IDENTITY_MISMATCH = "identity_mismatch"  # a key speaking under another routing id
    FRAME_COUNT = "frame_count"  # not [routing id, one message]
    UNDECODABLE = "undecodable"  # not a well-formed message (protocol.decode refused it)
    REFUSED = "refused"  # well-formed, refused before acting (a registration that does
    # not check out, a message workers do not send)
    HANDLER_ERROR = "handler_error"  # acting on it raised: a bug, logged with its trace


class LostReason(str, Enum):
    """Why a send to a worker was lost (`splitserve_control_sends_lost_total{reason}`)."""
    FULL = "full"  # its queue is at the high-water mark: it does not read
    UNREACHABLE = "unreachable"  # it has no connection (ROUTER_MANDATORY)
    ERROR = "error"  # any other ZeroMQ error


def transfer_outcome(error: str | None) -> str:
    """The `outcome` label of `splitserve_kv_transfers_total` for an error class name a
    worker reported: known transfer and socket errors as themselves, any other string
    "other", so a worker cannot grow the label set."""
    if error is None:
        return "ok"
    todo: list[type] = [KVTransferError, KVImportError, OSError]
    while todo:  # walked each time: error classes may be defined after this module
        cls = todo.pop()
        if cls.__name__ == error:
            return error
        todo.extend(cls.__subclasses__())
    return "other"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("splitserve_requests", "Finished requests by outcome "
                                "(stop, length, abort, error, timeout, rejected)",
                                ["outcome"], registry=r)
        self.ttft = Histogram("splitserve_time_to_first_token_seconds", "TTFT",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("splitserve_time_per_output_token_seconds",
                              "TPOT = (E2E - TTFT) / (output tokens - 1)",
                              buckets=_TOKEN_LATENCY, registry=r)
        self.itl = Histogram("splitserve_inter_token_latency_seconds",
                             "Every gap between streamed tokens", buckets=_TOKEN_LATENCY,
                             registry=r)
        self.e2e = Histogram("splitserve_e2e_request_latency_seconds", "Arrival -> last token",
                             buckets=_LATENCY, registry=r)
        self.queue_time = Histogram("splitserve_queue_time_seconds",
                                    "Time per phase: admission (frontend queue), prefill "
                                    "(dispatch -> first token), kv (remote prefill: first "
                                    "token -> the decode worker committed the KV)", ["phase"],
                                    buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("splitserve_prompt_tokens", "Prompt tokens admitted",
                                     registry=r)
        self.generation_tokens = Counter("splitserve_generation_tokens",
                                         "Output tokens streamed", registry=r)
        self.prefix_hit_tokens = Counter("splitserve_prefix_cache_hit_tokens",
                                         "Prompt tokens served from a prefix cache, by worker "
                                         "and tier", ["worker", "tier"], registry=r)
        self.prefix_query_tokens = Counter("splitserve_prefix_cache_query_tokens",
                                           "Prompt tokens looked up in a prefix cache",
                                           ["worker"], registry=r)
        self.kv_listener_held = Gauge("splitserve_kv_listener_held_connections",
                                      "KV listener connections waiting for a whole header",
                                      ["worker"], registry=r)
        self.kv_listener_closed = Counter("splitserve_kv_listener_closed_connections",
                                          "KV listener connections closed before a transfer: "
                                          "evicted (room), refused (no room, bad prelude), "
                                          "timed_out (no header in time), rejected (a whole "
                                          "header refused), forged (of which not authentic)",
                                          ["worker", "reason"],
                                          registry=r)
        self.totals = ReportedTotals()
        self.tiers = TierMetrics(r, self.totals)
        self.kv_blocks_used = Gauge("splitserve_kv_blocks_used", "KV blocks in use",
                                    ["worker"], registry=r)
        self.kv_blocks_total = Gauge("splitserve_kv_blocks_total", "KV blocks in the pool",
                                     ["worker"], registry=r)
        self.running = Gauge("splitserve_worker_running_requests", "Running sequences",
                             ["worker"], registry=r)
        self.waiting = Gauge("splitserve_worker_waiting_requests", "Queued sequences",
                             ["worker"], registry=r)
        self.prefill_batch = Histogram("splitserve_prefill_batch_tokens",
                                       "Prompt tokens per engine step", ["worker"],
                                       buckets=_BATCH, registry=r)
        self.decode_batch = Histogram("splitserve_decode_batch_size",
                                      "Decoding sequences per engine step", ["worker"],
                                      buckets=_BATCH, registry=r)
        self.transfers = Counter("splitserve_kv_transfers", "KV transfers by side and outcome",
                                 ["side", "outcome"], registry=r)
        self.transfer_bytes = Counter("splitserve_kv_transfer_bytes", "Bytes on the wire "
                                      "(sender side)", registry=r)
        self.transfer_time = Histogram("splitserve_kv_transfer_seconds",
                                       "Per-transfer stage times (DESIGN 4.3 telemetry)",
                                       ["stage"], buckets=_LATENCY, registry=r)
        self.router_decisions = Counter("splitserve_router_decisions",
                                        "Placement decisions by reason", ["decision"],
                                        registry=r)
        self.router_seconds = Histogram("splitserve_router_decision_seconds",
                                        "Time to route one request",
                                        buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2),
                                        registry=r)
        self.admission_rejections = Counter("splitserve_admission_rejections",
                                            "Requests refused at admission", ["status"],
                                            registry=r)
        self.failures = Counter("splitserve_failures", "Failures by kind", ["kind"],
                                registry=r)
        self.workers = Gauge("splitserve_workers", "Workers by role and health",
                             ["role", "state"], registry=r)
        # Recovery (DESIGN 7): what failed and what the cluster did about it.
        self.retries = Counter("splitserve_retries", "Request attempts retried on other "
                               "workers, by the failure that caused them", ["reason"],
                               registry=r)
        self.migrations = Counter("splitserve_migrations", "Retries that resumed a request "
                                  "after some of its tokens were streamed (replay)",
                                  registry=r)
        self.reprefills = Counter("splitserve_reprefills", "Failed KV imports the decode "
                                  "worker recomputed locally (--kv-failure-policy recompute)",
                                  registry=r)
        self.peer_fetches = Counter("splitserve_kv_peer_fetches", "Prompt prefixes fetched "
                                    "from another worker's pool or tiers, by outcome "
                                    "(started, committed, failed)", ["outcome"], registry=r)
        self.peer_fetch_tokens = Counter("splitserve_kv_peer_fetch_tokens", "Prompt tokens "
                                         "of the prefixes fetched from peers (started)",
                                         registry=r)
        self.stale_routes = Counter("splitserve_stale_routes", "Routed prefix hits the worker "
                                    "no longer had (index entries invalidated, resynced)",
                                    registry=r)
        self.fenced_messages = Counter("splitserve_fenced_messages", "Messages refused from "
                                       "removed or replaced worker incarnations", registry=r)
        self.live_migrations = Counter("splitserve_live_migrations", "Decoding requests "
                                       "asked to move to another worker with their KV, by "
                                       "outcome (moved, refused, target_gone)", ["outcome"],
                                       registry=r)
        self.planner_target = Gauge("splitserve_planner_target_workers", "Workers per role "
                                    "the planner's last decision targets", ["role"],
                                    registry=r)
        self.planner_steps = Counter("splitserve_planner_steps", "Steps the planner decided, "
                                     "by kind and result (applied, failed, advised)",
                                     ["kind", "result"], registry=r)
        self.worker_restarts = Counter("splitserve_worker_restarts", "Worker processes "
                                       "restarted after exiting", ["worker"], registry=r)
        self.faults_injected = Counter("splitserve_faults_injected", "Faults armed through "
                                       "the admin endpoint", ["kind"], registry=r)
        self.slo_attained = Counter("splitserve_slo_attained_requests",
                                    "Completed requests meeting the configured SLO "
                                    "(ttft, tpot, or all of them)", ["slo"], registry=r)
        self.control_dropped = Counter("splitserve_control_frames_dropped",
                                       "Control-plane frames and handshakes dropped, by "
                                       "reason (cluster/auth.py, frontend/link.py)",
                                       ["reason"], registry=r)
        self.control_lost = Counter("splitserve_control_sends_lost", "Messages to workers "
                                    "ZeroMQ did not take, by message and reason (the "
                                    "dispatcher fails the attempt or resends)",
                                    ["message", "reason"], registry=r)
        self.index_blocks = Gauge("splitserve_router_indexed_blocks",
                                  "Distinct block hashes in the router's prefix index",
                                  registry=r)

    def observe_tokens(self, flight: Flight, num_tokens: int, now: float) -> None:
        """New tokens streamed for `flight` (before its timestamps are advanced)."""
        self.generation_tokens.inc(num_tokens)
        if flight.first_token_at is None:
            self.ttft.observe(now - flight.arrival)
            if flight.dispatched_at is not None:
                self.queue_time.labels("prefill").observe(now - flight.dispatched_at)
        elif flight.last_token_at is not None:
            self.itl.observe(now - flight.last_token_at)

    def observe_finished(self, flight: Flight, outcome: str, now: float,
                         slo_ttft_s: float | None, slo_tpot_s: float | None) -> None:
        self.requests.labels(outcome).inc()
        num_out = flight.merger.num_tokens
        if flight.first_token_at is None or outcome not in ("stop", "length"):
            return
        self.e2e.observe(now - flight.arrival)
        ttft = flight.first_token_at - flight.arrival
        tpot = (now - flight.first_token_at) / (num_out - 1) if num_out > 1 else 0.0
        if num_out > 1:
            self.tpot.observe(tpot)
        met_ttft = slo_ttft_s is None or ttft <= slo_ttft_s
        met_tpot = slo_tpot_s is None or tpot <= slo_tpot_s
        for slo, met in (("ttft", met_ttft), ("tpot", met_tpot), ("all", met_ttft and met_tpot)):
            if met:
                self.slo_attained.labels(slo).inc()

    def observe_load(self, worker: str, msg: LoadReport) -> None:
        self.observe_steps(worker, msg.steps)
        self.kv_blocks_used.labels(worker).set(msg.kv_blocks_used)
        self.kv_blocks_total.labels(worker).set(msg.kv_blocks_total)
        self.running.labels(worker).set(msg.num_running)
        self.waiting.labels(worker).set(msg.num_waiting)
        advance = self.totals.advance
        advance(self.prefix_hit_tokens.labels(worker, "device"), msg.num_prefix_hit_tokens)
        advance(self.prefix_query_tokens.labels(worker), msg.num_prompt_tokens)
        self.tiers.observe(worker, msg.tiers)
        if (kv := msg.kv_listener) is not None:
            self.kv_listener_held.labels(worker).set(kv.held)
            for reason in ("evicted", "refused", "timed_out", "rejected", "forged"):
                advance(self.kv_listener_closed.labels(worker, reason), getattr(kv, reason))

    def count_workers(self, workers: list[tuple[str, str]]) -> None:
        """(role, state) of every registered worker: healthy, unhealthy or draining."""
        self.workers.clear()
        for role, state in workers:
            self.workers.labels(role, state).inc()

    def observe_steps(self, worker: str, steps: list[StepTiming]) -> None:
        for step in steps:
            if step.num_prefill_tokens:
                self.prefill_batch.labels(worker).observe(step.num_prefill_tokens)
            if step.num_decode_seqs:
                self.decode_batch.labels(worker).observe(step.num_decode_seqs)

    def observe_transfer(self, t: TransferTelemetry, recomputes: bool = False) -> None:
        """One side's transfer record; `recomputes`: a failed import is prefilled locally
        (--kv-failure-policy recompute), so a receiver's failure is a re-prefill."""
        side = t.side.name.lower()
        self.transfers.labels(side, transfer_outcome(t.error)).inc()
        if t.error is not None and t.side is TransferSide.RECEIVER and recomputes:
            self.reprefills.inc()
        if t.side is TransferSide.SENDER:
            self.transfer_bytes.inc(t.wire_bytes)
            for stage, seconds in (("pack", t.pack_s), ("queue", t.queue_s), ("wire", t.wire_s),
                                   ("validate", t.validate_s), ("place", t.place_s),
                                   ("total", t.total_s), ("exposed", t.exposed_s)):
                self.transfer_time.labels(stage).observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class TierMetrics:
    """The KV store's tiers below each worker's pool (LoadReport.tiers). Per-tenant use is
    not here (/metrics is open): /admin/tenants/{tenant}/cache has it."""
    def __init__(self, r: CollectorRegistry, totals: ReportedTotals) -> None:
        self.totals = totals
        labels = ["worker", "tier"]
        self.latest: dict[str, list[TierUsage]] = {}  # worker -> its last report
        self.capacity = Gauge("splitserve_kv_tier_capacity_bytes", "Tier size", labels,
                              registry=r)
        self.used = Gauge("splitserve_kv_tier_used_bytes", "KV bytes held", labels, registry=r)
        self.blocks = Gauge("splitserve_kv_tier_blocks", "KV blocks held", labels, registry=r)
        self.hits = Counter("splitserve_kv_tier_hits", "Blocks brought up into the engine "
                            "pool from this tier", labels, registry=r)
        self.misses = Counter("splitserve_kv_tier_misses", "Lookups that found nothing "
                              "usable (corrupt files included)", labels, registry=r)
        self.read = Counter("splitserve_kv_tier_read_bytes", "Bytes loaded", labels,
                            registry=r)
        self.written = Counter("splitserve_kv_tier_written_bytes", "Bytes stored", labels,
                               registry=r)
        self.load_s = Counter("splitserve_kv_tier_load_seconds", "Time spent loading",
                              labels, registry=r)
        self.store_s = Counter("splitserve_kv_tier_store_seconds", "Time spent storing "
                               "(offload, write-back)", labels, registry=r)
        self.evictions = Counter("splitserve_kv_tier_evictions", "Blocks pushed out for "
                                 "room (capacity or a tenant's quota)", labels, registry=r)
        self.corrupt = Counter("splitserve_kv_tier_corrupt", "Files that failed their "
                               "checksum, key or fingerprint check (recomputed)", labels,
                               registry=r)
        self.refusals = Counter("splitserve_kv_tier_refusals", "Blocks a tier did not take, "
                                "by reason (quota, busy, not_admitted, too_big, io_error)",
                                [*labels, "reason"], registry=r)

    def observe(self, worker: str, tiers: list[TierUsage]) -> None:
        self.latest[worker] = tiers
        for t in tiers:
            key = (worker, t.tier)
            self.capacity.labels(*key).set(t.capacity_bytes)
            self.used.labels(*key).set(t.used_bytes)
            self.blocks.labels(*key).set(t.blocks)
            for counter, value in ((self.hits, t.hits), (self.misses, t.misses),
                                   (self.read, t.bytes_read), (self.written, t.bytes_written),
                                   (self.load_s, t.load_seconds),
                                   (self.store_s, t.store_seconds),
                                   (self.evictions, t.evictions), (self.corrupt, t.corrupt)):
                self.totals.advance(counter.labels(*key), value)
            for refusal in t.refusals:
                self.totals.advance(self.refusals.labels(*key, refusal.tier), refusal.blocks)

    def tenant_usage(self, tenant: str) -> dict[str, object]:
        """The tenant's bytes in each tier of each worker, as last reported."""
        workers = {worker: {t.tier: next((c.bytes for c in t.tenants if c.tier == tenant), 0)
                            for t in tiers} for worker, tiers in self.latest.items() if tiers}
        totals: dict[str, int] = {}
        for by_tier in workers.values():
            for tier, used in by_tier.items():
                totals[tier] = totals.get(tier, 0) + used
        return {"tenant": tenant, "bytes": totals, "workers": workers}


class ReportedTotals:
    """Counters that workers report as cumulative totals: each report adds what grew
    since the last one. A total below the last is a restarted worker (same id, a new
    incarnation counting from 0): all of it is new."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[Any, float]] = {}  # id(child) -> (child, last total)

    def advance(self, counter: Any, value: float) -> None:
        last = self._last.get(id(counter), (counter, 0.0))[1]
        grown = value - last if value >= last else value
        if grown > 0:
            counter.inc(grown)
        self._last[id(counter)] = (counter, value)  # the child kept: its id stays its own
