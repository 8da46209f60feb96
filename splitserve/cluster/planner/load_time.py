"""How long a worker takes from being started to serving (registered with the frontend),
as the planner uses it: measured on this cluster's own starts (process spawn, imports,
weights, warm-up), unless an operator fixed it (`--planner-model-load-s`).

The planner sizes growth for the load one model load ahead and treats a worker
registered less than a model load ago as warming, so a guess that is far off either way
makes it scale late or trust cold capacity: a measurement beats a fixed default.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

DEFAULT_MODEL_LOAD_S = 30.0  # before any worker was measured
NUM_KEPT = 16  # the most recent starts; older ones describe a machine that changed


class LoadTimeSource(str, Enum):
    """Where the model-load time the planner uses comes from. Values are reported."""
    FLAG = "flag"  # --planner-model-load-s, an operator's override
    MEASURED = "measured"  # the median of this cluster's measured starts
    DEFAULT = "default"  # nothing measured yet


@dataclass(frozen=True)
class ModelLoad:
    seconds: float
    source: LoadTimeSource
    num_samples: int  # starts measured so far (kept ones)

    def to_dict(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 3), "source": self.source.value,
                "samples": self.num_samples}


def model_load_estimate(samples: list[float], override: float | None,
                        default: float = DEFAULT_MODEL_LOAD_S) -> ModelLoad:
    """The override when given, else the median of `samples` (robust to one start slowed
    by a busy machine), else `default`."""
    if override is not None:
        return ModelLoad(override, LoadTimeSource.FLAG, len(samples))
    if samples:
        return ModelLoad(statistics.median(samples), LoadTimeSource.MEASURED, len(samples))
    return ModelLoad(default, LoadTimeSource.DEFAULT, 0)


@dataclass
class LoadTimes:
    """Start-to-registered durations of the workers a cluster started, keyed by worker
    identity (one per incarnation, so a restart is a new start). Times are monotonic
    seconds; a worker that never registers is never counted."""
    pending: dict[bytes, float] = field(default_factory=dict)  # identity -> started at
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=NUM_KEPT))

    def started(self, identity: bytes, at: float) -> None:
        self.pending[identity] = at

    def registered(self, identity: bytes, at: float) -> float | None:
        """Records the start of `identity` that registered `at`; its duration, or None
        when it was not started here (adopted, a role switch) or already counted."""
        start = self.pending.pop(identity, None)
        if start is None:
            return None
        duration = max(0.0, at - start)
        self.samples.append(duration)
        return duration

    def forget(self, identity: bytes) -> None:
        """A start that will never register (stopped or exited first)."""
        self.pending.pop(identity, None)

    def estimate(self, override: float | None,
                 default: float = DEFAULT_MODEL_LOAD_S) -> ModelLoad:
        return model_load_estimate(list(self.samples), override, default)
