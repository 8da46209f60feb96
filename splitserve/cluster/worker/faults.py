"""A worker's armed faults (what the frontend's InjectFault asked for, protocol.FaultSpec)
and where they fire in its loop. Off unless the worker was started with fault injection."""
from __future__ import annotations

import random

from splitserve.cluster.protocol import FaultSpec
from splitserve.errors import InvalidRequestError


class _Armed:
    __slots__ = ("spec", "hits", "fired", "rng")

    def __init__(self, spec: FaultSpec) -> None:
        self.spec, self.hits, self.fired = spec, 0, 0
        self.rng = random.Random(spec.seed)

    def take(self) -> bool:
        self.hits += 1
        if self.hits <= self.spec.after or self.rng.random() >= self.spec.probability:
            return False
        self.fired += 1
        return True

    @property
    def spent(self) -> bool:
        return bool(self.spec.count) and self.fired >= self.spec.count


class FaultInjector:
    """A worker's armed faults; `fire(point)` is called where the point is reached."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._armed: list[_Armed] = []

    def arm(self, spec: FaultSpec) -> None:
        if not self.enabled:
            raise InvalidRequestError("fault injection is disabled on this worker; start the "
                                      "server with --enable-fault-injection", field="kind")
        self._armed.append(_Armed(spec))

    def fire(self, point: str) -> FaultSpec | None:
        """The fault that fires at this hit of `point`, if any (at most one per hit)."""
        if not self._armed:
            return None
        for armed in self._armed:
            if armed.spec.point == point and armed.take():
                if armed.spent:
                    self._armed.remove(armed)
                return armed.spec
        return None
