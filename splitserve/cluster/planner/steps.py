"""From the current workers to target counts per role: which workers switch roles, which
are drained, how many start, and in what order so the budget holds after every step."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitserve.cluster.planner.model import Step, StepKind, WorkerSample
from splitserve.cluster.protocol import Role

# For a role that is short, which surplus roles to switch from, best first: a decode
# worker becoming colocated (or back) keeps its running sequences; a prefill worker
# holds none for long.
_SWITCH_FROM = {
    Role.DECODE: (Role.BOTH, Role.PREFILL),
    Role.BOTH: (Role.DECODE, Role.PREFILL),
    Role.PREFILL: (Role.BOTH, Role.DECODE),
}
# Short roles are filled in this order: decode capacity first (it holds sequences).
_FILL_ORDER = (Role.DECODE, Role.BOTH, Role.PREFILL)


def _cheapest_first(workers: Sequence[WorkerSample]) -> list[WorkerSample]:
    """Warming workers (nothing to drain) first, then the least loaded; ids break ties so
    plans are deterministic."""
    return sorted(workers, key=lambda w: (not w.warming, w.num_running + w.num_waiting,
                                          w.worker_id))


def plan_steps(workers: Sequence[WorkerSample], target: Mapping[Role, int], budget: int,
               allow_switch: bool) -> list[Step]:
    """Steps from `workers` to `target` counts per role (roles not named: 0).

    Surplus workers of one role switch to a short role when allowed (no weights
    reloaded), the rest are removed, and the remaining shortfall is added. When the adds
    fit in the budget beside every current worker they go first (capacity arrives before
    any leaves); otherwise removals go first. Switches never change the total.
    """
    surplus: dict[Role, list[WorkerSample]] = {}
    short: dict[Role, int] = {}
    for role in Role:
        members = [w for w in workers if w.role is role]
        delta = target.get(role, 0) - len(members)
        if delta < 0:
            surplus[role] = _cheapest_first(members)[:-delta]
        elif delta > 0:
            short[role] = delta

    switches: list[Step] = []
    if allow_switch:
        for role in _FILL_ORDER:
            for source in _SWITCH_FROM[role]:
                while short.get(role, 0) > 0 and surplus.get(source):
                    worker = surplus[source].pop(0)
                    switches.append(Step(StepKind.SWITCH, role, worker.worker_id, source))
                    short[role] -= 1
    removals = [Step(StepKind.REMOVE, None, w.worker_id, w.role)
                for role in Role for w in surplus.get(role, [])]
    adds = [Step(StepKind.ADD, role) for role in _FILL_ORDER for _ in range(short.get(role, 0))]
    if len(workers) + len(adds) <= budget:
        return adds + switches + removals
    return removals + switches + adds


def check_budget(num_workers: int, steps: Sequence[Step], budget: int) -> bool:
    """True when the worker count stays within `budget` after every step."""
    for step in steps:
        num_workers += {StepKind.ADD: 1, StepKind.REMOVE: -1}.get(step.kind, 0)
        if num_workers > budget:
            return False
    return True
