"""The planner: SLO-driven pool sizes and layout (pure logic; see planner.py)."""
from __future__ import annotations

from splitserve.cluster.planner.model import (Decision, Layout, Observation, PlannerConfig,
                                              Step, StepKind, WorkerSample)
from splitserve.cluster.planner.planner import Planner
from splitserve.cluster.planner.steps import check_budget, plan_steps

__all__ = ["Decision", "Layout", "Observation", "Planner", "PlannerConfig", "Step",
           "StepKind", "WorkerSample", "check_budget", "plan_steps"]
