"""Hostile HTTP input against a real cluster (issue 16): the hand-made attacks and
schemathesis fuzzing of every operation in /openapi.json (benchmarks/hostile_input.py,
fewer examples), then: no 5xx, no transport error, no worker exit, no leaked block."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import hostile_input  # noqa: E402

EXAMPLES = 25  # per operation and generation mode


def test_hostile_and_fuzzed_http_gets_no_5xx_and_loses_nothing(start_server: Any) -> None:
    server = start_server(*hostile_input.SERVER_FLAGS)
    out = hostile_input.attack_server(
        server, EXAMPLES, pids=server.worker_pids,
        pools=lambda: server.get_json("/admin/pools")["workers"])
    tally = out.tally
    assert tally.num_inputs >= len(hostile_input.crafted("m")) + 2 * EXAMPLES
    assert not tally.server_errors, "\n".join(tally.server_errors)
    assert not tally.transport_errors, "\n".join(tally.transport_errors)
    assert out.worker_exits == 0, server.log()
    assert out.leaked_blocks == 0 and out.pools_ok
    # The valid requests were served, not all refused: fuzzing reached the workers.
    assert tally.statuses[200] > 0
