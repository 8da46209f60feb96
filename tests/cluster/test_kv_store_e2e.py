"""The KV store below a worker's pool, as users run it (`splitserve serve --kv-host-bytes
... --kv-disk-dir ...`, the openai client, bf16): a prefix evicted from the pool comes back
from the host tier, then from disk once the host tier evicted it, then from disk after the
worker was killed and restarted; a corrupted disk block is recomputed; each time the text
is the cold run's and `cached_tokens` says what was reused. Another tenant never hits
the first's blocks; quotas hold; a purge empties every tier of the tenant."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from openai import OpenAI

BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2-135M, bf16, 16-token blocks
PROMPT_TOKENS = 160  # 10 blocks; 9 can be hit (one token is always computed)
HIT_TOKENS = 144


def _prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(PROMPT_TOKENS)]


def _tier_counter(server: Any, name: str, tier: str) -> float:
    """splitserve_kv_tier_<name>_total of `tier`, over every worker."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.get_text("/metrics").splitlines()
               if line.startswith(f"splitserve_kv_tier_{name}_total{{")
               and f'tier="{tier}"' in line)


def _wait_counter(server: Any, name: str, tier: str, at_least: float) -> float:
    """The counter once it reached `at_least` (load reports come every 0.1 s)."""
    deadline = time.monotonic() + 5.0
    while (value := _tier_counter(server, name, tier)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _completer(server: Any, timeout_s: float = 300) -> Callable[..., tuple[str, int]]:
    """run(prompt, max_tokens=8, tenant=None): a greedy completion through the openai
    client; its text and `cached_tokens`."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                    timeout=timeout_s)
    model = client.models.list().data[0].id

    def run(prompt: list[int], max_tokens: int = 8, tenant: str | None = None
            ) -> tuple[str, int]:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Tenant": tenant} if tenant is not None else None)
        details = out.usage.prompt_tokens_details if out.usage else None
        return str(out.choices[0].text), int(details.cached_tokens or 0) if details else 0
    return run


def _worker_hits(server: Any, worker: str) -> float:
    """splitserve_kv_tier_hits_total of one worker, over its tiers."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.get_text("/metrics").splitlines()
               if line.startswith("splitserve_kv_tier_hits_total{")
               and f'worker="{worker}"' in line)


def _wait_restarted(server: Any, old_pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = server.workers()
        if workers and all(w["healthy"] and w["pid"] != old_pid for w in workers):
            return
        time.sleep(0.3)
    raise AssertionError(f"the worker was not restarted: {server.log()}")


def test_blocks_come_back_from_host_then_disk_then_after_a_restart(
        start_server: Any, tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    quota = 60 * BLOCK_BYTES  # binds on disk (200 blocks), not in the 48-block host tier
    server = start_server(
        "--mode", "agg", "--decode", "1", "--max-model-len", "384",
        "--kv-cache-memory-bytes", str(24 * BLOCK_BYTES),
        "--kv-host-bytes", str(48 * BLOCK_BYTES), "--kv-disk-dir", str(disk),
        "--kv-disk-bytes", str(200 * BLOCK_BYTES), "--kv-disk-admission", "all",
        "--kv-tenant-quota-bytes", str(quota), "--enable-prompt-tokens-details",
        "--enable-fault-injection")  # a worker is killed on purpose below
    complete = _completer(server, 120)

    def run(prompt: list[int], tenant: str) -> tuple[str, int]:
        return complete(prompt, tenant=tenant)

    def churn(first: int, n: int) -> None:
        """Other prompts of another tenant, enough to push earlier blocks down a tier."""
        for seed in range(first, first + n):
            run(_prompt(seed), "filler")

    a, b = _prompt(1), _prompt(2)
    cold_a, cached = run(a, "alice")
    assert cached == 0
    cold_b, _ = run(b, "alice")

    churn(100, 4)  # a and b leave the 24-block pool for the 48-block host tier
    assert run(a, "alice") == (cold_a, HIT_TOKENS)
    assert _wait_counter(server, "hits", "host", 9) == 9

    churn(200, 8)  # ~80 more blocks through the host tier: a and b are on disk only
    hits = {t: _tier_counter(server, "hits", t) for t in ("host", "disk")}
    read = _tier_counter(server, "read_bytes", "disk")
    assert run(a, "alice") == (cold_a, HIT_TOKENS)
    # Every block came off the disk: straight into the pool, or first into the host tier
    # by the prefetch that starts when the request arrives.
    assert (_wait_counter(server, "read_bytes", "disk", read + 9 * BLOCK_BYTES)
            >= read + 9 * BLOCK_BYTES)
    assert _wait_for(lambda: sum(_tier_counter(server, "hits", t) - hits[t]
                                 for t in ("host", "disk")) == 9)

    # Another tenant sends a's prompt: no tier gives it a's blocks.
    assert run(a, "bob") == (cold_a, 0)

    # Quotas held in every tier (the filler tenant wrote the most).
    usage = server.get_json("/admin/tenants/filler/cache")
    assert usage["bytes"]["disk"] > 0
    assert all(0 < used <= quota for used in usage["bytes"].values()), usage

    # Restart: the worker comes back with an empty pool and host tier; its disk tier is
    # rebuilt from the directory, so a is served warm from disk.
    pid = server.worker_pids()[0]
    os.kill(pid, signal.SIGKILL)
    _wait_restarted(server, pid)
    assert run(a, "alice") == (cold_a, HIT_TOKENS)

    # A corrupted disk block is detected (its authentication fails) and recomputed: flip a
    # payload byte of every block file, then b (only on disk) is computed again, exactly.
    files = [p for p in disk.rglob("*") if p.is_file() and p.stat().st_size > BLOCK_BYTES]
    assert files, list(disk.rglob("*"))
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    assert run(b, "alice") == (cold_b, 0)
    assert _wait_counter(server, "corrupt", "disk", 1) >= 1

    # Purge: alice's blocks leave every tier of every worker; nothing of hers is reused.
    purged = server.delete_json("/admin/tenants/alice/cache")
    assert sum(t["blocks"] for t in purged["removed"].values()) > 0, purged
    time.sleep(1.0)  # the next load report carries the tiers' use after the purge
    usage = server.get_json("/admin/tenants/alice/cache")
    assert not any(usage["bytes"].values()), usage
    assert run(a, "alice") == (cold_a, 0)
    assert server.get_json("/admin/pools")["workers"]["both-0"]["ok"]


def test_the_router_sends_a_prefix_to_the_worker_holding_it_below_its_pool(
        start_server: Any) -> None:
    """Two colocated workers. a is computed on one (the other is busy with a long stream)
    and pushed out of its pool into its host tier. Once both are idle again, a tie would
    go to the other (the tie-breaker's): the tier index (TierEventBatch) sends a to the
    one holding it, which brings it up from its host tier."""
    server = start_server(
        "--mode", "agg", "--decode", "2", "--max-model-len", "384",
        "--kv-cache-memory-bytes", str(24 * BLOCK_BYTES),
        "--kv-host-bytes", str(64 * BLOCK_BYTES), "--enable-prompt-tokens-details")
    run = _completer(server)

    def hits(worker: str) -> float:
        return _worker_hits(server, worker)

    # The busy stream's 240-token prompt holds 15 of its worker's 24 blocks, so none of the
    # 10-block prompts below fits there: they all go to the other worker. (Where both fit,
    # the router spreads them over both, and the holder's share once fell short of pushing
    # a out of its pool.) Paused (well inside the 30 s heartbeat timeout), the busy worker
    # cannot end its stream, and free its blocks, before they are placed, however slow the
    # machine.
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    decoding = threading.Event()

    def stream() -> None:
        for _ in client.completions.create(
                model=model, prompt=_prompt(50) + _prompt(51)[:80], max_tokens=140,
                temperature=0, stream=True, extra_body={"ignore_eos": True}):
            decoding.set()
    busy = threading.Thread(target=stream)
    busy.start()  # on an idle cluster: the tie-breaker's worker (the first registered)
    assert decoding.wait(60), server.log()
    busy_on = [w for w in server.workers() if w["requests"]]
    assert len(busy_on) == 1, busy_on
    holder = next(w["id"] for w in server.workers() if w["id"] != busy_on[0]["id"])
    a = _prompt(1)
    os.kill(int(busy_on[0]["pid"]), signal.SIGSTOP)
    try:
        cold, _ = run(a)
        for seed in range(300, 304):  # a leaves the holder's pool
            run(_prompt(seed))
    finally:
        os.kill(int(busy_on[0]["pid"]), signal.SIGCONT)
    busy.join(300)
    assert not busy.is_alive()
    health = server.get_json("/admin/health")
    assert health["index"]["tiers"][holder]["host"] >= 9, health["index"]
    # Both idle: the router counts a's blocks in the holder's host tier and sends it there.
    assert run(a) == (cold, HIT_TOKENS)
    assert server.get_json("/admin/health")["index"]["routed_tier_blocks"] == 9
    assert _wait_for(lambda: hits(holder) >= 9), (hits(holder), hits(busy_on[0]["id"]))
    assert hits(busy_on[0]["id"]) == 0


def _wait_for(check: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_prefill_workers_tier_serves_the_decode_worker_over_the_wire(
        start_server: Any) -> None:
    """Disaggregated (every prompt prefilled on prefill-0): a's blocks go from
    prefill-0's pool to its host tier; the next request with a's prompt is prefilled from
    there and its KV crosses to decode-0, which never held any of it. The text is the cold
    run's (a's prompt under another tenant, computed from scratch)."""
    server = start_server(
        "--mode", "disagg", "--prefill", "1", "--decode", "1", "--disagg-policy", "always",
        "--max-model-len", "384", "--kv-cache-memory-bytes", str(24 * BLOCK_BYTES),
        "--kv-host-bytes", str(48 * BLOCK_BYTES), "--enable-prompt-tokens-details")
    complete = _completer(server, 120)

    def run(prompt: list[int], tenant: str, max_tokens: int) -> tuple[str, int]:
        return complete(prompt, max_tokens, tenant)

    def hits(worker: str) -> float:
        return _worker_hits(server, worker)

    a = _prompt(1)
    cold, _ = run(a, "reference", 8)
    run(a, "alice", 1)  # one token: the request ends on prefill-0, nothing is sent
    for seed in range(400, 404):  # prefill-0's pool only: a goes to its host tier
        run(_prompt(seed), "filler", 1)
    assert run(a, "alice", 8) == (cold, HIT_TOKENS)
    assert _wait_for(lambda: hits("prefill-0") >= 9), hits("prefill-0")
    assert hits("decode-0") == 0


def _peer_fetches(server: Any, outcome: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.get_text("/metrics").splitlines()
               if line.startswith("splitserve_kv_peer_fetches_total{")
               and f'outcome="{outcome}"' in line)


def test_a_busy_workers_host_tier_serves_its_peer(start_server: Any) -> None:
    """Two colocated workers of one sequence each (`--max-num-seqs 1`): b is computed on Q
    while P streams, then pushed out of Q's pool into its host tier. Later Q streams (its
    prompt hits Q's cache, so it goes there) and b must go to P: P imports b's prefix from
    Q's host tier over the transfer layer (Q holds it without computing, between two of
    its steps) and prefills only the last block. Same text as the cold run, 144 cached
    tokens, the fetch in the metrics, while Q's stream goes on (bf16, concurrent)."""
    server = start_server(
        "--mode", "agg", "--decode", "2", "--max-num-seqs", "1", "--max-model-len", "384",
        "--kv-cache-memory-bytes", str(24 * BLOCK_BYTES),
        "--kv-host-bytes", str(64 * BLOCK_BYTES), "--enable-prompt-tokens-details")
    run = _completer(server)

    def hits(worker: str) -> float:
        return _worker_hits(server, worker)

    def stream_on(prompt: list[int], not_on: str | None = None) -> tuple[threading.Thread, str]:
        """A long stream in the background; the worker it runs on."""
        thread = threading.Thread(target=run, args=(prompt, 300), daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not (busy := [w["id"] for w in server.workers()
                            if w["requests"] and w["id"] != not_on]):
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        return thread, busy[0]

    b, key = _prompt(7), _prompt(60)[:40]  # key: Q's stream later (2 blocks to hit)
    first, p = stream_on(_prompt(61)[:16])
    cold, _ = run(b)  # P has no room: b goes to Q
    run(key, 1)
    for seed in range(500, 504):  # Q's pool only (P still streams): b to Q's host tier
        run(_prompt(seed), 1)
    q = next(w["id"] for w in server.workers() if w["id"] != p)
    first.join(300)
    assert not first.is_alive()
    health = server.get_json("/admin/health")
    assert health["index"]["tiers"][q]["host"] >= 9, health["index"]
    q_hits = hits(q)
    second, busy = stream_on(key)  # key hits Q's cache: Q streams
    assert busy == q, (busy, q)
    assert run(b) == (cold, HIT_TOKENS)  # on P, b's first 9 blocks from Q's host tier
    second.join(300)
    assert not second.is_alive()
    assert _peer_fetches(server, "committed") == 1, server.get_text("/metrics")
    assert server.get_json("/admin/health")["index"]["routed_peer_fetches"] == 1
    assert _wait_for(lambda: hits(q) >= q_hits + 9), (hits(q), q_hits)
    assert hits(p) == 0  # P brought nothing up from its own tiers
