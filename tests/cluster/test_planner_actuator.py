"""The planner's actuator (cluster/planner/actuator.py): a decision's steps reach the
cluster's pool operations in order, only with `--planner on`, with the colocated layout
played by decode workers; a step that fails stops the rest and is reported. The pools
and the planner are stand-ins here (the real ones: tests/cluster/test_planner.py and the
pool operations' end-to-end tests)."""
from __future__ import annotations

import asyncio
from typing import Any

from splitserve.cluster.planner.actuator import Actuator, Applied, PlannerMode
from splitserve.cluster.planner.model import (Decision, Layout, Observation, PlannerConfig,
                                              Step, StepKind)
from splitserve.cluster.protocol import Role

OBS = Observation(0.0, 10.0, 0, 0.0, 0.0, None, None, ())


class Pools:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.fail_on = fail_on

    def add_worker(self, role: Role) -> str:
        self.calls.append(("add", role.value))
        if self.fail_on == "add":
            raise ValueError("no room")
        return f"{role.value}-9"

    async def drain_worker(self, worker_id: str, timeout_s: float) -> dict[str, object]:
        self.calls.append(("drain", worker_id))
        return {"moved": 0}

    async def switch_role(self, worker_id: str, role: Role, timeout_s: float
                          ) -> dict[str, object]:
        self.calls.append(("switch", worker_id, role.value))
        return {"worker": f"{role.value}-1"}


class FixedPlanner:
    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self.config = PlannerConfig(slo_ttft_s=1, slo_tpot_s=0.1, max_workers=4)

    def step(self, obs: Observation) -> Decision:
        return self.decision


def _decision(*steps: Step) -> Decision:
    return Decision(Layout.AGG, 0, 3, steps, 1.0, 0.5, 0.05, ("because",))


def _run(mode: PlannerMode, decision: Decision, pools: Pools) -> list[list[Applied]]:
    seen: list[list[Applied]] = []
    actuator = Actuator(FixedPlanner(decision), mode, lambda: OBS, pools,  # type: ignore[arg-type]
                        lambda d, applied: seen.append(applied))
    asyncio.run(actuator.tick())
    return seen


STEPS = (Step(StepKind.REMOVE, None, "prefill-0", Role.PREFILL),
         Step(StepKind.SWITCH, Role.BOTH, "decode-0", Role.DECODE),
         Step(StepKind.SWITCH, Role.BOTH, "prefill-1", Role.PREFILL),
         Step(StepKind.ADD, Role.BOTH))


def test_on_applies_every_step_in_order_with_decode_workers_as_colocated() -> None:
    pools = Pools()
    (applied,) = _run(PlannerMode.ON, _decision(*STEPS), pools)
    assert pools.calls == [("drain", "prefill-0"), ("switch", "prefill-1", "decode"),
                           ("add", "decode")]  # decode -> both: the same worker already
    assert [a.ok for a in applied] == [True] * 4


def test_advisory_decides_and_reports_but_touches_nothing() -> None:
    pools = Pools()
    (applied,) = _run(PlannerMode.ADVISORY, _decision(*STEPS), pools)
    assert pools.calls == [] and applied == []


def test_a_failed_step_stops_the_rest_and_is_reported() -> None:
    pools = Pools(fail_on="add")
    steps = (Step(StepKind.ADD, Role.PREFILL), Step(StepKind.REMOVE, None, "decode-1",
                                                    Role.DECODE))
    (applied,) = _run(PlannerMode.ON, _decision(*steps), pools)
    assert pools.calls == [("add", "prefill")]
    assert len(applied) == 1 and not applied[0].ok and "no room" in applied[0].detail


def test_no_change_reports_the_decision_and_calls_nothing() -> None:
    pools = Pools()
    assert _run(PlannerMode.ON, _decision(), pools) == [[]] and pools.calls == []


