"""Who is in the cluster: workers join (WorkerReady), report load, and leave (death,
silence, replacement by a new incarnation). Keeps the worker table, the router's view
of membership and the worker metrics in step; knows nothing of requests (the dispatcher
asks which of a leaving worker's requests still need it).

A message from an identity that was removed or replaced is refused and its sender told
to exit, once (fencing, DESIGN 7): a worker that went silent and woke up cannot act next
to the incarnation that replaced it. Leaving revokes the incarnation's key (auth.py).
"""
from __future__ import annotations

import asyncio
import logging
import time

from splitserve.cluster import protocol as P
from splitserve.store.block import TierName
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.worker_table import WorkerInfo, WorkerTable
from splitserve.cluster.router.router import KVLayout, Router, WorkerLoad
from splitserve.errors import ProtocolError
from splitserve.kv_cache.block_hash import BlockHash, hash_full_blocks, root_hash

logger = logging.getLogger(__name__)


class Workers:
    def __init__(self, router: Router, link: WorkerLink, metrics: Metrics) -> None:
        self.router, self.link, self.metrics = router, link, metrics
        self.table = WorkerTable()
        self.max_model_len = 0  # the smallest any worker serves
        self.block_size = 16
        self._fenced: set[bytes] = set()  # removed incarnations already told to exit
        self._registered = asyncio.Event()

    async def wait_for(self, num_workers: int, timeout_s: float) -> None:
        """Returns once `num_workers` are registered; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while len(self.table.workers) < num_workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(self.table.workers)} of {num_workers} workers "
                                   f"registered within {timeout_s:g} s")
            self._registered.clear()
            try:
                await asyncio.wait_for(self._registered.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    def join(self, identity: bytes, msg: P.WorkerReady) -> WorkerInfo | None:
        """Registers a worker; the incarnation it replaces, already removed, if any.
        ProtocolError, with nothing changed, for a registration that does not check out:
        an identity the launcher did not register (or revoked), or any check of
        `WorkerTable.check` (a forged or repeated WorkerReady removes no one)."""
        if not self.link.is_allowed(identity):
            if identity in self.table.seen:
                self.fence(identity)
            raise ProtocolError(f"{identity!r} is not a worker incarnation the launcher "
                                "registered")
        self.table.check(identity, msg)
        old = self.table.by_id.get(msg.worker_id)
        replaced = None
        if old is not None:
            replaced = self.leave(old.identity, "was replaced")
        self.table.register(identity, msg)
        self.block_size = msg.block_size
        self.max_model_len = (msg.max_model_len if not self.max_model_len
                              else min(self.max_model_len, msg.max_model_len))
        # The workers know the model's KV layout (block size; bytes per token from layers,
        # heads, dtype): the router's block counts and transfer-time estimate use it.
        self.router.set_kv_layout(KVLayout(msg.block_size, msg.kv_bytes_per_token))
        self.router.add_worker(msg.worker_id, msg.role, _load(msg))
        self.metrics.kv_blocks_total.labels(msg.worker_id).set(msg.num_blocks)
        self.count()
        logger.info("worker %s registered (pid %d, %d KV blocks)", msg.worker_id, msg.pid,
                    msg.num_blocks)
        self._registered.set()
        return replaced

    def leave(self, identity: bytes, why: str) -> WorkerInfo | None:
        """Forgets a worker (removed from routing); None if it was not registered."""
        self.link.revoke(identity)  # no new connection with its key
        worker = self.table.remove(identity)
        if worker is None:
            return None
        logger.error("worker %s %s; removing it", worker.worker_id, why)
        worker.healthy = False
        self.router.remove_worker(worker.worker_id)
        self.count()
        return worker

    def heard_from(self, identity: bytes) -> WorkerInfo | None:
        """The registered worker behind a message, or None (then the message is refused
        and a removed incarnation is fenced)."""
        worker = self.table.get(identity)
        if worker is None:
            self.fence(identity)
            return None
        worker.last_seen = time.monotonic()
        return worker

    def mute(self, identity: bytes) -> None:
        """Messages from this removed identity are refused without telling it to exit:
        its process lives on under another identity (a role switch)."""
        self._fenced.add(identity)

    def fence(self, identity: bytes) -> None:
        self.metrics.fenced_messages.inc()
        if identity not in self._fenced and identity in self.table.seen:
            self._fenced.add(identity)
            logger.warning("refusing messages from %r, a removed or replaced worker "
                           "incarnation; telling it to exit", identity)
            self.link.send(identity, P.Shutdown())

    def observe_load(self, worker: WorkerInfo, msg: P.LoadReport) -> None:
        """A load report: the worker's queue and memory, and its pure prefill or pure
        decode steps as samples for the router's cost models (mixed steps fit neither)."""
        wid = worker.worker_id
        self.router.update_load(wid, _load(worker.ready, msg), msg.received)
        for step in msg.steps:
            if step.num_prefill_tokens and not step.num_decode_seqs:
                self.router.observe_prefill(wid, step.num_prefill_tokens, step.seconds)
            elif step.num_decode_seqs and not step.num_prefill_tokens:
                self.router.observe_decode_step(wid, step.num_decode_seqs, step.seconds)
        for tier in msg.tiers:
            self.router.observe_tier_loads(wid, TierName(tier.tier), tier.hits,
                                           tier.load_seconds)
        self.metrics.observe_load(worker.worker_id, msg)
        self.metrics.index_blocks.set(self.router.num_indexed_blocks)

    def decoders(self) -> list[WorkerInfo]:
        """Healthy workers that can decode (decode and aggregated roles)."""
        return [w for w in self.table.healthy() if w.role.can_decode and not w.draining]

    def block_hashes(self, namespace: str | None, token_ids: list[int]) -> list[BlockHash]:
        """A prompt's block hashes as the workers compute them (DESIGN 4.1); none before
        the first worker told the model's fingerprint."""
        fingerprint = self.table.fingerprint
        if fingerprint is None:
            return []
        return hash_full_blocks(root_hash(fingerprint, namespace), token_ids, self.block_size)

    def health(self) -> list[dict[str, object]]:
        return [{"id": w.worker_id, "role": w.role.value, "healthy": w.healthy,
                 "incarnation": w.identity.decode(errors="replace"), "pid": w.ready.pid,
                 "requests": len(w.request_ids), "kv_address": w.ready.kv_address,
                 "draining": w.draining, "pace_s": w.ready.pace_s,
                 "borrows_cores": w.ready.borrows_cores}
                for w in self.table.workers.values()]

    def count(self) -> None:
        self.metrics.count_workers([
            (w.role.value, "draining" if w.draining else "healthy" if w.healthy else "unhealthy")
            for w in self.table.workers.values()])


def _load(ready: P.WorkerReady, report: P.LoadReport | None = None) -> WorkerLoad:
    """The router's view of a worker: what it said at registration (its limits), and its
    latest load report (none yet: idle, every KV block free)."""
    if report is None:
        return WorkerLoad(0, 0, 0, 0, ready.num_blocks, ready.max_num_seqs,
                          max_num_partial_prefills=ready.max_num_partial_prefills,
                          pace_s=ready.pace_s or 0.0, borrows_cores=ready.borrows_cores)
    return WorkerLoad(report.num_running, report.num_waiting + report.num_awaiting_kv,
                      report.num_waiting_tokens, report.kv_blocks_used,
                      report.kv_blocks_total, ready.max_num_seqs, report.num_prefilling,
                      ready.max_num_partial_prefills, ready.pace_s or 0.0,
                      ready.borrows_cores)
