"""The workers a ServeConfig asks for: one WorkerSpec each (role, cores, threads, engine
arguments, store options), and the key their disk tiers derive tenant keys from.

With --prefill-borrows-cores (ServeConfig.prefill_borrows_cores, on by default) a prefill
worker of a disaggregated layout on this machine's cores borrows the decode pool's: a
helper thread on each core of its round-robin share of them, at nice 19, takes tasks of
its ops while the decode worker there has nothing to step (cluster/worker/lending.py,
model/kernels/csrc/helpers.h). Measured on a Zen 4, 2 cores, a 1,549-token prefill:
1.23 s with the decode core idle against 2.49 s on one core. (Its first form, a team
member on the lent core, was preempted inside its tasks by every decode step and held the
team at each op's barrier: TTFT 1.85x the unborrowed one at one decoding stream, 4.4x at
16; docs/benchmarks.md, "TTFT under decode load", 2026-11-30.)"""
from __future__ import annotations

import logging
import os
import secrets
from typing import Any

from splitserve.cluster.auth import STORE_KEY_BYTES
from splitserve.cluster.protocol import Role
from splitserve.cluster.runtime import split_cores
from splitserve.cluster.worker.lending import lease_path
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import KVStoreConfig, ServeConfig

logger = logging.getLogger(__name__)


def worker_specs(config: ServeConfig, frontend_address: str) -> list[WorkerSpec]:
    """One spec per worker: prefill workers first, then decode (or `both` in agg mode),
    each pinned to its share of this process's cores unless `worker_cores` says otherwise."""
    assert config.mode != "auto", "resolve_layout first (cluster/planner/auto_layout.py)"
    num_prefill, num_decode = config.pool_sizes
    pools = ([(Role.PREFILL, num_prefill), (Role.DECODE, num_decode)]
             if config.mode == "disagg" else [(Role.BOTH, num_decode)])
    if config.worker_cores is not None:
        flat = [tuple(c) for c in config.worker_cores]
        if len(flat) != sum(n for _, n in pools):
            raise ValueError(f"worker_cores lists {len(flat)} core sets for "
                             f"{sum(n for _, n in pools)} workers")
        cores, pos = [], 0
        for _, n in pools:
            cores.append(flat[pos:pos + n])
            pos += n
    else:
        cores = split_cores(sorted(os.sched_getaffinity(0)), [n for _, n in pools])
    threads = config.threads_per_worker
    if threads is None and config.planner == "on":
        # Workers the planner adds share these cores: size every worker's threads for
        # the whole budget now, or the added ones oversubscribe the cores (launcher
        # `_thread_share`).
        available = len(os.sched_getaffinity(0))
        threads = max(1, available // (config.planner_max_workers or available))
    borrowed: list[tuple[int, ...]] = [()] * num_prefill
    if (config.mode == "disagg" and config.prefill_borrows_cores and threads is None
            and config.worker_cores is None and config.runtime == "local" and num_prefill):
        borrowed = lend_cores(cores[0], cores[1])
    tag = f"splitserve-{os.getpid()}-{secrets.token_hex(4)}"  # this server's lease files
    lent = {c for share in borrowed for c in share}
    # An idle worker's heartbeat: often enough that a few lost ones do not kill it.
    heartbeat_s = min(1.0, config.deadlines.heartbeat_timeout_s / 4)
    specs = []
    for (role, n), pool_cores in zip(pools, cores):
        for index in range(n):
            engine_args = dict(config.engine_args())
            if threads:
                engine_args["num_threads"] = threads
            mine = pool_cores[index]
            helped = borrowed[index] if role is Role.PREFILL else ()
            leases = tuple(lease_path(tag, c) for c in (helped if role is Role.PREFILL
                                                      else [c for c in mine if c in lent]))
            if helped:
                logger.info("prefill-%d borrows the decode workers' cores %s", index, helped)
            paced = config.decode_pace_s if leases and role is not Role.PREFILL else None
            specs.append(WorkerSpec(role=role, index=index, epoch=1,
                                    frontend_address=frontend_address, engine_args=engine_args,
                                    cpu_cores=mine or None, nice=config.worker_nice,
                                    borrowed_cores=helped, leases=leases, pace_s=paced,
                                    kv_transport=config.kv_transport,
                                    kv_stream_layers=config.kv_stream_layers,
                                    fault_injection=config.enable_fault_injection,
                                    heartbeat_interval_s=heartbeat_s,
                                    store=store_options(config.store, f"{role.value}-{index}")))
    return specs


def lend_cores(prefill: list[tuple[int, ...]], decode: list[tuple[int, ...]]
               ) -> list[tuple[int, ...]]:
    """The decode workers' cores each prefill worker borrows: round-robin, each core lent
    to one, none that a prefill worker has already."""
    owned = {c for own in prefill for c in own}
    spare = sorted({c for own in decode for c in own} - owned)
    return [tuple(spare[i::len(prefill)]) for i in range(len(prefill))]


def store_options(config: KVStoreConfig, worker_id: str) -> dict[str, Any]:
    """The worker's StoreConfig keys (store/config.py): its own disk directory under
    `kv_disk_dir`, which a restarted worker of the same id finds again (starts warm)."""
    if not config.enabled:
        return {}
    options: dict[str, Any] = {"host_bytes": config.kv_host_bytes,
                               "disk_admission": config.kv_disk_admission,
                               "tenant_quota_bytes": config.kv_tenant_quota_bytes}
    if config.kv_disk_dir is not None:
        options.update(disk_dir=os.path.join(config.kv_disk_dir, worker_id),
                       disk_bytes=config.kv_disk_bytes)
    return options


def store_key(config: KVStoreConfig) -> bytes:
    """The key every worker's disk tier derives its tenants' keys from: the key file's
    (32 bytes, raw or hex), else a fresh one (disk blocks of earlier starts unreadable)."""
    if config.kv_disk_dir is None:
        return b""
    if config.kv_disk_key_file is None:
        return os.urandom(STORE_KEY_BYTES)
    with open(config.kv_disk_key_file, "rb") as f:
        data = f.read(4 * STORE_KEY_BYTES + 2)
    if len(data.strip()) == 2 * STORE_KEY_BYTES:
        try:
            return bytes.fromhex(data.strip().decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    if len(data) == STORE_KEY_BYTES:
        return data
    raise ValueError(f"{config.kv_disk_key_file} must hold a {STORE_KEY_BYTES}-byte key, raw "
                     f"or as {2 * STORE_KEY_BYTES} hex digits (e.g. `openssl rand -hex 32`)")
