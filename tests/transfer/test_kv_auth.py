"""Authenticated KV (issue 16): every frame is tagged under the plan's per-transfer key, so
forged, replayed, reordered, truncated or bit-flipped KV is never committed. A header that
fails its tag leaves the import untouched (the real sender still delivers); a bad frame
after an authenticated header fails the import like any corruption (blocks freed, recompute
or drop). Afterwards the engine passes its invariant checks, no block leaked (the
make_pair fixture checks), and a real transfer still commits."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import msgpack
import pytest

from splitserve.cluster import protocol as P
from splitserve.errors import (BlobFormatError, ChecksumMismatch, KVTransferError,
                               ProtocolError, TruncatedTransfer)
from splitserve.transfer.blob import (PRELUDE, BlobReader, BytesSource, FrameKind, ReplyOutcome,
                                      TransferReply, pack_record, parse_header, parse_prelude,
                                      record_frame)
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.mac import KEY_BYTES, FrameMac, new_key
from splitserve.transfer.transport import TransferState, get_transport
from tests.transfer.conftest import (DEADLINE_S, PARAMS, PROMPT, Pair, deliver, prefill_frames,
                                     run_to_end, settle)

TRANSPORTS = ["tcp", "shm"]


def retag(frames: list[bytes], key: bytes, transfer_id: str,
          edit: Callable[[int, bytes], bytes] = lambda i, body: body) -> list[bytes]:
    """`frames` with bodies changed by `edit(index, body)` and tags recomputed under `key`:
    what a peer holding `key` (but not the plan's) can make."""
    mac = FrameMac(key, transfer_id)
    out = []
    for i, data in enumerate(frames):
        prelude, body = parse_prelude(data[:PRELUDE.size]), edit(i, data[PRELUDE.size:])
        out.append(PRELUDE.pack(b"SSKV", prelude.kind, 0, prelude.layer, len(body),
                                mac.tag(prelude.kind, prelude.layer, len(body), [body])) + body)
    return out


def flip(data: bytes, pos: int) -> bytes:
    return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1:]


def wait_for(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def assert_untouched(pair: Pair, handle: TransferHandle) -> None:
    """The import still waits for its real sender; its blocks are reserved, not committed."""
    pair.receiver.poll()
    assert handle.poll().state == TransferState.PENDING and handle.output is None
    assert pair.b.engine.load().kv_blocks_used == 3  # reserved for the 37-token prompt
    pair.b.engine.check_invariants()


def assert_failed(pair: Pair, handle: TransferHandle, error: type[KVTransferError]) -> None:
    settle(pair, handle)
    status = handle.poll()
    assert status.state == TransferState.FAILED and isinstance(status.error, error), status
    assert handle.output is None
    assert pair.b.engine.request_state(handle.request_id) is None  # dropped, nothing kept
    assert pair.b.engine.load().kv_blocks_used == 0
    pair.b.engine.check_invariants()


def assert_commits(pair: Pair, transport: str, plan: TransferPlan, frames: list[bytes],
                   handle: TransferHandle, prompt: list[int] = PROMPT) -> None:
    """The real frames still commit, and B decodes what A alone would have."""
    chan = get_transport(transport).connect(plan.address, time.monotonic() + DEADLINE_S)
    try:
        chan.send(frames, time.monotonic() + DEADLINE_S)
        reader = BlobReader(chan, FrameMac(plan.key, plan.transfer_id))
        assert reader.read_reply(time.monotonic() + DEADLINE_S).outcome == ReplyOutcome.ACCEPTED
        settle(pair, handle)  # B's engine thread commits
        assert reader.read_reply(time.monotonic() + DEADLINE_S).outcome == ReplyOutcome.COMMITTED
    finally:
        chan.close()
    assert pair.decode(handle) == pair.a.generate(prompt, PARAMS)[0].token_ids
    pair.b.engine.check_invariants()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_forged_kv_is_refused_and_the_real_sender_still_commits(
        make_pair: Callable[..., Pair], transport: str) -> None:
    """Someone who knows the plan but not its key sends KV of its choosing (zeros) under
    the victim's transfer id, request and namespace."""
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS, namespace="victim")
    handle = pair.receiver_handle(plan)
    real = prefill_frames(pair, plan, namespace="victim")
    chosen = retag(real, new_key(), plan.transfer_id,
                   lambda i, body: bytes(len(body)) if 0 < i < len(real) - 1 else body)
    reply = deliver(pair, transport, chosen)
    assert reply is not None and reply.outcome == ReplyOutcome.REJECTED
    assert reply.error_kind == "ChecksumMismatch"
    assert pair.receiver.num_rejected_headers == 1
    assert pair.receiver.num_forged == 1
    assert_untouched(pair, handle)
    assert_commits(pair, transport, plan, real, handle)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_forged_layers_after_a_replayed_header_fail_the_import_and_it_recomputes(
        make_pair: Callable[..., Pair], transport: str) -> None:
    """An on-path attacker replays the real (authenticated) header, then its own layers:
    the first forged layer fails its tag, nothing is committed, the request is prefilled
    locally to the same tokens."""
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS, recompute=True)
    handle = pair.receiver_handle(plan)
    real = prefill_frames(pair, plan)
    forged = retag(real, new_key(), plan.transfer_id, lambda i, body: bytes(len(body)))
    deliver(pair, transport, [real[0], *forged[1:]])
    settle(pair, handle)
    assert isinstance(handle.poll().error, ChecksumMismatch) and handle.output is None
    out = run_to_end(pair.b, "r")  # recomputed locally, from the prompt
    assert out.token_ids == pair.a.generate(PROMPT, PARAMS)[0].token_ids
    assert pair.b.engine.load().kv_blocks_used == 0
    pair.b.engine.check_invariants()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("where", ["header body", "header tag", "layer tag", "layer body",
                                   "trailer body", "trailer tag"])
def test_a_flipped_bit_anywhere_is_never_committed(make_pair: Callable[..., Pair],
                                                   transport: str, where: str) -> None:
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS)
    handle = pair.receiver_handle(plan)
    frames = prefill_frames(pair, plan)
    frame, part = where.split()
    index = {"header": 0, "layer": 1, "trailer": len(frames) - 1}[frame]
    pos = PRELUDE.size - 3 if part == "tag" else len(frames[index]) - 2  # the last field
    if where == "header body":  # inside a block hash: still a well-formed header
        pos = frames[0].index(parse_header(frames[0][PRELUDE.size:]).block_hashes[1]) + 3
    bad = list(frames)
    bad[index] = flip(frames[index], pos)
    deliver(pair, transport, bad)  # the reply is awaited: the receiver reads it all
    if frame == "header":  # unauthenticated: refused, the import waits for its sender
        wait_for(lambda: pair.receiver.num_forged == 1)
        assert_untouched(pair, handle)
        assert_commits(pair, transport, plan, frames, handle)
    else:
        assert_failed(pair, handle, ChecksumMismatch)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("cut", ["last layer", "trailer", "mid layer"])
def test_truncated_kv_is_never_committed(make_pair: Callable[..., Pair], transport: str,
                                         cut: str) -> None:
    """Frames dropped from an authentic stream (each one correctly tagged) or a stream that
    ends mid-frame: the import fails, nothing is committed."""
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS)
    handle = pair.receiver_handle(plan)
    frames = prefill_frames(pair, plan)
    sent = {"last layer": frames[:-2] + frames[-1:], "trailer": frames[:-1],
            "mid layer": [*frames[:2], frames[2][:len(frames[2]) // 2]]}[cut]
    deliver(pair, transport, sent, read_reply=cut == "last layer")
    assert_failed(pair, handle, BlobFormatError if cut == "last layer" else TruncatedTransfer)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_replayed_kv_is_never_committed(make_pair: Callable[..., Pair], transport: str) -> None:
    """Replays of a finished transfer: its whole blob again (answered DUPLICATE, nothing
    read into the engine); under a new transfer's id (its tags are from the old key);
    its layers after the new transfer's real header; and the new transfer's own layers
    in another order."""
    pair = make_pair(transport)
    old_prompt = list(range(3000, 3037))  # as long as PROMPT: its layers are as big
    old_plan = pair.expect("old", old_prompt, PARAMS)
    old_handle = pair.receiver_handle(old_plan)
    old = prefill_frames(pair, old_plan, old_prompt)
    assert_commits(pair, transport, old_plan, old, old_handle, old_prompt)
    again = deliver(pair, transport, old)
    assert again is not None and again.outcome == ReplyOutcome.DUPLICATE
    pair.receiver.poll()
    assert pair.b.engine.load().kv_blocks_used == 0 and not pair.b.engine.has_unfinished

    plan = pair.expect("r", PROMPT, PARAMS)
    handle = pair.receiver_handle(plan)
    new = prefill_frames(pair, plan)
    header = dataclasses.replace(parse_header(old[0][PRELUDE.size:]),
                                 transfer_id=plan.transfer_id, request_id="r")
    body = pack_record(header)
    prelude = parse_prelude(old[0][:PRELUDE.size])  # the old tag, kept
    renamed = PRELUDE.pack(b"SSKV", FrameKind.HEADER, 0, 0, len(body), prelude.tag) + body
    deliver(pair, transport, [renamed, *old[1:]], read_reply=False)
    wait_for(lambda: pair.receiver.num_forged == 1)
    assert_untouched(pair, handle)

    deliver(pair, transport, [new[0], *old[1:]])  # old layers, new header
    assert_failed(pair, handle, ChecksumMismatch)

    plan = pair.expect("r2", PROMPT, PARAMS)
    handle = pair.receiver_handle(plan)
    new = prefill_frames(pair, plan)
    swapped = [flip_layer_index(new[2], 0), flip_layer_index(new[1], 1)]
    deliver(pair, transport, [new[0], *swapped, *new[3:]])
    assert_failed(pair, handle, ChecksumMismatch)
    tokens, _, _ = pair.handoff("after", PROMPT, PARAMS)  # the engine is still fine
    assert tokens == pair.a.generate(PROMPT, PARAMS)[0].token_ids


def flip_layer_index(frame: bytes, layer: int) -> bytes:
    """A layer frame relabelled as layer `layer` (its tag unchanged)."""
    p = parse_prelude(frame[:PRELUDE.size])
    return PRELUDE.pack(b"SSKV", p.kind, 0, layer, p.size, p.tag) + frame[PRELUDE.size:]


def test_an_unknown_transfer_id_is_refused(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    plan = pair.expect("r", PROMPT, PARAMS)
    frames = prefill_frames(pair, dataclasses.replace(plan, transfer_id="nobody-expects-me"))
    deliver(pair, "tcp", frames, read_reply=False)
    wait_for(lambda: pair.receiver.stats.busy == 0 and pair.receiver.stats.held == 0)
    assert_untouched(pair, pair.receiver_handle(plan))
    pair.receiver.cancel("r")
    settle(pair, pair.receiver_handle(plan))


def test_replies_count_only_when_tagged_unless_they_refuse() -> None:
    """A sender believes an untagged (or wrongly tagged) reply only when it refuses: it may
    fail a transfer (so could a reset connection), never complete it."""
    key = new_key()
    mac = FrameMac(key, "t")

    def read(reply: TransferReply, tag_with: FrameMac | None) -> TransferReply:
        data = b"".join(bytes(p) for p in record_frame(FrameKind.REPLY, reply, tag_with))
        return BlobReader(BytesSource(data), mac).read_reply(float("inf"))

    for outcome in (ReplyOutcome.COMMITTED, ReplyOutcome.DUPLICATE, ReplyOutcome.ACCEPTED):
        assert read(TransferReply("t", outcome), mac).outcome == outcome
        for forger in (None, FrameMac(new_key(), "t"), FrameMac(key, "other transfer")):
            with pytest.raises(ChecksumMismatch):
                read(TransferReply("t", outcome), forger)
    refusal = TransferReply("t", ReplyOutcome.REJECTED, "HeaderMismatch", "no import")
    assert read(refusal, None) == refusal


def test_each_plan_carries_a_fresh_secret_key(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    plans = [pair.expect(f"r{i}", PROMPT, PARAMS) for i in range(3)]
    keys = {plan.key for plan in plans}
    assert len(keys) == 3 and all(len(k) == KEY_BYTES for k in keys)
    assert all(plan.key.hex() not in repr(plan) for plan in plans)  # never in logs
    for msg in (P.KVPlanReady("r0", plans[0]), P.KVPlan("r0", plans[0])):
        assert P.decode(P.encode(msg)) == msg  # the control plane carries it intact
    items = msgpack.unpackb(P.encode(P.KVPlan("r0", plans[0])))
    assert items[2][-1] == plans[0].key  # the plan's last field
    for bad in (b"short", plans[0].key.hex(), None):
        items[2][-1] = bad
        with pytest.raises(ProtocolError):
            P.decode(msgpack.packb(items))
    with pytest.raises(ValueError):
        TransferPlan("t", "r", None, "tcp://127.0.0.1:1", 0, 3, 1.0, key=b"short")
    for plan in plans:
        pair.receiver.cancel(plan.request_id)
        settle(pair, pair.receiver_handle(plan))


def test_each_tag_has_its_own_one_time_key() -> None:
    """Poly1305 keys are one-time: every tag draws a fresh nonce, so a frame sent twice or
    two replies never share a key; a tag holds only for its body, position and transfer."""
    from splitserve.transfer.blob import FrameKind
    from splitserve.transfer.mac import FrameMac, new_key
    key = new_key()
    mac = FrameMac(key, "t-1")
    first, second = (mac.tag(FrameKind.LAYER, 0, 3, [b"abc"]) for _ in range(2))
    assert first != second and first[:16] != second[:16]
    assert mac.verify(FrameKind.LAYER, 0, b"abc", first)
    assert mac.verify(FrameKind.LAYER, 0, b"abc", second)
    assert not mac.verify(FrameKind.LAYER, 0, b"abd", first)  # another body
    assert not mac.verify(FrameKind.LAYER, 1, b"abc", first)  # another layer
    assert not mac.verify(FrameKind.TRAILER, 0, b"abc", first)  # another kind
    assert not FrameMac(key, "t-2").verify(FrameKind.LAYER, 0, b"abc", first)  # transfer
    assert not FrameMac(new_key(), "t-1").verify(FrameKind.LAYER, 0, b"abc", first)  # key
    forged = first[:16] + bytes(16)
    assert not mac.verify(FrameKind.LAYER, 0, b"abc", forged)
