"""Brings a cluster up and down: the dispatcher, the router and the worker processes that
`ServeConfig` asks for, started through a Runtime and watched while they run.

Each worker incarnation gets its own control-plane keypair (cluster/auth.py), registered
with the frontend under its identity before it starts and revoked once it exited: only
workers started here can join."""
from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace

from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend.recovery import KVFailurePolicy, RetryPolicy
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.router import Router, RouterConfig
from splitserve.cluster.runtime import Runtime, WorkerHandle, get_runtime, split_cores
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import ServeConfig

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5


def worker_specs(config: ServeConfig, frontend_address: str) -> list[WorkerSpec]:
    """One spec per worker: prefill workers first, then decode (or `both` in agg mode),
    each pinned to its share of this process's cores unless `worker_cores` says otherwise."""
    pools = ([(Role.PREFILL, config.prefill), (Role.DECODE, config.decode)]
             if config.mode == "disagg" else [(Role.BOTH, config.decode)])
    if config.worker_cores is not None:
        flat = [tuple(c) for c in config.worker_cores]
        if len(flat) != sum(n for _, n in pools):
            raise ValueError(f"worker_cores lists {len(flat)} core sets for "
                             f"{sum(n for _, n in pools)} workers")
        cores, pos = [], 0
        for _, n in pools:
            cores.append(flat[pos:pos + n])
            pos += n
    else:
        cores = split_cores(sorted(os.sched_getaffinity(0)), [n for _, n in pools])
    specs = []
    for (role, n), pool_cores in zip(pools, cores):
        for index in range(n):
            engine_args = dict(config.engine_args())
            if config.threads_per_worker:
                engine_args["num_threads"] = config.threads_per_worker
            specs.append(WorkerSpec(role=role, index=index, epoch=1,
                                    frontend_address=frontend_address, engine_args=engine_args,
                                    cpu_cores=pool_cores[index] or None,
                                    kv_transport=config.kv_transport,
                                    fault_injection=config.enable_fault_injection))
    return specs


class Cluster:
    def __init__(self, config: ServeConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        self.runtime = runtime or get_runtime(config.runtime)
        self.handles: list[WorkerHandle] = []
        self.dispatcher: Dispatcher | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> Dispatcher:
        cfg = self.config
        router = Router(RouterConfig(
            disagg="never" if cfg.mode == "agg" else cfg.disagg_policy,
            tpot_slo_s=cfg.slo_tpot_ms / 1000 if cfg.slo_tpot_ms else None,
            tenant_max_cached_blocks=cfg.tenant_max_cached_blocks))
        dispatcher = self.dispatcher = Dispatcher(
            router, cfg.deadlines, max_queue_len=cfg.max_queue_len,
            retry=RetryPolicy(cfg.max_retries, KVFailurePolicy(cfg.kv_failure_policy),
                              wait_for_restarts=cfg.restart_workers),
            fault_injection=cfg.enable_fault_injection,
            slo_ttft_s=cfg.slo_ttft_ms / 1000 if cfg.slo_ttft_ms else None,
            slo_tpot_s=cfg.slo_tpot_ms / 1000 if cfg.slo_tpot_ms else None)
        dispatcher.start()
        specs = worker_specs(cfg, dispatcher.address)
        try:
            for spec in specs:
                secret = dispatcher.link.enroll(spec.identity)
                self.handles.append(self.runtime.start_worker(spec, secret))
            await self._wait_registered(len(specs))
        except BaseException:
            await self.stop()
            raise
        self._watch = asyncio.create_task(self._watch_loop(), name="cluster-watch")
        return dispatcher

    async def _wait_registered(self, num: int) -> None:
        assert self.dispatcher is not None
        waiting = asyncio.create_task(self.dispatcher.wait_for_workers(
            num, self.config.deadlines.worker_start_timeout_s))
        while not waiting.done():
            dead = [h.spec.worker_id for h in self.handles if not self.runtime.is_alive(h)]
            if dead:
                waiting.cancel()
                raise RuntimeError(f"workers {dead} exited while starting; see their log")
            await asyncio.wait({waiting}, timeout=WATCH_PERIOD_S)
        waiting.result()

    async def _watch_loop(self) -> None:
        """A worker process that exits is dead at once (no need to wait for heartbeats);
        with `restart_workers`, a new incarnation (epoch + 1) takes its place, as a
        supervisor (systemd, Kubernetes) would restart it. A worker that exits before it
        ever registered is not restarted: it would fail the same way again."""
        dispatcher = self.dispatcher
        assert dispatcher is not None
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            for i, handle in enumerate(self.handles):
                if self.runtime.is_alive(handle):
                    continue
                spec = handle.spec
                dispatcher.mark_dead(spec.identity, "exited")
                dispatcher.link.revoke(spec.identity)  # registered or not: it is gone
                if not self.config.restart_workers or spec.identity not in dispatcher.table.seen:
                    continue
                self.runtime.stop_worker(handle)  # reaps the exited process
                new = replace(spec, epoch=spec.epoch + 1)
                self.handles[i] = self.runtime.start_worker(new, dispatcher.link.enroll(
                    new.identity))
                dispatcher.metrics.worker_restarts.labels(spec.worker_id).inc()
                logger.warning("restarted %s as epoch %d", spec.worker_id, spec.epoch + 1)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        await asyncio.to_thread(self.runtime.shutdown, self.handles)
        self.handles = []
