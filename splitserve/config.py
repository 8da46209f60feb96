"""Frozen configuration dataclasses: one place for every engine knob."""
from __future__ import annotations

import math

from dataclasses import dataclass, field

# A pacing decode worker's step interval as a share of the TPOT target (ServeConfig.
# pace_decode): the rest is the margin for what else a token's time holds (a KV handover,
# a late step, the frontend).
PACE_SHARE = 0.8


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks in the pool; None sizes it from `kv_cache_memory_bytes`.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 2")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Token budget of one engine step (prefill chunks + decodes).
    max_num_batched_tokens: int = 512
    # Prompts left unfinished by one step (chunked prefill), at most: a prompt shorter than
    # one in prefill shares the budget with it instead of waiting for all of it (equal
    # prompts never share). 1 = first come, first served (prompts that finish within the
    # step still join).
    max_num_partial_prefills: int = 2
    # A step's wall time, at most (engine/step_budget.py): its token budget is also what
    # the engine's measured speed fits in this; running decodes always get their token.
    # None: the token budget alone.
    max_step_ms: float | None = None
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive")
        if self.max_num_partial_prefills <= 0:
            raise ValueError(
                f"max_num_partial_prefills={self.max_num_partial_prefills} must be positive")
        if self.max_step_ms is not None and not (math.isfinite(self.max_step_ms)
                                                 and self.max_step_ms > 0):
            raise ValueError(f"max_step_ms={self.max_step_ms} must be positive (or None)")


@dataclass(frozen=True)
class EngineConfig:
    # A HF checkpoint directory, a .gguf file, or None for the default model.
    model: str | None = None
    # "auto" = bfloat16 on CPU and CUDA; "float32" for reference-exact math.
    dtype: str = "auto"
    # "auto" = CUDA when present, else CPU.
    device: str = "auto"
    # torch intra-op threads on CPU; None keeps torch's default.
    num_threads: int | None = None
    # None = weights in `dtype`; "int8" = weight-only int8 on the exact kernels (half the
    # bytes per decode step; batch-invariant; needs bf16 on an x86 CPU with AVX2).
    quantization: str | None = None
    # Batch-invariant ("exact") kernels: a token's KV, hidden states and logits are the same
    # bits in any batch, chunk, worker and thread count. None = on wherever they exist
    # (bfloat16 on an x86 CPU with AVX2); False = oneDNN/SDPA fast path (no quantization).
    batch_invariant: bool | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Check the block pool's invariants after every step (tests turn this on).
    debug_invariants: bool = False

    @staticmethod
    def from_kwargs(model: str | None = None, **kwargs: object) -> "EngineConfig":
        """Build from flat keyword arguments (`block_size=8, max_num_seqs=4, ...`)."""
        cache_keys = CacheConfig.__dataclass_fields__.keys()
        sched_keys = SchedulerConfig.__dataclass_fields__.keys()
        engine_keys = EngineConfig.__dataclass_fields__.keys() - {"cache", "scheduler", "model"}
        unknown = kwargs.keys() - cache_keys - sched_keys - engine_keys
        if unknown:
            known = sorted([*cache_keys, *sched_keys, *engine_keys])
            raise TypeError(f"unknown engine arguments {sorted(unknown)}; known: {known}")
        pick = lambda keys: {k: v for k, v in kwargs.items() if k in keys}  # noqa: E731
        return EngineConfig(model=model,
                            cache=CacheConfig(**pick(cache_keys)),  # type: ignore[arg-type]
                            scheduler=SchedulerConfig(**pick(sched_keys)),  # type: ignore[arg-type]
                            **pick(engine_keys))  # type: ignore[arg-type]


@dataclass(frozen=True)
class DeadlineConfig:
    """Every wait a request can make has a limit; the dispatcher's reaper enforces them."""
    request_timeout_s: float = 600.0  # arrival -> last token
    queue_timeout_s: float = 30.0  # waiting for admission
    prefill_timeout_s: float = 120.0  # dispatched -> first token
    kv_timeout_s: float = 60.0  # decode worker: reservation -> imported KV committed
    decode_step_timeout_s: float = 60.0  # longest gap between two streamed tokens
    heartbeat_timeout_s: float = 30.0  # a worker silent this long is dead
    worker_start_timeout_s: float = 600.0  # process start -> model loaded and registered

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")


@dataclass(frozen=True)
class HttpConfig:
    """The HTTP edge: who may call what, what a response tells, and how long and how many
    clients may hold the server (api/auth.py, api/http_protocol.py, README "Security")."""
    # /v1/* needs `Authorization: Bearer <key>`: one key (tenant "default") and/or a JSON
    # file {"<key>": "<tenant>", ...}; with keys the tenant (and cache namespace) comes
    # from the key. Neither: /v1/* is open and clients name their tenant.
    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    # /admin/* needs `Authorization: Bearer <admin key>`; None: /admin/* answers 403.
    admin_key: str | None = field(default=None, repr=False)
    # usage.prompt_tokens_details.cached_tokens (vLLM's flag): off, it is null, since it
    # tells a client how much of its prompt others of its namespace cached.
    enable_prompt_tokens_details: bool = False
    # Open connections (and requests in progress) beyond which a request gets 503;
    # uvicorn's limit. None: no limit.
    limit_concurrency: int | None = 1024
    # Idle keep-alive connections are closed after this long. uvicorn's default (5 s)
    # equals the idle expiry of httpx's pool (the `openai` client's), so a client could
    # reuse a connection at the moment the server closes it; the server outlasts its
    # clients' pools.
    timeout_keep_alive: int = 30
    # From the first byte of a request (or the connection's opening) to its last header
    # byte, and from then to its body's last byte; then 408 and the connection closes.
    header_timeout_s: float = 20.0
    body_timeout_s: float = 60.0
    # The largest request head (line + headers) h11 buffers (h11's default); past it 400.
    h11_max_incomplete_event_size: int = 16 * 1024

    def __post_init__(self) -> None:
        for name in ("timeout_keep_alive", "header_timeout_s", "body_timeout_s",
                     "h11_max_incomplete_event_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.limit_concurrency is not None and self.limit_concurrency < 2:
            raise ValueError(f"limit_concurrency={self.limit_concurrency} must be >= 2 "
                             "(uvicorn counts the connection asking)")
        for name in ("api_key", "admin_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} is empty; give a key or leave it out")


@dataclass(frozen=True)
class RayConfig:
    """`--runtime ray`: where the Ray cluster is and how workers are placed on it
    (cluster/runtime/ray.py, docs/operations.md). Unused by the local runtime."""
    ray_address: str | None = None  # "auto", "HOST:PORT"; None: RAY_ADDRESS, else a new local Ray
    # Workers live in the Ray namespace "splitserve-<name>"; a frontend started with the
    # name of one that died re-adopts its live workers.
    cluster_name: str = "default"
    ray_cpus_per_worker: float = 1.0  # Ray CPUs per worker actor (and its torch threads)
    ray_gpus_per_worker: float = 0.0
    # Each worker also asks for one unit of the custom resource named by its role
    # ("prefill", "decode", "both"): an operator dedicates a node to a pool by giving it
    # that resource (`ray start --resources '{"prefill": 2}'`).
    ray_role_resources: bool = False
    # "none": Ray places each worker by its resources; "pack": one placement group, as few
    # nodes as possible (KV stays on a node); "spread": one per pool, across nodes.
    ray_placement: str = "none"
    restart_backoff_s: float = 1.0  # first wait before restarting a dead worker; doubles to 30 s

    def __post_init__(self) -> None:
        if self.ray_placement not in ("none", "pack", "spread"):
            raise ValueError(f"ray_placement={self.ray_placement!r} must be none|pack|spread")
        if self.ray_cpus_per_worker <= 0 or self.ray_gpus_per_worker < 0:
            raise ValueError("ray_cpus_per_worker must be > 0 and ray_gpus_per_worker >= 0")
        if not self.cluster_name or not all(c.isalnum() or c in "-_" for c in self.cluster_name):
            raise ValueError(f"cluster_name={self.cluster_name!r}: letters, digits, - and _")
        if self.restart_backoff_s < 0:
            raise ValueError("restart_backoff_s must be >= 0")


@dataclass(frozen=True)
class KVStoreConfig:
    """The KV store's tiers below each worker's engine pool (splitserve/store/, DESIGN 6).
    Every tier is off by default; bytes are per worker."""
    kv_host_bytes: int = 0  # host memory tier; 0: off
    kv_disk_dir: str | None = None  # disk tier: each worker uses <dir>/<role>-<index>; None: off
    kv_disk_bytes: int = 8 << 30
    kv_disk_admission: str = "reused"  # "reused": only blocks hit at least once; "all"
    kv_tenant_quota_bytes: int | None = None  # per tenant, in every tier; None: no quota
    # 32-byte key (raw or hex) the disk tier's per-tenant keys derive from; None: a fresh
    # key per frontend start (a restarted worker starts warm, a new frontend cold).
    kv_disk_key_file: str | None = None
    # The router may have a worker import a prompt prefix another worker holds (pool or
    # tiers) when that is predicted faster than recomputing it (RouterConfig.peer_fetch).
    kv_peer_fetch: bool = True

    def __post_init__(self) -> None:
        if self.kv_host_bytes < 0 or self.kv_disk_bytes <= 0:
            raise ValueError("kv_host_bytes must be >= 0 and kv_disk_bytes > 0")
        if self.kv_disk_admission not in ("reused", "all"):
            raise ValueError(f"kv_disk_admission={self.kv_disk_admission!r} must be reused|all")
        if self.kv_tenant_quota_bytes is not None and self.kv_tenant_quota_bytes < 0:
            raise ValueError("kv_tenant_quota_bytes must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.kv_host_bytes > 0 or self.kv_disk_dir is not None


@dataclass(frozen=True)
class ServeConfig:
    """`splitserve serve`: the frontend, the router and the worker pools on one machine.
    Every key can come from a YAML file (same names, `-` or `_`) or a flag."""
    model: str | None = None
    served_model_name: str | None = None  # default: the model file's name
    # "auto": the layout measured to serve the most on this machine (cluster/planner/
    # auto_layout.py); "disagg": prefill and decode pools; "agg": colocated workers.
    mode: str = "auto"
    prefill: int | None = None  # prefill workers (disagg); None: 1, or auto's choice
    decode: int | None = None  # decode workers (disagg), workers (agg); None: 1, or auto's
    # --mode auto lays the machine out for requests of these mean prompt:output tokens,
    # and caches the cost curves it measures in this JSON file (None:
    # $SPLITSERVE_PROFILE_CACHE, else ~/.cache/splitserve/layout_profiles.json).
    workload_hint: str = "512:128"
    profile_cache: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    runtime: str = "local"  # "local" (child processes) | "ray" (Ray actors; `ray` group)
    # CPU cores per worker, e.g. [[0], [1]] (prefill workers first, then decode); None:
    # split this process's cores between the pools and pin each worker.
    worker_cores: list[list[int]] | None = None
    threads_per_worker: int | None = None  # None: one per pinned core
    # Local workers run this much nicer than the frontend, so on shared cores the frontend
    # (and a client on the machine) preempt a worker's compute threads when they wake
    # instead of waiting out a time slice: a token reaches the client sooner. 0: as nice.
    worker_nice: int = 5
    # disagg on this machine's cores: each prefill worker also runs a helper thread on
    # each core of its share of the decode pool's, at nice 19, which takes tasks of its
    # ops while the decode worker there has nothing to step (it raises a lease when it
    # has: cluster/worker/lending.py). Not where the threads or cores are set by hand, the
    # planner resizes the pools, or workers run on Ray.
    prefill_borrows_cores: bool = True
    # With --slo-tpot-ms, a decode worker that lends its cores spaces its decode-only
    # steps (PACE_SHARE x the target apart) while the borrower has prompts, lending the
    # core in between (cluster/worker/lending.py). Off: it steps whenever it has work.
    pace_decode: bool = True
    # "tcp" | "shm" (one host): how KV moves between workers. TCP by default: shm started
    # a 1,536-token prompt's decode ~8 ms sooner on a 2-core Zen 4, yet served goodput
    # table (c) a ladder step lower in two of three runs (docs/benchmarks.md, 2026-12-06).
    kv_transport: str = "tcp"
    # "auto" | "on" | "off": whether a prefill's KV leaves layer by layer while its step
    # runs, or right after the step (transfer/sender.py LayerStreaming). auto streams when
    # the transfer would share the cores with compute anyway (more prompts queued, or
    # cores the compute leaves free), else sends after the step on the cores it freed.
    kv_stream_layers: str = "auto"
    disagg_policy: str = "auto"  # "auto" (conditional) | "always" | "never"
    # A failed KV transfer: "recompute" (the decode worker prefills locally), "retry"
    # (a new attempt with a new transfer) or "fail" (the client gets an error).
    kv_failure_policy: str = "recompute"
    max_retries: int = 2  # retries in a row before a request decodes again (DESIGN 7)
    restart_workers: bool = True  # a worker process that exits is started again (new epoch)
    enable_fault_injection: bool = False  # POST /admin/faults (tests, chaos, soak)
    max_queue_len: int = 256  # admission queue; beyond it 429
    # "queue": a request without room waits (up to the queue timeout); "reject": one whose
    # predicted TTFT passes --slo-ttft-ms gets 429 + Retry-After at once (early rejection).
    admission: str = "queue"
    # The planner (cluster/planner/): "off"; "advisory" decides every interval, logs and
    # reports (/admin/health, /metrics) and acts on nothing; "on" also acts (adds, drains,
    # switches workers). Needs both SLOs and --mode disagg.
    planner: str = "off"
    planner_interval_s: float = 10.0
    planner_max_workers: int | None = None  # the budget; None: one worker per core
    # Start of a worker -> serving; None: measured (the median over the workers the
    # cluster started; 30 s before the first registers).
    planner_model_load_s: float | None = None
    tenant_max_cached_blocks: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Engine knobs for every worker.
    dtype: str = "auto"
    quantization: str | None = None
    batch_invariant: bool | None = None  # None: on where the exact kernels exist (bf16 CPU)
    block_size: int = 16
    max_model_len: int | None = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_num_partial_prefills: int = 2
    # A step's wall time at most, at the worker's measured speed (a slow CPU's 512-token
    # chunk can take seconds: decodes beside it and prompts behind it wait that long).
    # None or 0: the token budget alone.
    max_step_ms: float | None = 1000.0
    kv_cache_memory_bytes: int = 1 << 30
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    store: KVStoreConfig = field(default_factory=KVStoreConfig)
    log_level: str = "info"
    # On SIGTERM/Ctrl-C: stop accepting, let in-flight requests finish for this long.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "disagg", "agg"):
            raise ValueError(f"mode={self.mode!r} must be 'auto', 'disagg' or 'agg'")
        _ = self.workload_tokens  # a malformed hint fails here, not once workers start
        if self.kv_failure_policy not in ("recompute", "retry", "fail"):
            raise ValueError(f"kv_failure_policy={self.kv_failure_policy!r} must be "
                             "recompute|retry|fail")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries} must be >= 0")
        if self.kv_stream_layers not in ("auto", "on", "off"):
            raise ValueError(f"kv_stream_layers={self.kv_stream_layers!r} must be auto|on|off")
        if self.disagg_policy not in ("auto", "always", "never"):
            raise ValueError(f"disagg_policy={self.disagg_policy!r} must be auto|always|never")
        if self.pool_sizes[1] < 1 or (self.mode != "agg" and self.pool_sizes[0] < 0):
            raise ValueError("need at least one decode worker (and prefill >= 0)")
        if not 0 <= self.worker_nice <= 19:
            raise ValueError(f"worker_nice={self.worker_nice} must be 0..19")
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port} is not a TCP port")
        if self.admission not in ("queue", "reject"):
            raise ValueError(f"admission={self.admission!r} must be 'queue' or 'reject'")
        if self.admission == "reject" and not self.slo_ttft_ms:
            raise ValueError("--admission reject needs --slo-ttft-ms (the target it predicts)")
        if self.planner not in ("off", "advisory", "on"):
            raise ValueError(f"planner={self.planner!r} must be off|advisory|on")
        if self.planner != "off" and not (self.slo_ttft_ms and self.slo_tpot_ms
                                          and self.mode in ("disagg", "auto")):
            raise ValueError("--planner needs --slo-ttft-ms, --slo-tpot-ms and --mode disagg "
                             "(it may still run the cluster with no prefill pool)")
        if self.max_step_ms is not None and not (math.isfinite(self.max_step_ms)
                                                 and self.max_step_ms >= 0):
            raise ValueError(f"max_step_ms={self.max_step_ms} must be >= 0 (0: off)")
        if self.runtime not in ("local", "ray"):
            raise ValueError(f"runtime={self.runtime!r} must be 'local' or 'ray'")
        if self.kv_transport not in ("tcp", "shm"):
            raise ValueError(f"kv_transport={self.kv_transport!r} must be tcp|shm")
        if self.runtime == "ray" and self.kv_transport == "shm":
            raise ValueError("--runtime ray moves KV over TCP (shared memory does not "
                             "cross machines): use --kv-transport tcp")

    @property
    def decode_pace_s(self) -> float | None:
        """A lending decode worker's step interval while the prefill has prompts (None:
        no pacing, for want of a TPOT target or with --no-pace-decode)."""
        if not (self.pace_decode and self.slo_tpot_ms):
            return None
        return PACE_SHARE * self.slo_tpot_ms / 1e3

    @property
    def pool_sizes(self) -> tuple[int, int]:
        """(prefill, decode) workers to start: as given, else 1 each."""
        return (1 if self.prefill is None else self.prefill,
                1 if self.decode is None else self.decode)

    @property
    def workload_tokens(self) -> tuple[int, int, float | None]:
        """`workload_hint` "PROMPT:OUTPUT[:CV]" as (mean prompt tokens, mean output tokens,
        the prompt length's coefficient of variation or None)."""
        fields = [f.strip() for f in str(self.workload_hint).split(":")]
        if len(fields) in (2, 3) and all(f.isdigit() and int(f) > 0 for f in fields[:2]):
            cv = _non_negative(fields[2]) if len(fields) == 3 else None
            if len(fields) == 2 or cv is not None:
                return int(fields[0]), int(fields[1]), cv
        raise ValueError(f"workload_hint={self.workload_hint!r} must be PROMPT:OUTPUT mean "
                         f"tokens, e.g. 512:128, or PROMPT:OUTPUT:CV with the prompt "
                         f"length's std / mean, e.g. 839:24:0.9 (quote it in YAML)")

    def engine_args(self) -> dict[str, object]:
        return {"model": self.model, "dtype": self.dtype, "quantization": self.quantization,
                "batch_invariant": self.batch_invariant, "block_size": self.block_size,
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_partial_prefills": self.max_num_partial_prefills,
                "max_step_ms": self.max_step_ms or None,
                "kv_cache_memory_bytes": self.kv_cache_memory_bytes}


def _non_negative(text: str) -> float | None:
    """A finite float >= 0 written in `text`, else None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None
