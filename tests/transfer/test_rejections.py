"""The receiver rejects incompatible, corrupted or incomplete KV with a typed error, commits
nothing, and returns every reserved block to its pool."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import pytest

from splitserve import SamplingParams
from splitserve.errors import (ChecksumMismatch, FingerprintMismatch, HeaderMismatch,
                               KVTransferError, TransferRejected, TruncatedTransfer)
from splitserve.transfer.blob import PRELUDE, BlobReader, ReplyOutcome, TransferReply
from splitserve.transfer.handle import TransferHandle
from splitserve.transfer.transport import TransferState, get_transport
from tests.transfer.conftest import (DEADLINE_S, PARAMS, PROMPT, TRANSPORTS, Pair, deliver,
                                     prefill_frames, sender_mac, settle)


def assert_rejected(pair: Pair, handle: TransferHandle, error: type[KVTransferError],
                    reply: TransferReply | None = None) -> None:
    """FAILED with `error`, nothing committed, every reserved block back in B's pool."""
    settle(pair, handle)
    status = handle.poll()
    assert status.state == TransferState.FAILED and isinstance(status.error, error), status
    assert handle.output is None
    engine = pair.b.engine
    assert engine.request_state(handle.request_id) is None  # dropped, not running
    assert engine.load().kv_blocks_used == 0
    engine.check_invariants()
    if reply is not None:
        assert reply.outcome == ReplyOutcome.REJECTED and reply.error_kind == error.__name__


@pytest.mark.parametrize("other", [{"model": "qwen2"}, {"dtype": "bfloat16"},
                                   {"block_size": 8}], ids=["model", "dtype", "block_size"])
def test_wrong_fingerprint(make_pair: Callable[..., Pair], tiny_qwen2_dir: str,
                           other: dict[str, str | int]) -> None:
    if other.get("model") == "qwen2":
        other = {"model": tiny_qwen2_dir}
    pair = make_pair("tcp", a_kwargs=other)
    plan = pair.expect("r", PROMPT, PARAMS)
    pair.a.engine.add_request("r", PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              hold_kv=True)
    send = pair.sender.start("r", plan)
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert_rejected(pair, recv, FingerprintMismatch)
    error = send.poll().error
    assert isinstance(error, TransferRejected) and error.remote_kind == "FingerprintMismatch"
    assert pair.sender.num_released == 1 and pair.a.engine.load().kv_blocks_used == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_flipped_byte_in_a_payload(make_pair: Callable[..., Pair], transport: str) -> None:
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS)
    frames = prefill_frames(pair, plan)
    layer1 = bytearray(frames[2])
    layer1[PRELUDE.size + 1000] ^= 0x01
    frames[2] = bytes(layer1)
    reply = deliver(pair, transport, frames)
    assert_rejected(pair, pair.receiver_handle(plan), ChecksumMismatch, reply)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_truncated_stream(make_pair: Callable[..., Pair], transport: str) -> None:
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS)
    frames = prefill_frames(pair, plan)
    cut = frames[0] + frames[1] + frames[2][:len(frames[2]) // 2]  # header, layer 0, half of 1
    deliver(pair, transport, [cut], read_reply=False)
    assert_rejected(pair, pair.receiver_handle(plan), TruncatedTransfer)


def test_header_from_another_request(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    plan = pair.expect("r", PROMPT, PARAMS)
    other = list(range(2000, 2037))
    frames = prefill_frames(pair, dataclasses.replace(plan, request_id="other"), other)
    reply = deliver(pair, "inproc", frames)
    assert_rejected(pair, pair.receiver_handle(plan), HeaderMismatch, reply)
    assert "request" in reply.message if reply else False


def test_same_request_id_but_other_tokens(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    plan = pair.expect("r", PROMPT, PARAMS)
    frames = prefill_frames(pair, plan, list(range(2000, 2037)))
    reply = deliver(pair, "inproc", frames)
    assert_rejected(pair, pair.receiver_handle(plan), HeaderMismatch, reply)
    assert reply is not None and "block hashes" in reply.message


def test_mismatched_namespace(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    plan = pair.expect("r", PROMPT, PARAMS, namespace="tenant-a")
    pair.a.engine.add_request("r", PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              namespace="tenant-b", hold_kv=True)
    send = pair.sender.start("r", plan, namespace="tenant-b")
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert_rejected(pair, recv, HeaderMismatch)
    assert "namespace" in str(recv.poll().error)


def test_wrong_token_range(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    shared = PROMPT[:32]
    pair.b.generate(shared, SamplingParams(max_tokens=1))  # B will only import [32, 37)
    plan = pair.expect("r", PROMPT, PARAMS)
    assert plan.start_token == 32
    frames = prefill_frames(pair, dataclasses.replace(plan, start_token=0))
    reply = deliver(pair, "inproc", frames)
    assert_rejected(pair, pair.receiver_handle(plan), HeaderMismatch, reply)


def test_unknown_transfer_is_refused_without_touching_others(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    plan = pair.expect("r", PROMPT, PARAMS)
    frames = prefill_frames(pair, dataclasses.replace(plan, transfer_id="nobody-expects-me"))
    reply = deliver(pair, "inproc", frames)
    assert reply is not None and reply.outcome == ReplyOutcome.REJECTED
    assert reply.error_kind == "HeaderMismatch"
    recv = pair.receiver_handle(plan)
    pair.receiver.poll()
    assert recv.poll().state == TransferState.PENDING  # the real import is unaffected
    pair.receiver.cancel("r")
    settle(pair, recv)
    assert pair.b.engine.load().kv_blocks_used == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_transfer_refused_at_its_header_is_drained_and_the_channel_goes_on(
        make_pair: Callable[..., Pair], transport: str) -> None:
    """Senders stream without waiting for the header's answer, so the receiver reads and
    drops the rest of a refused (but authenticated) transfer: the refusal arrives, and the
    same channel then carries a valid transfer."""
    pair = make_pair(transport)
    cancelled = pair.expect("gone", PROMPT, PARAMS)
    gone = pair.receiver_handle(cancelled)
    pair.receiver.cancel("gone")  # its sender arrives after the import ended
    settle(pair, gone)
    plan = pair.expect("r", PROMPT, PARAMS)
    late = prefill_frames(pair, cancelled)
    frames = prefill_frames(pair, plan)
    chan = get_transport(transport).connect(pair.receiver.address,
                                            time.monotonic() + DEADLINE_S)
    try:
        reader = BlobReader(chan, sender_mac(pair, late[0]))
        chan.send(late, time.monotonic() + DEADLINE_S)
        refused = reader.read_reply(time.monotonic() + DEADLINE_S)
        assert refused.outcome == ReplyOutcome.REJECTED
        assert refused.error_kind == "TransferCancelled"
        reader = BlobReader(chan, sender_mac(pair, frames[0]))
        chan.send(frames, time.monotonic() + DEADLINE_S)
        assert reader.read_reply(time.monotonic() + DEADLINE_S).outcome == ReplyOutcome.ACCEPTED
        recv = pair.receiver_handle(plan)
        settle(pair, recv)
        assert reader.read_reply(time.monotonic() + DEADLINE_S).outcome == ReplyOutcome.COMMITTED
        assert chan.is_quiet()  # in step: nothing more to read, still open
    finally:
        chan.close()
    assert pair.decode(recv) == pair.a.generate(PROMPT, PARAMS)[0].token_ids
