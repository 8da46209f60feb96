"""Brings a cluster up and down: the dispatcher, the router and the worker processes that
`ServeConfig` asks for, started through a Runtime and kept running by the Supervisor.

Each worker incarnation gets its own control-plane keypair (cluster/auth.py), registered
with the frontend under its identity before it starts and revoked once it exited: only
workers started here can join."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any

from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend.recovery import KVFailurePolicy, RetryPolicy
from splitserve.cluster import protocol as P
from splitserve.cluster.planner.actuator import Actuator, Applied, PlannerMode
from splitserve.cluster.planner.auto_layout import (check_measured_engine, publish_layout,
                                                    resolve_layout, router_costs,
                                                    router_tpot_slo_s)
from splitserve.cluster.planner.layout import LayoutChoice
from splitserve.cluster.planner.load_time import LoadTimes, ModelLoad
from splitserve.cluster.planner.model import (Decision, Observation, PlannerConfig,
                                              WorkerSample)
from splitserve.cluster.planner.planner import Planner
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.cost_model import DecodeStepModel, PrefillCostModel, Quadratic
from splitserve.cluster.router.router import Router, RouterConfig
from splitserve.cluster.runtime import Runtime, WorkerHandle, get_runtime
from splitserve.cluster.specs import store_key, store_options, worker_specs
from splitserve.cluster.supervisor import WATCH_PERIOD_S, Supervisor
from splitserve.cluster.worker.lending import remove_leases
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import ServeConfig

logger = logging.getLogger(__name__)

def _fitted(model: PrefillCostModel | DecodeStepModel) -> Quadratic | None:
    """A worker's own fitted curve; None while it answers with the pooled one or a prior."""
    return Quadratic(*model.coefficients) if model.is_fitted else None


class Cluster:
    def __init__(self, config: ServeConfig, runtime: Runtime | None = None) -> None:
        self.config = config
        self.runtime = runtime or get_runtime(config)
        self.handles: list[WorkerHandle] = []
        self.retired: list[WorkerHandle] = []  # drained, or exited for good (supervisor.py)
        self.dispatcher: Dispatcher | None = None
        self.adopted: list[str] = []  # worker ids taken over from a previous frontend
        self.actuator: Actuator | None = None
        self.last_decision: dict[str, object] | None = None  # the planner's, for /admin/health
        self.layout: LayoutChoice | None = None  # what --mode resolved to, and why
        self._plan: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self.load_times = LoadTimes()  # start -> registered, for the planner and supervisor

    async def start(self) -> Dispatcher:
        # --mode auto may measure the engine first (seconds): off the event loop.
        resolved = await asyncio.to_thread(resolve_layout, self.config)
        cfg = self.config = resolved.config
        self.layout = resolved.choice
        router = Router(RouterConfig(
            disagg="never" if cfg.mode == "agg" else cfg.disagg_policy,
            tpot_slo_s=router_tpot_slo_s(cfg, resolved.choice),
            cost=router_costs(resolved.curves),
            tenant_max_cached_blocks=cfg.tenant_max_cached_blocks,
            peer_fetch=cfg.store.kv_peer_fetch))
        dispatcher = self.dispatcher = Dispatcher(
            router, cfg.deadlines, max_queue_len=cfg.max_queue_len,
            retry=RetryPolicy(cfg.max_retries, KVFailurePolicy(cfg.kv_failure_policy),
                              wait_for_restarts=cfg.restart_workers),
            fault_injection=cfg.enable_fault_injection,
            slo_ttft_s=cfg.slo_ttft_ms / 1000 if cfg.slo_ttft_ms else None,
            slo_tpot_s=cfg.slo_tpot_ms / 1000 if cfg.slo_tpot_ms else None,
            control_host=self.runtime.control_host, reject_early=cfg.admission == "reject")
        dispatcher.link.store_key = store_key(cfg.store)
        publish_layout(dispatcher.metrics.registry, resolved.choice)
        dispatcher.start()
        specs = [self.runtime.worker_spec(s) for s in worker_specs(cfg, dispatcher.address)]
        try:
            await asyncio.to_thread(self.runtime.reserve, specs,
                                    cfg.deadlines.worker_start_timeout_s)
            await self._start_or_adopt(specs)
            await self._wait_registered(len(specs))
        except BaseException:
            await self.stop()
            raise
        await asyncio.to_thread(check_measured_engine, cfg, resolved, dispatcher.table.fingerprint)
        supervisor = Supervisor(self.handles, self.runtime, dispatcher, cfg, self.load_times,
                                self.retired)
        self._watch = asyncio.create_task(supervisor.run(), name="cluster-watch")
        if cfg.planner != "off":
            self.actuator = self._make_actuator()
            self._plan = asyncio.create_task(self.actuator.run(), name="planner")
        return dispatcher

    # -- the planner (cluster/planner/) ---------------------------------------------------
    def _make_actuator(self) -> Actuator:
        cfg = self.config
        assert cfg.slo_ttft_ms and cfg.slo_tpot_ms
        budget = cfg.planner_max_workers or len(os.sched_getaffinity(0))
        interval = cfg.planner_interval_s
        # Cooldowns and the scale-down window in intervals (1, 3, 12: 10 s, 30 s, 120 s at
        # the default interval), so a shorter interval makes the whole planner faster.
        planner = Planner(PlannerConfig(
            slo_ttft_s=cfg.slo_ttft_ms / 1000, slo_tpot_s=cfg.slo_tpot_ms / 1000,
            max_workers=max(budget, len(self.handles)), interval_s=interval,
            scale_up_cooldown_s=interval, scale_down_cooldown_s=3 * interval,
            scale_down_window_s=12 * interval, model_load_s=self.model_load().seconds))
        return Actuator(planner, PlannerMode(cfg.planner), self._observe, self,
                        self._on_decision)

    def _observe(self) -> Observation:
        """The interval's traffic and every worker the cluster runs: registered ones with
        their fitted cost models, starting ones (and those registered less than a model
        load ago) as warming. Draining workers are already leaving."""
        assert self.dispatcher is not None
        d, now = self.dispatcher, time.monotonic()
        totals = d.interval.take(now)
        load = self.model_load()
        serving = [w for w in d.table.healthy() if not w.draining]
        colocated = not any(w.role is Role.PREFILL for w in serving)
        samples = []
        for handle in self.handles:
            spec = handle.spec
            info = d.table.by_id.get(spec.worker_id)
            if info is not None and info.draining:
                continue
            state = d.router.worker_state(spec.worker_id)
            role = Role.BOTH if colocated and spec.role is Role.DECODE else spec.role
            warming = (info is None or state is None
                       or now - info.joined < load.seconds)
            samples.append(WorkerSample(
                spec.worker_id, role, warming,
                _fitted(state.prefill_model) if state else None,
                _fitted(state.decode_model) if state else None,
                state.num_running if state else 0, state.num_waiting if state else 0,
                state.num_waiting_tokens if state else 0,
                info.ready.max_num_seqs if info else 256))
        return Observation(now, totals.duration_s, totals.num_arrivals,
                           totals.mean_prompt_tokens, totals.mean_output_tokens,
                           totals.ttft_attainment, totals.tpot_attainment, tuple(samples),
                           load.seconds, totals.prompt_cv)

    def model_load(self) -> ModelLoad:
        """The start-to-serving time the planner uses: `--planner-model-load-s` when
        given, else the median measured over the workers this cluster started (those
        registered since the last call are counted first), else the default."""
        assert self.dispatcher is not None
        for handle in self.handles:
            info = self.dispatcher.table.by_id.get(handle.spec.worker_id)
            if info is not None and info.identity == handle.spec.identity:
                self.load_times.registered(info.identity, info.joined)
        return self.load_times.estimate(self.config.planner_model_load_s)

    def _on_decision(self, decision: Decision, applied: list[Applied]) -> None:
        assert self.dispatcher is not None
        metrics = self.dispatcher.metrics
        metrics.planner_target.labels("prefill").set(decision.num_prefill)
        metrics.planner_target.labels("decode").set(decision.num_decode)
        done = {id(a.step): a for a in applied}
        for step in decision.steps:
            a = done.get(id(step))
            result = "advised" if a is None else "applied" if a.ok else "failed"
            metrics.planner_steps.labels(step.kind.value, result).inc()
        self.last_decision = {
            "mode": self.config.planner, "layout": decision.layout.value,
            "prefill": decision.num_prefill, "decode": decision.num_decode,
            "steps": [{"kind": s.kind.value, "role": s.role.value if s.role else None,
                       "worker": s.worker_id} for s in decision.steps],
            "applied": [{"ok": a.ok, "detail": a.detail} for a in applied],
            "predicted": {"rate": decision.predicted_rate, "ttft_s": decision.predicted_ttft_s,
                          "tpot_s": decision.predicted_tpot_s},
            "model_load": self.model_load().to_dict(),
            "reasons": list(decision.reasons)}

    async def _start_or_adopt(self, specs: list[WorkerSpec]) -> None:
        """Adopts the live workers a previous frontend of this cluster left (Ray), where
        they do the work `specs` asks for (same role, index, engine and placement), and
        starts the rest; found workers not adopted are stopped first."""
        assert self.dispatcher is not None
        link, address = self.dispatcher.link, self.dispatcher.address
        found = {s.worker_id: s for s in await asyncio.to_thread(self.runtime.find_workers)}
        adopt = {s.worker_id: found[s.worker_id] for s in specs
                 if s.worker_id in found and found[s.worker_id].same_work(s)}
        for worker_id, old in adopt.items():
            self.handles.append(self.runtime.adopt_worker(old, address, link.enroll(old.identity)))
            self.adopted.append(worker_id)
            logger.info("adopted %s (incarnation %d)", worker_id, old.epoch)
        await asyncio.to_thread(self.runtime.release_found)
        for spec in specs:
            if spec.worker_id not in adopt:
                if spec.worker_id in found:  # a new incarnation of a different shape
                    spec = replace(spec, epoch=found[spec.worker_id].epoch + 1)
                self.load_times.started(spec.identity, time.monotonic())
                self.handles.append(self.runtime.start_worker(spec, link.enroll(spec.identity)))

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

    # -- resizing pools (the planner's actuator; POST /admin/workers, /admin/drain) ----------
    def add_worker(self, role: Role) -> str:
        """Starts one more worker of `role` (the next free index, the engine and placement
        of that pool's first worker); it serves once registered. Its id."""
        assert self.dispatcher is not None
        same = [h.spec for h in self.handles if h.spec.role is role]
        if Role.BOTH in (role, *(h.spec.role for h in self.handles)) and not same:
            raise ValueError(f"no {role.value} pool in this cluster (--mode "
                             f"{self.config.mode})")
        template = same[0] if same else self.handles[0].spec  # engine args are the pool's
        index = 1 + max((s.index for s in same), default=-1)
        spec = replace(template, role=role, index=index, epoch=1,
                       store=store_options(self.config.store, f"{role.value}-{index}"),
                       engine_args=self._thread_share(template))
        spec = replace(spec, epoch=self._next_epoch(spec.worker_id, 1))
        self.load_times.started(spec.identity, time.monotonic())
        self.handles.append(self.runtime.start_worker(spec, self.dispatcher.link.enroll(
            spec.identity)))
        logger.info("added %s", spec.worker_id)
        return spec.worker_id

    def _thread_share(self, template: WorkerSpec) -> dict[str, Any]:
        """The added worker's engine arguments: the template's, with its share of the
        cores it is pinned to when live workers use them too (one thread per pinned core
        each would oversubscribe them: OpenMP teams spin and every step slows many
        times). The workers already there keep their threads; --threads-per-worker sets
        every worker's, and wins."""
        args = dict(template.engine_args)
        cores = set(template.cpu_cores or ())
        if args.get("num_threads") or not cores:
            return args
        used = sum(h.spec.num_threads or 0 for h in self.handles
                   if cores & set(h.spec.cpu_cores or ()))
        args["num_threads"] = max(1, len(cores) - used)
        if used >= len(cores):
            logger.warning("the added worker shares cores %s with workers using %d threads; "
                           "it runs one (set --threads-per-worker for an even split)",
                           sorted(cores), used)
        return args

    async def switch_role(self, worker_id: str, role: Role,
                          timeout_s: float = 60.0) -> dict[str, object]:
        """Turns a worker into one of another pool without reloading its weights: drain it
        (its decoding requests move away with their KV), then it re-registers under a new
        identity (the new pool's next index, a new incarnation, a new key sent inside
        the control channel) with its engine and cache. Same process; KeyError: unknown
        worker; ValueError: a role it cannot switch to."""
        assert self.dispatcher is not None
        i = next((i for i, h in enumerate(self.handles) if h.spec.worker_id == worker_id), None)
        if i is None:
            raise KeyError(f"no worker {worker_id!r}")
        old = self.handles[i].spec
        if role is old.role or Role.BOTH in (role, old.role):
            raise ValueError(f"{worker_id} can switch between prefill and decode only")
        index = 1 + max((h.spec.index for h in self.handles if h.spec.role is role), default=-1)
        new = replace(old, role=role, index=index, epoch=0)
        new = replace(new, epoch=self._next_epoch(new.worker_id, old.epoch + 1))
        report: dict[str, object] = {**await self.dispatcher.drain(worker_id, timeout_s)}
        self.handles[i] = self.runtime.rename(self.handles[i], new)
        secret = self.dispatcher.link.enroll(new.identity)
        self.dispatcher.link.send(old.identity, P.SwitchRole(role, index, new.epoch,
                                                             secret.to_bytes()))
        self.dispatcher.workers.mute(old.identity)  # late reports: no Shutdown to it
        self.dispatcher.mark_dead(old.identity, f"is becoming {new.worker_id}")
        await self.dispatcher.wait_for_worker(new.identity, self.config.deadlines
                                              .worker_start_timeout_s)
        logger.info("%s is now %s (same process)", worker_id, new.worker_id)
        return {"worker": new.worker_id, "was": worker_id, **report}

    def _next_epoch(self, worker_id: str, at_least: int) -> int:
        """An incarnation number no identity of `worker_id` has used (a removed one never
        comes back: WorkerTable.check)."""
        assert self.dispatcher is not None
        used = [int(i.decode().rpartition(":")[2]) for i in self.dispatcher.table.seen
                if i.decode().rpartition(":")[0] == worker_id]
        return max([at_least, *(e + 1 for e in used)])

    async def drain_worker(self, worker_id: str, timeout_s: float = 60.0) -> dict[str, object]:
        """Takes a worker out of routing, moves its decoding requests to the other decode
        workers with their KV (exact, nothing recomputed), then stops it for good (it is
        not restarted). Requests that did not move within `timeout_s` (still prefilling,
        or no other decode worker) resume elsewhere by replay. KeyError: unknown worker."""
        assert self.dispatcher is not None
        handle = next((h for h in self.handles if h.spec.worker_id == worker_id), None)
        if handle is None:
            raise KeyError(f"no worker {worker_id!r}; workers: "
                           f"{sorted(h.spec.worker_id for h in self.handles)}")
        if worker_id not in self.dispatcher.table.by_id:  # still starting: nothing to move
            self.handles.remove(handle)
            self.retired.append(handle)  # its lease files go at stop
            self.load_times.forget(handle.spec.identity)
            self.dispatcher.link.revoke(handle.spec.identity)
            await asyncio.to_thread(self.runtime.stop_worker, handle)
            logger.info("stopped %s before it registered", worker_id)
            return {"worker": worker_id, "moved": 0, "stayed": 0, "pool": None}
        report: dict[str, object] = {**await self.dispatcher.drain(worker_id, timeout_s)}
        # What it holds now, by its own check (nothing, unless requests stayed).
        report["pool"] = (await self.dispatcher.admin.check_pools()).get(worker_id)
        self.handles.remove(handle)  # before it exits: the supervisor must not restart it
        self.retired.append(handle)
        self.dispatcher.mark_dead(handle.spec.identity, "was drained")
        await asyncio.to_thread(self.runtime.stop_worker, handle)
        logger.info("drained %s: %s", worker_id, report)
        return {"worker": worker_id, **report}

    async def stop(self) -> None:
        for task in (self._plan, self._watch):
            if task is not None:
                task.cancel()
        if self.dispatcher is not None:
            await self.dispatcher.close()
        await asyncio.to_thread(self.runtime.shutdown, self.handles)
        remove_leases({p for handle in [*self.handles, *self.retired]
                       for p in handle.spec.leases})
        self.handles = []
