"""Every message between the frontend and the workers, and their msgpack encoding.

One ZeroMQ ROUTER socket in the frontend, one DEALER per worker. The DEALER's routing id
names the worker and its incarnation (`<role>-<index>:<epoch>`), so the frontend knows
who sent a message without trusting its body. A frame is `msgpack([tag, *fields])`;
decoding checks the tag, the field count and every field's type against the dataclass,
and raises ProtocolError otherwise. Nothing is unpickled; no message names a method.

    frontend -> worker: Generate, Prefill, Abort, ResyncKV, EvictBlocks, Shutdown,
                        InjectFault, CheckPool
    worker -> frontend: WorkerReady, Output, KVPlanReady, RequestFailed, KVEventBatch,
                        KVSnapshot, LoadReport, TransferReport, PoolReport
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

import msgpack

from splitserve.engine.batch import SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import InvalidRequestError, ProtocolError
from splitserve.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# -- fault injection --------------------------------------------------------------------
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
#     stall           decode | now                                the loop sleeps `seconds`: no
#                                                                 heartbeat, no output (a partition)
#     drop_kv         transfer                                    the KV is never sent
#     corrupt_kv      transfer                                    one byte of the KV flips on the wire
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


@dataclass(slots=True)
class Prefill:
    """Prefill a request, stream its first token back and its KV to `plan` (a
    TransferPlan as a dict, from the decode worker's KVPlanReady)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    namespace: str | None
    plan: dict[str, Any]
    resume_token_ids: list[int] = field(default_factory=list)  # as in Generate


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
    """Arm a fault (cluster/faults.py FaultSpec as a dict); refused by workers started
    without fault injection."""
    spec: dict[str, Any]


@dataclass(slots=True)
class CheckPool:
    """Check the KV pool's invariants now and answer PoolReport."""


# -- worker -> frontend ---------------------------------------------------------------------


@dataclass(slots=True)
class WorkerReady:
    worker_id: str
    role: str  # "prefill" | "decode" | "both"
    pid: int
    fingerprint: str
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_seqs: int
    kv_address: str | None  # where this worker receives KV (decode roles)
    kv_bytes_per_token: int


@dataclass(slots=True)
class Output:
    """A request's new output, positioned in the request's output (token, text and
    logprob offsets) so outputs of several workers merge exactly (cluster/stream.py)."""
    request_id: str
    token_offset: int
    token_ids: list[int]
    text_offset: int
    text: str
    logprobs_offset: int
    logprobs: list[SampledToken] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class KVPlanReady:
    request_id: str
    plan: dict[str, Any]


@dataclass(slots=True)
class RequestFailed:
    request_id: str
    kind: str  # the exception class name, e.g. "InvalidRequestError", "TransferTimeout"
    message: str
    field: str | None = None  # the request field at fault, for InvalidRequestError


@dataclass(slots=True)
class KVEventBatch:
    seq: int  # per worker, +1 per batch: a gap means events were lost
    events: list[KVEvent]


@dataclass(slots=True)
class KVSnapshot:
    seq: int  # the last event batch this snapshot includes
    block_hashes: list[bytes]


@dataclass(slots=True)
class LoadReport:
    """Periodic (also the heartbeat): queue, memory and the step timings since the last."""
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_awaiting_kv: int
    kv_blocks_used: int
    kv_blocks_total: int
    # (prefill tokens, decode seqs, seconds) of each step since the previous report
    steps: list[list[float]] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache, cumulative
    num_prompt_tokens: int = 0  # prompt tokens admitted, cumulative


@dataclass(slots=True)
class TransferReport:
    request_id: str
    telemetry: dict[str, Any]  # TransferTelemetry.as_dict()
    error: str | None  # the failure's class name, None when it succeeded


@dataclass(slots=True)
class PoolReport:
    """The answer to CheckPool: whether the invariants hold and what is in use."""
    ok: bool
    error: str | None
    num_used_blocks: int  # blocks referenced by requests (cached free blocks excluded)
    num_requests: int  # live requests + finished ones holding KV for a transfer


Message = (Generate | Prefill | Abort | ResyncKV | Shutdown | WorkerReady | Output
           | KVPlanReady | RequestFailed | KVEventBatch | KVSnapshot | LoadReport
           | TransferReport | EvictBlocks | InjectFault | CheckPool | PoolReport)
_TYPES: list[type] = [Generate, Prefill, Abort, ResyncKV, Shutdown, WorkerReady, Output,
                      KVPlanReady, RequestFailed, KVEventBatch, KVSnapshot, LoadReport,
                      TransferReport, EvictBlocks, InjectFault, CheckPool, PoolReport]


# -- encoding -------------------------------------------------------------------------------

def encode(msg: Message) -> bytes:
    codec = _CODECS_BY_TYPE[type(msg)]
    return msgpack.packb([codec.tag, *(enc(getattr(msg, name))
                                       for name, enc, _ in codec.fields)])


def decode(frame: bytes) -> Message:
    try:
        items = msgpack.unpackb(frame, use_list=True, raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from None
    if not isinstance(items, list) or not items or not isinstance(items[0], int) \
            or not 0 <= items[0] < len(_CODECS):
        raise ProtocolError("message is not [known tag, *fields]")
    codec = _CODECS[items[0]]
    if len(items) - 1 != len(codec.fields):
        raise ProtocolError(f"{codec.cls.__name__} takes {len(codec.fields)} fields, "
                            f"got {len(items) - 1}")
    try:
        values = {name: dec(v) for (name, _, dec), v in zip(codec.fields, items[1:])}
        return typing.cast(Message, codec.cls(**values))
    except ProtocolError:
        raise
    except (TypeError, ValueError, KeyError) as exc:  # SamplingParams validation included
        raise ProtocolError(f"bad {codec.cls.__name__}: {exc}") from None


Encoder = Callable[[Any], Any]


@dataclass(frozen=True)
class _Codec:
    tag: int
    cls: type
    fields: list[tuple[str, Encoder, Encoder]]  # (name, encode, decode)


def _check(kinds: tuple[type, ...], what: str) -> Encoder:
    def dec(v: Any) -> Any:
        # NOTE: bool is an int in Python; an int field must not take True.
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            raise ProtocolError(f"expected {what}, got {type(v).__name__}")
        return v
    return dec


def _same(v: Any) -> Any:
    return v


def _enc_params(p: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


def _dec_params(v: Any) -> SamplingParams:
    if not isinstance(v, dict):
        raise ProtocolError("sampling params must be a map")
    return SamplingParams(**v)


def _enc_logprobs(v: list[SampledToken] | None) -> Any:
    if v is None:
        return None
    return [[t.token_id, t.logprob, None if t.top_logprobs is None
             else [list(p) for p in t.top_logprobs]] for t in v]


def _dec_logprobs(v: Any) -> list[SampledToken] | None:
    if v is None:
        return None
    return [SampledToken(int(t), lp, None if top is None else [(int(i), float(x)) for i, x in top])
            for t, lp, top in v]


def _enc_events(events: list[KVEvent]) -> list[Any]:
    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append([0, e.parent_hash, list(e.block_hashes)])
        elif isinstance(e, BlockRemoved):
            out.append([1, None, list(e.block_hashes)])
        else:
            out.append([2, None, []])
    return out


def _dec_events(v: Any) -> list[KVEvent]:
    events: list[KVEvent] = []
    for kind, parent, hashes in v:
        if not all(isinstance(h, bytes) for h in hashes) or (
                parent is not None and not isinstance(parent, bytes)):
            raise ProtocolError("block hashes must be bytes")
        if kind == 0:
            events.append(BlockStored(tuple(hashes), parent))
        elif kind == 1:
            events.append(BlockRemoved(tuple(hashes)))
        elif kind == 2:
            events.append(AllBlocksCleared())
        else:
            raise ProtocolError(f"unknown KV event kind {kind}")
    return events


_SIMPLE: dict[Any, tuple[type, ...]] = {
    str: (str,), int: (int,), float: (float, int), bool: (bool,), bytes: (bytes,),
    type(None): (type(None),),
}
_SPECIAL: dict[Any, tuple[Encoder, Encoder]] = {
    SamplingParams: (_enc_params, _dec_params),
    list[SampledToken] | None: (_enc_logprobs, _dec_logprobs),
    list[KVEvent]: (_enc_events, _dec_events),
}


def _dec_int_list(v: Any) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int for x in v):
        raise ProtocolError("expected a list of ints")
    return v


def _dec_hash_list(v: Any) -> list[bytes]:
    if not isinstance(v, list) or not all(type(x) is bytes for x in v):
        raise ProtocolError("expected a list of block hashes (bytes)")
    return v


def _field_codec(tp: Any) -> tuple[Encoder, Encoder]:
    if tp in _SPECIAL:
        return _SPECIAL[tp]
    if tp == list[int]:
        return _same, _dec_int_list
    if tp == list[bytes]:
        return _same, _dec_hash_list
    parts = typing.get_args(tp) if isinstance(tp, types.UnionType) else (tp,)
    kinds: tuple[type, ...] = ()
    for part in parts:
        origin = typing.get_origin(part) or part
        kinds += _SIMPLE.get(origin, (origin,))
    return _same, _check(kinds, " | ".join(k.__name__ for k in kinds))


def _build() -> list[_Codec]:
    codecs = []
    for tag, cls in enumerate(_TYPES):
        hints = typing.get_type_hints(cls)
        codecs.append(_Codec(tag, cls, [(f.name, *_field_codec(hints[f.name]))
                                        for f in dataclasses.fields(cls)]))
    return codecs


_CODECS = _build()
_CODECS_BY_TYPE = {c.cls: c for c in _CODECS}
