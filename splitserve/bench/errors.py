"""The bench's setup error: the run could not start (server unreachable, bad trace file,
probe request refused). Failed requests during a run are data, never this."""
from __future__ import annotations

from splitserve.errors import SplitserveError


class BenchSetupError(SplitserveError):
    """`splitserve bench` cannot run; the message says what to fix."""
