"""Every message between the frontend and the workers, and their encoding.

One ZeroMQ ROUTER socket in the frontend, one DEALER per worker. The DEALER's routing id
names the worker and its incarnation (`<role>-<index>:<epoch>`), so the frontend knows
who sent a message without trusting its body. A frame is `msgpack([tag, *fields])`, each
field typed and checked on decoding, nested records included (cluster/codec.py).
Nothing is unpickled; no message names a method.

    frontend -> worker: Generate, Prefill, KVPlan, Abort, ResyncKV, EvictBlocks, Shutdown,
                        InjectFault, CheckPool, Migrate, SwitchRole, PurgeTenant,
                        ExportPrefix, CancelImport
    worker -> frontend: WorkerReady, Output, OutputBatch, KVPlanReady, PrefillDone,
                        RequestFailed, KVEventBatch, KVSnapshot, LoadReport, TransferReport,
                        PoolReport, Detached, TenantPurged, TierEventBatch
    (the store's messages, PurgeTenant to CancelImport, are in cluster/protocol_store.py)

A disaggregated request (DESIGN 3): the frontend sends Generate(await_kv) to the decode
worker D and Prefill to the prefill worker P at once. P prefills and streams token 1
(Output); D reserves blocks and answers KVPlanReady, which the frontend relays to P as
KVPlan; P streams the KV to D (holding it if its prefill finished first), then says
PrefillDone. D streams from token 2 on.

Peer fetch (a local request whose prefix another worker H holds): Generate(await_kv,
kv_prefix_end=N) to D and ExportPrefix(the N-token prefix) to H; the plan is relayed as
above, H sends the prefix's KV and PrefillDone, and D prefills the rest and streams every
token. A failed fetch costs only time: D prefills the whole prompt (CancelImport says so
at once when H fails or leaves).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field
from enum import Enum

import msgpack

from splitserve.cluster.codec import RecordCodec, record_codec
from splitserve.cluster.fault_spec import FaultSpec  # InjectFault's payload
from splitserve.cluster.protocol_store import (STORE_TIERS, CancelImport,  # noqa: F401
                                               ExportPrefix, PurgeTenant, TenantPurged,
                                               TierCount, TierEventBatch, TierUsage)
from splitserve.engine.batch import SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import (InvalidRequestError, KVImportError, KVTransferError,
                               ProtocolError)
from splitserve.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored
from splitserve.transfer.handle import TransferPlan
from splitserve.transfer.telemetry import TransferTelemetry


class Role(str, Enum):
    """What a worker does. Every role can prefill locally."""
    PREFILL = "prefill"  # prefills for decode workers and streams the KV out
    DECODE = "decode"  # imports KV and decodes
    BOTH = "both"  # aggregated: prefills and decodes its own requests

    @property
    def can_decode(self) -> bool:
        return self is not Role.PREFILL


class FailureKind(str, Enum):
    """Why an attempt failed: what workers report (RequestFailed) and what the frontend
    finds (deaths, timeouts, broken streams). The values are metric labels."""
    INVALID_REQUEST = "invalid"  # the request itself is bad: never retried
    KV_TRANSFER = "kv_transfer"  # a KV transfer or import failed, timed out or was corrupt
    WORKER_ERROR = "worker_error"  # anything else a worker raised for this request
    WORKER_DEAD = "worker_dead"  # the worker exited, went silent or was replaced
    BAD_OUTPUT = "bad_output"  # a worker broke the stream's positions contract
    # A worker sent other tokens at positions already streamed (outputs that depend on
    # batching: not the exact kernels): retried from the streamed ones.
    DIVERGED = "diverged"
    TIMEOUT_QUEUE = "timeout_queue"
    TIMEOUT_PREFILL = "timeout_prefill"  # no first token in time
    TIMEOUT_HANDOFF = "timeout_handoff"  # token 1 came, the decode worker never went on
    TIMEOUT_DECODE = "timeout_decode"  # a gap between tokens
    TIMEOUT_REQUEST = "timeout_request"  # the request's own deadline

    @staticmethod
    def of(exc: BaseException) -> FailureKind:
        if isinstance(exc, InvalidRequestError):
            return FailureKind.INVALID_REQUEST
        if isinstance(exc, (KVTransferError, KVImportError)):
            return FailureKind.KV_TRANSFER
        return FailureKind.WORKER_ERROR


# -- frontend -> worker ---------------------------------------------------------------------


@dataclass(slots=True)
class Generate:
    """Run a request on this worker. `await_kv`: its prompt KV comes from a prefill
    worker; reserve blocks and answer KVPlanReady (or RequestFailed when it cannot)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str | None
    await_kv: bool
    kv_timeout_s: float  # how long the reservation waits for the KV
    recompute_on_failure: bool  # a failed import falls back to a local prefill
    # Output an earlier attempt produced (retry or migration): go on from there.
    resume_token_ids: list[int] = field(default_factory=list)
    tenant: str | None = None  # whose cache its blocks count against below the pool
    # Peer fetch: only the prefix [0, kv_prefix_end) comes (from ExportPrefix on another
    # worker); this worker prefills the rest. None: the whole prompt (a prefill worker's).
    kv_prefix_end: int | None = None


@dataclass(slots=True)
class Prefill:
    """Prefill a request for a decode worker: stream its first token back at once, and its
    KV once the decode worker's plan arrives (KVPlan), holding it up to `kv_timeout_s`."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str | None
    kv_timeout_s: float
    resume_token_ids: list[int] = field(default_factory=list)  # as in Generate
    tenant: str | None = None  # as in Generate


@dataclass(slots=True)
class KVPlan:
    """Where to send a prefill's KV: the decode worker's plan, relayed by the frontend."""
    request_id: str
    plan: TransferPlan


@dataclass(slots=True)
class Abort:
    request_id: str


@dataclass(slots=True)
class ResyncKV:
    """The frontend lost track of this worker's KV events: send a KVSnapshot."""


@dataclass(slots=True)
class EvictBlocks:
    """Drop these blocks from the prefix cache where no request uses them (a tenant went
    over its cache cap)."""
    block_hashes: list[bytes]


@dataclass(slots=True)
class Shutdown:
    """Finish nothing, free everything, check the pool's invariants, exit."""


@dataclass(slots=True)
class InjectFault:
    """Arm a fault; refused by workers started without fault injection."""
    spec: FaultSpec


@dataclass(slots=True)
class CheckPool:
    """Check the KV pool's invariants now and answer PoolReport (with the same round)."""
    round: int


@dataclass(slots=True)
class Migrate:
    """Live migration, source side: stop decoding this request, hold its KV (prompt and
    output so far) for a decode worker's plan (relayed as KVPlan, as for a prefill), and
    answer Detached. The KV is released unsent after `kv_timeout_s` without a plan."""
    request_id: str
    namespace: str | None
    kv_timeout_s: float


# -- worker -> frontend ---------------------------------------------------------------------


@dataclass(slots=True)
class WorkerReady:
    worker_id: str
    role: Role
    pid: int
    fingerprint: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    kv_address: str | None  # where this worker receives KV (decode roles)
    kv_bytes_per_token: int
    max_num_partial_prefills: int = 1  # prompts one step's budget is shared among
    # A decode worker lending its core: the interval of its decode-only steps while the
    # prefill has prompts (cluster/worker/lending.py); None: it steps when it has work.
    pace_s: float | None = None
    # It borrows other workers' cores when they are idle: its step times are its own, not
    # a one-core worker's (the router does not pool them).
    borrows_cores: bool = False


@dataclass(slots=True)
class Output:
    """A request's new output, positioned in the request's output (token, text and
    logprob offsets) so outputs of several workers merge exactly (frontend/stream.py)."""
    request_id: str
    token_offset: int
    token_ids: list[int]
    text_offset: int
    text: str
    logprobs_offset: int
    logprobs: list[SampledToken] | None
    finished: bool
    finish_reason: str | None  # OpenAI's: "stop" | "length" | "abort"
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int


# Outputs a worker sends in one OutputBatch at most (a step's outputs, in their order).
MAX_OUTPUT_BATCH = 64


@dataclass(slots=True)
class OutputBatch:
    """Several Outputs in one frame, as the worker made them (a step's, in order): the
    frontend handles each as if it had come alone. One message, one CURVE box and one
    wake-up a step instead of one per request."""
    outputs: list[Output]


@dataclass(slots=True)
class KVPlanReady:
    request_id: str
    plan: TransferPlan


@dataclass(slots=True)
class PrefillDone:
    """The prefill worker holds nothing more for this request: its KV was handed off (the
    decode worker committed it) or, when `handed_off` is False, released unsent."""
    request_id: str
    handed_off: bool


@dataclass(slots=True)
class RequestFailed:
    request_id: str
    kind: FailureKind
    message: str
    field: str | None = None  # the request field at fault, for INVALID_REQUEST


@dataclass(slots=True)
class KVEventBatch:
    seq: int  # per worker, +1 per batch: a gap means events were lost
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(slots=True)
class KVSnapshot:
    seq: int  # the last event batch this snapshot includes
    block_hashes: list[bytes]


@dataclass(slots=True)
class StepTiming:
    """One engine step, a sample for the router's cost models."""
    num_prefill_tokens: int
    num_decode_seqs: int
    seconds: float


@dataclass(slots=True)
class KVListenerStats:
    """A decode worker's KV listener (transfer/gate.py): what idle, slow or forging peers
    cost it. Cumulative counts, except `held`."""
    held: int  # connections waiting for a whole header now
    accepted: int
    evicted: int  # closed to make room (connection cap or header budget)
    refused: int  # no room at accept, or a malformed prelude
    timed_out: int  # no header in time
    rejected: int  # whole headers refused: malformed, unknown transfer, forged, ...
    forged: int  # of which failed authentication (never touched an import)


@dataclass(slots=True)
class LoadReport:
    """Periodic (also the heartbeat): queue, memory and the step timings since the last."""
    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # prompt tokens not yet computed: waiting and prefilling
    num_awaiting_kv: int
    kv_blocks_used: int
    kv_blocks_total: int
    steps: list[StepTiming] = field(default_factory=list)  # since the previous report
    num_prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache, cumulative
    num_prompt_tokens: int = 0  # prompt tokens admitted, cumulative
    kv_listener: KVListenerStats | None = None  # workers that receive KV
    tiers: list[TierUsage] = field(default_factory=list)  # the store below its pool
    num_prefilling: int = 0  # running with their prompt not all computed (chunked prefill)
    # The requests (Generate, Prefill, ExportPrefix) that arrived since the previous report:
    # this report counts them. One dispatched after it was taken is not in it, and the
    # router keeps counting that one itself (router/load.py).
    received: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TransferReport:
    """One side's record of one KV transfer (its `error` names the failure, if any)."""
    telemetry: TransferTelemetry


@dataclass(slots=True)
class PoolReport:
    """The answer to CheckPool: whether the invariants hold and what is in use."""
    round: int  # the CheckPool's: a late answer never counts for a later round
    ok: bool
    error: str | None
    num_used_blocks: int  # blocks referenced by requests (cached free blocks excluded)
    num_requests: int  # live requests + finished ones holding KV for a transfer


@dataclass(slots=True)
class Detached:
    """The answer to Migrate: `ok`, the request stopped here after the tokens already
    streamed and its KV is held (PrefillDone follows once it was sent or released); else
    it goes on here (`error` says why: not decoding, finished, unknown)."""
    request_id: str
    ok: bool
    error: str | None


@dataclass(slots=True)
class SwitchRole:
    """Become another worker without reloading the weights: role, index and incarnation
    of the new identity, and its control-plane key (the secret travels only inside this
    authenticated, encrypted channel). The worker holds no request when it is sent (the
    frontend drained it); it reconnects under the new identity and registers again."""
    role: Role
    index: int
    epoch: int
    secret: bytes  # auth.WorkerSecret.to_bytes()


# New messages go last: a message's tag is its place in this union.
Message = (Generate | Prefill | KVPlan | Abort | ResyncKV | EvictBlocks | Shutdown
           | InjectFault | CheckPool | WorkerReady | Output | KVPlanReady | PrefillDone
           | RequestFailed | KVEventBatch | KVSnapshot | LoadReport | TransferReport
           | PoolReport | Migrate | Detached | SwitchRole | PurgeTenant | TenantPurged
           | TierEventBatch | ExportPrefix | CancelImport | OutputBatch)
_TYPES: tuple[type, ...] = typing.get_args(Message)
_CODECS: list[RecordCodec] = [record_codec(cls) for cls in _TYPES]
_TAGS = {cls: tag for tag, cls in enumerate(_TYPES)}


def encode(msg: Message) -> bytes:
    tag = _TAGS[type(msg)]
    return msgpack.packb([tag, *_CODECS[tag].encode(msg)])


def decode(frame: bytes) -> Message:
    """The message in `frame`, fully checked; ProtocolError for anything else."""
    try:
        items = msgpack.unpackb(frame, use_list=True, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(items, list) or not items or type(items[0]) is not int \
            or not 0 <= items[0] < len(_CODECS):
        raise ProtocolError("message is not [known tag, *fields]")
    codec = _CODECS[items[0]]
    return typing.cast(Message, codec.decode(items[1:], codec.cls.__name__))
