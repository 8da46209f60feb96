"""Hostile frames from a peer that holds a valid key (a compromised or buggy worker): wrong
frame counts, random bytes, mutated messages, wrong types nested deep, messages over the
size bound and forged registrations. The receive loop lives on, the worker table does
not change, and the dispatcher still serves; the worker's own socket survives any bytes
from the frontend too."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import MAX_MESSAGE_BYTES
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.worker.control import FrontendSocket
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import ProtocolError
from splitserve.transfer.telemetry import TransferSide, TransferTelemetry
from tests.cluster.test_control_auth import dropped, peer, table, until
from tests.cluster.test_dispatcher import (FINGERPRINT, PLAN, ScriptedWorker, collect,
                                           output, request, run, workers)

TAGS = {cls: tag for tag, cls in enumerate(P._TYPES)}


def ready(worker_id: str = "both-0", role: P.Role = P.Role.BOTH, **kw: Any) -> P.WorkerReady:
    fields: dict[str, Any] = dict(pid=1, fingerprint=FINGERPRINT, block_size=16,
                                  num_blocks=100, max_model_len=2048, max_num_seqs=8,
                                  kv_address="tcp://127.0.0.1:1" if role.can_decode else None,
                                  kv_bytes_per_token=1000)
    fields.update(kw)
    return P.WorkerReady(worker_id, role, **fields)


def valid_messages() -> list[P.Message]:
    """One of every message a worker sends, well formed."""
    telemetry = TransferTelemetry("t1", "r1", "tcp", TransferSide.RECEIVER)
    return [ready(), output("r1", 0, [1, 2], 0, "ab"), P.KVPlanReady("r1", PLAN),
            P.PrefillDone("r1", True), P.RequestFailed("r1", P.FailureKind.WORKER_ERROR, "x"),
            P.KVEventBatch(1, []), P.KVSnapshot(1, [b"h" * 16]),
            P.LoadReport(0, 0, 0, 0, 0, 100, [P.StepTiming(1, 1, 0.1)]),
            P.TransferReport(telemetry), P.PoolReport(1, True, None, 0, 0)]


def nested_wrong_types() -> list[bytes]:
    """Right tags and arity, wrong types deep inside."""
    t = TAGS
    return [msgpack.packb(m) for m in (
        [t[P.LoadReport], 0, 0, 0, 0, 0, 100, [[1, "one", 0.1]], 0, 0],
        [t[P.LoadReport], 0, 0, 0, 0, 0, 100, [[1, 1, [0.1]]], 0, 0],
        [t[P.KVEventBatch], 1, [[0, ["not bytes"], None]]],
        [t[P.KVEventBatch], 1, [[7, [b"h" * 16], None]]],  # no such event record
        [t[P.KVEventBatch], 1, [[0, [b"h" * 16], {"parent": 1}]]],
        [t[P.Output], "r1", 0, [1], 0, "a", 0, [[1, "lp", [[1, "x"]]]], False, None, None,
         3, 0],
        [t[P.Output], "r1", 0, [True], 0, "a", 0, None, False, None, None, 3, 0],
        [t[P.Output], "r1", 0, [2 ** 64 - 1], 0, "a", 0, None, False, None, [1], 3, 0],
        [t[P.KVPlanReady], "r1", ["t1", "r1", None, "tcp://x:1", 0, "3", 5.0]],
        [t[P.WorkerReady], "both-0", "wizard", 1, FINGERPRINT, 16, 100, 2048, 8, None, 1, 1],
        [t[P.WorkerReady], "both-0", "both", 1, FINGERPRINT, 16, 100, 2048, 8, [b"x"], 1, 1],
        [t[P.TransferReport], ["t1", "r1", "tcp", 9]],
        [t[P.RequestFailed], "r1", "exploded", "x", None],
        [t[P.PoolReport], 1, True, None, {"a": 1}, 0],
        [len(P._TYPES), 1, 2], [-1], ["Output"], {"tag": 1}, [], None, 7,
    )] + [msgpack.packb(msgpack.ExtType(5, b"\x00" * 8)),
          b"\x91" * 100_000]  # nested 100,000 arrays deep


def mutations(rng: random.Random, frames: list[bytes], n: int) -> list[bytes]:
    out = []
    for _ in range(n):
        frame = bytearray(rng.choice(frames))
        for _ in range(rng.randint(1, 4)):
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        out.append(bytes(frame[:rng.randint(0, len(frame))]) if rng.random() < 0.3
                   else bytes(frame))
    return out


def test_hostile_frames_leave_the_dispatcher_serving_and_the_table_unchanged() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        before = table(d)
        fenced_before = d.metrics.fenced_messages._value.get()
        hostile = peer(ctx, d, b"both-5:1", d.link.enroll(b"both-5:1"))
        rng = random.Random(16)
        encoded = [P.encode(m) for m in valid_messages()[1:]]  # not its own WorkerReady
        singles = ([b""] + [rng.randbytes(rng.randint(1, 300)) for _ in range(200)]
                   + mutations(rng, encoded, 300) + nested_wrong_types())
        multis = [[b"", b""], [encoded[0], encoded[0]], [b"a", b"b", b"c"], [b""] * 9]
        for frame in singles:
            await hostile.send(frame)
        for parts in multis:
            await hostile.send_multipart(parts)
        # Every frame is accounted for: dropped (undecodable, wrong count, refused) or,
        # when it happens to be a well-formed message, fenced (hostile never registered).
        def accounted() -> float:
            return (dropped(d, "undecodable") + dropped(d, "frame_count")
                    + dropped(d, "refused") + d.metrics.fenced_messages._value.get()
                    - fenced_before)
        await until(lambda: accounted() == len(singles) + len(multis), 10)
        assert dropped(d, "frame_count") == len(multis)
        assert dropped(d, "handler_error") == 0
        # Over the size bound: ZeroMQ drops the connection before the frame is buffered;
        # the peer reconnects and what it sends next is still checked.
        await hostile.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        await asyncio.sleep(0.5)
        await hostile.send_multipart([b"after", b"huge"])
        await until(lambda: dropped(d, "frame_count") == len(multis) + 1, 10)
        assert table(d) == before
        assert not any(task.done() for task in d._tasks)  # receive loop and reaper live
        task = asyncio.create_task(collect(d.generate(request())))
        assert (await w.expect(P.Generate)).request_id == "r1"
        await w.send(output("r1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]
        hostile.close()
    run(scenario)


def test_forged_and_repeated_registrations_remove_no_one() -> None:
    """Registrations that do not check out are refused before anything changes: the real
    worker keeps its requests and keeps serving."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        before = table(d)

        def as_(identity: bytes) -> zmq.asyncio.Socket:
            return peer(ctx, d, identity, d.link.enroll(identity))
        forged: list[tuple[zmq.asyncio.Socket, P.WorkerReady]] = [
            (as_(b"both-5:1"), ready("both-0")),  # names another worker
            (as_(b"both-6:1"), ready("both-6", P.Role.DECODE)),  # names another role
            (as_(b"both-0:0"), ready("both-0")),  # older than the registered incarnation
            (as_(b"both-0:2"), ready("both-0", fingerprint="e" * 32)),  # another model
            (as_(b"both-0:3"), ready("both-0", num_blocks=0)),
            (as_(b"both-0:4"), ready("both-0", max_model_len=-5)),
            (as_(b"both-0:6"), ready("both-0", max_num_partial_prefills=0)),
            (as_(b"both-0:5"), ready("both-0", kv_address=None)),  # decodes without one
            (as_(b"prefill-0:1"), ready("prefill-0", P.Role.PREFILL,
                                        kv_address="tcp://127.0.0.1:1")),
            (as_(b"both-0:7"), ready("both-0", pace_s=-0.1)),  # no such pace
            (as_(b"both-0:8"), ready("both-0", pace_s=float("nan"))),
            (as_(b"prefill-1:1"), ready("prefill-1", P.Role.PREFILL, pace_s=0.05)),  # no decode
        ]
        for sock, msg in forged:
            await sock.send(P.encode(msg))
        await w.send(ready("both-0", max_model_len=16))  # repeated, and shrinking
        revoked = as_(b"both-0:9")
        await revoked.send_multipart([b"hello", b"there"])  # its connection is up once
        await until(lambda: dropped(d, "frame_count") == 1)  # this is counted
        await until(lambda: dropped(d, "refused") == len(forged) + 1)
        d.link.revoke(b"both-0:9")  # connected, then its key was revoked
        await revoked.send(P.encode(ready("both-0")))
        await until(lambda: dropped(d, "refused") == len(forged) + 2)
        assert table(d) == before and d.max_model_len == 2048
        assert d.table.workers[b"both-0:1"].request_ids == {"r1"}
        await w.send(output("r1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]
        for sock, _ in forged:
            sock.close()
        revoked.close()
        # A real restart (a newer epoch, same model) still replaces the worker.
        new = ScriptedWorker(ctx, d, "both", epoch=10)
        await new.register()
        await until(lambda: d.table.by_id["both-0"].identity == b"both-0:10")
    run(scenario)


def test_messages_workers_do_not_send_are_refused() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        for msg in (P.Shutdown(), P.Abort("r1"), P.ResyncKV(), P.CheckPool(1)):
            await w.send(msg)
        await until(lambda: dropped(d, "refused") == 4)
        assert b"both-0:1" in d.table.workers
    run(scenario)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_decode_raises_only_protocol_error_on_any_bytes(frame: bytes) -> None:
    try:
        P.decode(frame)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([P.encode(m) for m in valid_messages()]), st.data())
def test_decode_raises_only_protocol_error_on_mutated_messages(frame: bytes,
                                                               data: st.DataObject) -> None:
    mutated = bytearray(frame)
    for i in data.draw(st.lists(st.integers(0, len(frame) - 1), min_size=1, max_size=4)):
        mutated[i] = data.draw(st.integers(0, 255))
    try:
        P.decode(bytes(mutated))
    except ProtocolError:
        pass


def send_when_connected(router: zmq.Socket, identity: bytes, frame: bytes) -> None:
    """Sends once the handshake is done (until then ROUTER_MANDATORY refuses the id)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            router.send_multipart([identity, frame], zmq.NOBLOCK)
            return
        except zmq.ZMQError:
            assert time.monotonic() < deadline, "the worker never connected"
            time.sleep(0.01)


def test_the_worker_socket_survives_any_bytes_from_the_frontend() -> None:
    """FrontendSocket.receive hands the worker only well-formed messages, whatever the
    frontend's socket sends: frame counts, garbage, wrong nested types, deep nesting."""
    link = WorkerLink(Metrics())
    identity = b"decode-0:1"
    worker = FrontendSocket(link.address, identity, link.enroll(identity), send_timeout_s=5)
    router: zmq.Socket[bytes] = zmq.Socket.shadow(link.sock.underlying)  # a blocking view
    try:
        worker.send(P.LoadReport(0, 0, 0, 0, 0, 1))  # connects (nobody reads it)
        send_when_connected(router, identity, P.encode(P.ResyncKV()))
        rng = random.Random(3)
        good = [P.encode(m) for m in (P.Abort("r1"), P.EvictBlocks([b"h" * 16]),
                                      P.KVPlan("r1", PLAN))]
        bad = ([b""] + [rng.randbytes(rng.randint(1, 200)) for _ in range(100)]
               + [msgpack.packb([TAGS[P.KVPlan], "r1", ["t", "r", None, "a", "0", 1, 1.0]]),
                  msgpack.packb([TAGS[P.Generate], "r1", [1, "2"], [], None, False, 1.0,
                                 False, []]),
                  b"\x91" * 100_000])
        for frame in bad + good:
            router.send_multipart([identity, frame])
        router.send_multipart([identity, good[0], good[0]])  # two frames: dropped
        got: list[P.Message] = []
        for _ in range(100):
            got += worker.receive(0.05)
            if len(got) >= 1 + len(good) and worker.num_dropped >= len(bad) + 1:
                break
        assert [type(m) for m in got] == [P.ResyncKV, P.Abort, P.EvictBlocks, P.KVPlan]
        assert worker.num_dropped == len(bad) + 1
    finally:
        worker.close()
        link.close()


def test_the_message_bound_holds_the_largest_real_messages() -> None:
    """The documented bound: a KVSnapshot of a 1M-block pool and a Generate of a
    1M-token prompt fit (with the resumed tokens of a retry), with room to spare."""
    snapshot = P.encode(P.KVSnapshot(1, [bytes(16)] * 1_000_000))
    prompt = [49151] * 1_000_000
    generate = P.encode(P.Generate("r" * 64, prompt, SamplingParams(), "ns", True, 5.0, True,
                                   prompt))
    assert len(snapshot) < MAX_MESSAGE_BYTES and len(generate) < MAX_MESSAGE_BYTES


def test_transfer_error_labels_are_bounded() -> None:
    """A worker-supplied error string never becomes a new label value."""
    metrics = Metrics()
    for error in ("ChecksumMismatch", "ConnectionResetError", "x" * 1000, "<script>", None):
        metrics.observe_transfer(TransferTelemetry("t", "r", "tcp", TransferSide.SENDER,
                                                   error=error))
    outcomes = {s.labels["outcome"] for m in metrics.registry.collect()
                if m.name == "splitserve_kv_transfers" for s in m.samples
                if s.name.endswith("_total")}
    assert outcomes == {"ChecksumMismatch", "ConnectionResetError", "other", "ok"}
