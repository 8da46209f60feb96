"""Fault injection's vocabulary: which faults a worker can arm and at which points of its
loop they fire (armed by the InjectFault message, fired in cluster/worker/faults.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from splitserve.errors import InvalidRequestError

# Fault injection: faults a worker arms on request and fires at named points of its loop,
# so tests, the chaos test and the soak benchmark can break the cluster on purpose.
#
# Off by default: a worker started without `fault_injection` refuses to arm anything, and
# the frontend's admin endpoint (`POST /admin/faults`) answers 403 unless the server was
# started with `--enable-fault-injection`.
#
#     kind            where it fires (point)                      what happens
#     kill            generate | prefill | first_token | decode   the worker process dies (SIGKILL)
#                     | now
#     error           generate | prefill                          the request fails on the worker
#     raise           generate | prefill | first_token | decode   the worker's code for the request
#                                                                 raises (an unexpected bug): the
#                                                                 request fails, the worker lives
#     stall           decode | now                                the loop sleeps `seconds`: no
#                                                                 heartbeat, no output (a partition)
#     drop_kv         transfer                                    the KV is never sent
#     corrupt_kv      transfer                                    one byte of the KV flips on
#                                                                 the wire
#     delay_kv        transfer                                    the send starts `seconds` late
#     drop_kv_events  events                                      KV events are lost (no seq gap)
#     forget_cache    now                                         the prefix cache is emptied and
#                                                                 the events of it are lost
#
# `after` skips that many hits of the point before the fault can fire; `count` is how many
# times it fires (0: every time); `probability` draws from a generator seeded by `seed`, so
# a chaos run replays exactly.

POINTS: dict[str, tuple[str, ...]] = {
    "kill": ("generate", "prefill", "first_token", "decode", "now"),
    "error": ("generate", "prefill"),
    "raise": ("generate", "prefill", "first_token", "decode"),
    "stall": ("decode", "now"),
    "drop_kv": ("transfer",),
    "corrupt_kv": ("transfer",),
    "delay_kv": ("transfer",),
    "drop_kv_events": ("events",),
    "forget_cache": ("now",),
}


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    point: str = ""  # "" = the kind's first point
    after: int = 0
    count: int = 1
    probability: float = 1.0
    seed: int = 0
    seconds: float = 0.0  # stall and delay_kv

    def __post_init__(self) -> None:
        if self.kind not in POINTS:
            raise InvalidRequestError(f"fault kind {self.kind!r} is not one of "
                                      f"{', '.join(POINTS)}", field="kind")
        if not self.point:
            object.__setattr__(self, "point", POINTS[self.kind][0])
        if self.point not in POINTS[self.kind]:
            raise InvalidRequestError(f"a {self.kind} fault fires at "
                                      f"{' | '.join(POINTS[self.kind])}, not {self.point!r}",
                                      field="point")
        if self.after < 0 or self.count < 0:
            raise InvalidRequestError("after and count must be >= 0", field="after")
        if not 0.0 < self.probability <= 1.0:
            raise InvalidRequestError("probability must be in (0, 1]", field="probability")
        if not 0.0 <= self.seconds <= 600.0:
            raise InvalidRequestError("seconds must be in [0, 600]", field="seconds")

    @staticmethod
    def from_dict(data: dict[str, Any]) -> FaultSpec:
        """From an operator's JSON (POST /admin/faults)."""
        known = {f.name for f in fields(FaultSpec)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown fault fields {unknown}; known: {sorted(known)}",
                                      field=unknown[0])
        try:
            return FaultSpec(**data)
        except TypeError as exc:
            raise InvalidRequestError(f"bad fault: {exc}", field="kind") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
