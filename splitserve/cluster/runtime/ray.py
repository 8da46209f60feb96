"""The Ray runtime: the same workers as Ray actors, placed by Ray across machines.

Ray does placement and lifecycle only: which node runs a worker (resources, custom
resources per pool, placement groups), telling when one died (its actor or its node),
and keeping workers alive when the frontend dies (detached actors). Tokens and KV never
touch Ray: a worker connects to the frontend's CURVE-authenticated ZeroMQ socket as it
does locally, and binds its KV listener to its node's address with port 0, publishing
the address it got (WorkerReady.kv_address): no port is chosen before binding, so two
workers on a node cannot collide, and the address is the one Ray itself reaches the node
by. The worker's secret travels as an actor argument, so Ray's own links must be as
trusted as the machines (Ray's security model; docs/architecture.md "Threat model").

Workers live in the Ray namespace `splitserve-<cluster name>`, named by incarnation
(`decode-1:3`). A frontend started with the name of one that died finds them
(`find_workers`) and adopts the ones its configuration asks for (`adopt_worker`): they
keep their weights and cached prefixes and re-register with it.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayError
from ray.util.placement_group import (PlacementGroup, get_placement_group, placement_group,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.runtime.base import Runtime, WorkerHandle
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import RayConfig

if TYPE_CHECKING:
    from splitserve.cluster.worker.worker import Worker

logger = logging.getLogger(__name__)

FIND_TIMEOUT_S = 10.0  # a found worker that does not answer this soon is not adopted


def namespace(cluster_name: str) -> str:
    return f"splitserve-{cluster_name}"


class WorkerActor:
    """One worker in a Ray actor. `run` is the engine thread: it builds the worker (loads
    the model) and runs it until it stops, so torch is only ever called from that one
    thread (OpenMP keeps one team of spinning threads; torch called from a second Python
    thread makes a second team, and the two then sleep between parallel regions: +30% TPOT
    measured). `adopt`, `stop`, `info` and `wait_stopped` arrive on the actor's other
    threads (max_concurrency) and wait for the worker to exist."""

    def __init__(self, spec_json: str, secret: bytes) -> None:
        self._spec = replace(WorkerSpec.from_json(spec_json),
                             kv_host=ray.util.get_node_ip_address())
        self._secret = WorkerSecret.from_bytes(secret)
        self._worker: Worker | None = None
        self._built = threading.Event()  # set when the worker exists, or failed to
        self._stopped = threading.Event()
        self._stop_early = False

    def run(self) -> None:
        spec = self._spec
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.worker_id} "
                            "%(levelname)s %(name)s: %(message)s")
        try:
            from splitserve.cluster.worker.worker import Worker  # torch: in the actor only
            self._worker = Worker(spec, self._secret)
            self._built.set()
            if not self._stop_early:
                self._worker.run()
            else:
                self._worker.close()
        finally:
            self._built.set()
            self._stopped.set()

    def _get(self) -> Worker:
        self._built.wait()
        if self._worker is None:
            raise RuntimeError(f"{self._spec.worker_id} failed to start")
        return self._worker

    def wait_stopped(self) -> None:
        """Returns when the worker stopped; fails when the actor (or its node) died. A
        frontend that adopted this worker watches it through this call."""
        self._stopped.wait()

    def info(self) -> dict[str, Any]:
        worker = self._get()
        return {"spec": worker.spec.to_json(), "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "kv_address": worker.receiver.address if worker.receiver else None}

    def adopt(self, frontend_address: str, secret: bytes) -> None:
        self._get().adopt(frontend_address, WorkerSecret.from_bytes(secret))

    def stop(self) -> None:
        self._stop_early = True
        if self._worker is not None:
            self._worker.stopping = True


_RemoteWorker = ray.remote(WorkerActor)


@dataclass
class _Actor:
    actor: Any  # ray.actor.ActorHandle
    watch: ray.ObjectRef  # resolves when the worker stopped; raises when it died


class RayRuntime(Runtime):
    def __init__(self, config: RayConfig) -> None:
        self.config = config
        self.namespace = namespace(config.cluster_name)
        if not ray.is_initialized():
            ray.init(address=config.ray_address, namespace=self.namespace,
                     log_to_driver=True)
        # Workers on other nodes reach the frontend by the address Ray reaches this node by.
        self.control_host = ray.util.get_node_ip_address()
        self._actors: dict[bytes, _Actor] = {}
        self._found: dict[bytes, tuple[Any, WorkerSpec]] = {}  # a previous frontend's
        self._bundles: dict[str, tuple[PlacementGroup, int]] = {}  # worker id -> its bundle
        self._groups: list[PlacementGroup] = []

    # -- placement ------------------------------------------------------------------------------
    def _resources(self, spec: WorkerSpec) -> dict[str, float]:
        out = {"CPU": self.config.ray_cpus_per_worker}
        if self.config.ray_gpus_per_worker:
            out["GPU"] = self.config.ray_gpus_per_worker
        if self.config.ray_role_resources:
            out[spec.role.value] = 1.0
        return out

    def reserve(self, specs: list[WorkerSpec], timeout_s: float) -> None:
        """Placement groups (`ray_placement` pack: one for all workers; spread: one per
        pool), detached and named after the cluster so a later frontend finds them. A
        group Ray cannot place within `timeout_s` is an error that says what it needs."""
        if self.config.ray_placement == "none":
            return
        strategy = "PACK" if self.config.ray_placement == "pack" else "SPREAD"
        pools: dict[str, list[WorkerSpec]] = {}
        for spec in specs:
            key = "all" if strategy == "PACK" else spec.role.value
            pools.setdefault(key, []).append(spec)
        for key, members in pools.items():
            name = f"{self.namespace}-{key}"
            bundles = [self._resources(s) for s in members]
            group = _existing_group(name, bundles)
            if group is None:
                group = placement_group(bundles, strategy=strategy, name=name,
                                        lifetime="detached")
            if not group.wait(timeout_seconds=int(max(1, timeout_s))):
                raise RuntimeError(
                    f"Ray could not place {strategy} group {name!r} ({bundles}) within "
                    f"{timeout_s:g} s; available: {ray.available_resources()}")
            self._groups.append(group)
            for i, spec in enumerate(members):
                self._bundles[spec.worker_id] = (group, i)

    def _options(self, spec: WorkerSpec) -> dict[str, Any]:
        res = self._resources(spec)
        options: dict[str, Any] = {
            "name": spec.identity.decode(), "lifetime": "detached", "max_restarts": 0,
            "max_concurrency": 8, "num_cpus": res.pop("CPU"), "num_gpus": res.pop("GPU", 0),
            "resources": res}
        if spec.worker_id in self._bundles:
            group, index = self._bundles[spec.worker_id]
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index)
        return options

    # -- the Runtime interface ------------------------------------------------------------------
    def worker_spec(self, spec: WorkerSpec) -> WorkerSpec:
        threads = max(1, int(self.config.ray_cpus_per_worker))
        return replace(spec, outlive_frontend=True, cpu_cores=None, nice=0,
                       engine_args={**spec.engine_args, "num_threads": threads})

    def start_worker(self, spec: WorkerSpec, secret: WorkerSecret) -> WorkerHandle:
        actor = _RemoteWorker.options(**self._options(spec)).remote(  # type: ignore[attr-defined]
            spec.to_json(), secret.to_bytes())
        self._actors[spec.identity] = _Actor(
            actor, actor.run.remote())  # type: ignore[attr-defined]
        logger.info("started %s as a Ray actor (%s)", spec.worker_id, self._resources(spec))
        return WorkerHandle(spec)

    def rename(self, handle: WorkerHandle, spec: WorkerSpec) -> WorkerHandle:
        # The actor keeps its name (the first identity); find_workers reads the spec.
        self._actors[spec.identity] = self._actors.pop(handle.spec.identity)
        return WorkerHandle(spec, handle.pid)

    def is_alive(self, handle: WorkerHandle) -> bool:
        entry = self._actors.get(handle.spec.identity)
        if entry is None:
            return False
        done, _ = ray.wait([entry.watch], timeout=0)
        return not done

    def stop_worker(self, handle: WorkerHandle, timeout_s: float = 10.0) -> None:
        self._stop([handle], timeout_s)

    def shutdown(self, handles: list[WorkerHandle], timeout_s: float = 10.0) -> None:
        self._stop(handles, timeout_s)
        for group in self._groups:
            remove_placement_group(group)
        self._groups = []

    def _stop(self, handles: list[WorkerHandle], timeout_s: float) -> None:
        """Asks all to stop (they free their KV and check their pool), waits for them
        together, then ends their actors."""
        entries = [e for h in handles
                   if (e := self._actors.pop(h.spec.identity, None)) is not None]
        for entry in entries:
            entry.actor.stop.remote()
        deadline = time.monotonic() + timeout_s
        for entry in entries:
            done, _ = ray.wait([entry.watch], timeout=max(0.0, deadline - time.monotonic()))
            if done:
                try:
                    ray.get(entry.watch)
                except RayError as exc:
                    logger.warning("worker actor ended with %s", type(exc).__name__)
            ray.kill(entry.actor, no_restart=True)

    # -- a new frontend -------------------------------------------------------------------------
    def find_workers(self) -> list[WorkerSpec]:
        found: list[WorkerSpec] = []
        for name in ray.util.list_named_actors():
            try:
                actor = ray.get_actor(name)
                info: Any = ray.get(actor.info.remote(), timeout=FIND_TIMEOUT_S)
                spec = WorkerSpec.from_json(info["spec"])
            except (RayError, ValueError, KeyError, TypeError) as exc:
                logger.warning("Ray actor %r is not a live worker (%s); leaving it", name,
                               type(exc).__name__)
                continue
            self._found[spec.identity] = (actor, spec)
            found.append(spec)
            logger.info("found live worker %s (pid %s)", spec.worker_id, info["pid"])
        return found

    def adopt_worker(self, spec: WorkerSpec, frontend_address: str,
                     secret: WorkerSecret) -> WorkerHandle:
        actor, _ = self._found.pop(spec.identity)
        actor.adopt.remote(frontend_address, secret.to_bytes())
        self._actors[spec.identity] = _Actor(actor, actor.wait_stopped.remote())
        return WorkerHandle(replace(spec, frontend_address=frontend_address))

    def release_found(self, timeout_s: float = 10.0) -> None:
        handles = []
        for identity, (actor, spec) in self._found.items():
            self._actors[identity] = _Actor(actor, actor.wait_stopped.remote())
            handles.append(WorkerHandle(spec))
        self._found.clear()
        self._stop(handles, timeout_s)


def _existing_group(name: str, bundles: list[dict[str, float]]) -> PlacementGroup | None:
    """The detached group a previous frontend made, if it still has the same shape."""
    try:
        group = get_placement_group(name)
    except ValueError:
        return None
    if group.bundle_specs == bundles:
        return group
    remove_placement_group(group)
    return None
