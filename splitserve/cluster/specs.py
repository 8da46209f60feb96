"""The workers a ServeConfig asks for: one WorkerSpec each (role, cores, threads, engine
arguments, store options), and the key their disk tiers derive tenant keys from."""
from __future__ import annotations

import os
from typing import Any

from splitserve.cluster.auth import STORE_KEY_BYTES
from splitserve.cluster.protocol import Role
from splitserve.cluster.runtime import split_cores
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import KVStoreConfig, ServeConfig


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
    # An idle worker's heartbeat: often enough that a few lost ones do not kill it.
    heartbeat_s = min(1.0, config.deadlines.heartbeat_timeout_s / 4)
    specs = []
    for (role, n), pool_cores in zip(pools, cores):
        for index in range(n):
            engine_args = dict(config.engine_args())
            if threads:
                engine_args["num_threads"] = threads
            specs.append(WorkerSpec(role=role, index=index, epoch=1,
                                    frontend_address=frontend_address, engine_args=engine_args,
                                    cpu_cores=pool_cores[index] or None,
                                    nice=config.worker_nice,
                                    kv_transport=config.kv_transport,
                                    fault_injection=config.enable_fault_injection,
                                    heartbeat_interval_s=heartbeat_s,
                                    store=store_options(config.store, f"{role.value}-{index}")))
    return specs


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
