"""Helpers for the fault tests: arm faults through the admin endpoint, wait for the
cluster to heal, read counters, check every pool, and the offline reference.

Servers run the default dtype (bfloat16) with the exact (batch-invariant) CPU kernels, so a
request retried, re-prefilled or migrated to another worker mid-stream still produces the
offline engine's output bit for bit, whatever it was batched with and whatever the threads."""
from __future__ import annotations

import re
import time
from typing import Any

import openai

FLAGS = ("--threads-per-worker", "1", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(256 << 20), "--enable-fault-injection")


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=180)


def model(server: Any) -> str:
    return str(client(server).models.list().data[0].id)


def arm(server: Any, worker: str, **spec: Any) -> dict[str, Any]:
    return dict(server.post_json("/admin/faults", {"worker": worker, **spec}))


def metric(server: Any, name: str, **labels: str) -> float:
    """Sum of a counter's samples whose labels include `labels`."""
    total = 0.0
    for line in server.get_text("/metrics").splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_healthy(server: Any, num_workers: int, timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """Until `num_workers` workers are registered and healthy (restarts included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = server.workers()
        if len(workers) == num_workers and all(w["healthy"] for w in workers):
            return list(workers)
        assert time.monotonic() < deadline, f"cluster did not heal: {workers}\n{server.log()}"
        time.sleep(0.3)


def assert_pools_clean(server: Any, num_workers: int, timeout_s: float = 60.0) -> None:
    """Once traffic stopped: every worker's pool passes check_invariants() and holds no
    block and no request (nothing leaked by the faults)."""
    wait_healthy(server, num_workers)
    deadline = time.monotonic() + timeout_s
    while True:
        pools = server.get_json("/admin/pools")["workers"]
        if len(pools) == num_workers and all(
                p["ok"] and p["used_blocks"] == 0 and p["requests"] == 0 for p in pools.values()):
            assert server.get_json("/health")["in_flight"] == 0
            return
        assert all(p["ok"] or "no answer" in str(p["error"]) for p in pools.values()), pools
        assert time.monotonic() < deadline, f"pools not clean: {pools}"
        time.sleep(0.3)


def worker_holding_a_request(server: Any, role: str) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for w in server.workers():
            if w["role"] == role and w["requests"] > 0:
                return str(w["id"])
        time.sleep(0.02)
    raise AssertionError(f"no {role} worker holds a request")
