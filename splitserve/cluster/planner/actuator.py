"""The planner in a running cluster: every interval, what the cluster measured goes to
`Planner.step`; the decision is logged with its reasons and kept for /admin/health and
/metrics, and with `--planner on` carried out through the cluster's pool operations
(`Pools`: add a worker, drain one, switch one's role), one step at a time, in order.
`advisory` decides and reports the same, and acts on nothing.

The planner's colocated layout (`Role.BOTH` workers) is, in a disaggregated cluster, its
decode workers with no prefill pool: they prefill locally (the router's aggregated
route). So decode workers are shown as BOTH while no prefill worker serves, a step that
adds or removes a BOTH worker acts on a decode worker, and a switch between DECODE and
BOTH changes nothing but the name.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from splitserve.cluster.planner.model import Decision, Observation, Step, StepKind
from splitserve.cluster.planner.planner import Planner
from splitserve.cluster.protocol import Role

logger = logging.getLogger(__name__)


class PlannerMode(str, Enum):
    OFF = "off"
    ADVISORY = "advisory"  # decide and report; act on nothing
    ON = "on"


class Pools(Protocol):
    """What the planner acts through (the launcher's Cluster)."""

    def add_worker(self, role: Role) -> str: ...

    async def drain_worker(self, worker_id: str, timeout_s: float) -> dict[str, object]: ...

    async def switch_role(self, worker_id: str, role: Role,
                          timeout_s: float) -> dict[str, object]: ...


def as_cluster_role(role: Role) -> Role:
    """The worker role that plays a planner role in a disaggregated cluster."""
    return Role.DECODE if role is Role.BOTH else role


@dataclass
class Applied:
    step: Step
    ok: bool
    detail: str


class Actuator:
    def __init__(self, planner: Planner, mode: PlannerMode, observe: Callable[[], Observation],
                 pools: Pools, on_decision: Callable[[Decision, list[Applied]], None],
                 drain_timeout_s: float = 60.0) -> None:
        self.planner, self.mode, self.observe, self.pools = planner, mode, observe, pools
        self.on_decision, self.drain_timeout_s = on_decision, drain_timeout_s

    async def run(self) -> None:
        """Until cancelled: one decision per interval (a failing one is logged, the loop
        goes on: the next interval sees the cluster as it is)."""
        while True:
            await asyncio.sleep(self.planner.config.interval_s)
            try:
                await self.tick()
            except Exception:
                logger.exception("planner interval failed")

    async def tick(self) -> Decision:
        decision = self.planner.step(self.observe())
        applied: list[Applied] = []
        if decision.is_change:
            logger.info("planner (%s): %s, %d prefill / %d decode; steps %s; because %s",
                        self.mode.value, decision.layout.value, decision.num_prefill,
                        decision.num_decode, [_describe(s) for s in decision.steps],
                        "; ".join(decision.reasons))
            if self.mode is PlannerMode.ON:
                for step in decision.steps:
                    result = await self._apply(step)
                    applied.append(result)
                    if not result.ok:  # the rest assumed this one: decide again next time
                        break
        self.on_decision(decision, applied)
        return decision

    async def _apply(self, step: Step) -> Applied:
        try:
            if step.kind is StepKind.ADD:
                assert step.role is not None
                return Applied(step, True, self.pools.add_worker(as_cluster_role(step.role)))
            assert step.worker_id is not None
            if step.kind is StepKind.REMOVE:
                report = await self.pools.drain_worker(step.worker_id, self.drain_timeout_s)
                return Applied(step, True, str(report))
            assert step.role is not None and step.from_role is not None
            to, was = as_cluster_role(step.role), as_cluster_role(step.from_role)
            if to is was:
                return Applied(step, True, "same worker role")
            report = await self.pools.switch_role(step.worker_id, to, self.drain_timeout_s)
            return Applied(step, True, str(report))
        except Exception as exc:  # a step that cannot be done is reported, not raised
            logger.warning("planner step %s failed: %s: %s", _describe(step),
                           type(exc).__name__, exc)
            return Applied(step, False, f"{type(exc).__name__}: {exc}")


def _describe(step: Step) -> str:
    if step.kind is StepKind.ADD:
        return f"add {step.role.value if step.role else '?'}"
    if step.kind is StepKind.REMOVE:
        return f"drain {step.worker_id}"
    return f"switch {step.worker_id} to {step.role.value if step.role else '?'}"
