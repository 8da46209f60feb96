"""Fault injection (DESIGN.md 7): a sender process killed or frozen mid-transfer, a receiver
that never answers, a transfer nobody sends, duplicates and cancellations. Every wait ends
at a deadline and every block reserved or held on either side goes back to its pool."""
from __future__ import annotations

import dataclasses
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from splitserve.errors import (TransferCancelled, TransferRejected, TransferTimeout,
                               TruncatedTransfer)
from splitserve.transfer.blob import (PRELUDE, BlobReader, FrameKind, ReplyOutcome,
                                      TransferReply, record_frame)
from splitserve.transfer.mac import FrameMac, new_key
from splitserve.transfer.transport import TransferState, get_transport
from tests.transfer.conftest import (DEADLINE_S, PARAMS, PROMPT, Pair, deliver, prefill_frames,
                                     run_to_end, sender_mac, settle)

ROOT = Path(__file__).resolve().parents[2]

# A sender process: connects, sends the header, waits for ACCEPTED, sends the rest of the
# file (a prefix of a valid stream, cut inside a layer), says "sent", then waits to be killed.
# TCP uses a plain socket (no splitserve import: starts in milliseconds); shm uses the
# transport module, which imports no torch.
_SENDER = r"""
import sys, time
transport, address, path, header_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
data = open(path, "rb").read()
if transport == "tcp":
    import socket
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    send, recv = sock.sendall, lambda n: sock.recv(n, socket.MSG_WAITALL)
else:
    from splitserve.transfer.shm import ShmTransport
    chan = ShmTransport().connect(address, time.monotonic() + 30)
    send = lambda b: chan.send([b], time.monotonic() + 30)
    def recv(n):
        buf = bytearray(n)
        chan.recv_into(memoryview(buf), time.monotonic() + 30)
        return bytes(buf)
send(data[:header_len])
size = int.from_bytes(recv(48)[8:16], "little")  # the 48-byte prelude's body_len
recv(size)  # the ACCEPTED reply
send(data[header_len:])
print("sent", flush=True)
time.sleep(120)
"""


@pytest.fixture
def spawn_sender(tmp_path: Path) -> Iterator[Callable[[str, str, list[bytes]], subprocess.Popen]]:
    procs: list[subprocess.Popen] = []

    def spawn(transport: str, address: str, frames: list[bytes]) -> subprocess.Popen:
        partial = b"".join(frames[1:2]) + frames[2][:len(frames[2]) // 2]  # layer 0 + half of 1
        path = tmp_path / "stream.bin"
        path.write_bytes(frames[0] + partial)
        proc = subprocess.Popen(
            [sys.executable, "-c", _SENDER, transport, address, str(path), str(len(frames[0]))],
            stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        assert ready and proc.stdout.readline().strip() == b"sent", "sender did not start"
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=DEADLINE_S)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_sender_killed_mid_transfer(make_pair: Callable[..., Pair], spawn_sender: Callable,
                                    transport: str) -> None:
    pair = make_pair(transport)
    plan = pair.expect("r", PROMPT, PARAMS, timeout_s=DEADLINE_S)
    proc = spawn_sender(transport, plan.address, prefill_frames(pair, plan))
    recv = pair.receiver_handle(plan)
    pair.receiver.poll()
    assert recv.poll().state == TransferState.TRANSFERRING
    assert pair.b.engine.load().kv_blocks_used == 3  # reserved for the 37-token prompt
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    settle(pair, recv)
    assert time.monotonic() - killed < DEADLINE_S  # noticed from the closed stream, not a timer
    assert isinstance(recv.poll().error, TruncatedTransfer)
    assert pair.b.engine.load().kv_blocks_used == 0
    assert pair.b.engine.request_state("r") is None
    pair.b.engine.check_invariants()


def test_frozen_sender_hits_the_receiver_deadline(make_pair: Callable[..., Pair],
                                                  spawn_sender: Callable) -> None:
    pair = make_pair("tcp")
    plan = pair.expect("r", PROMPT, PARAMS, timeout_s=1.0)
    proc = spawn_sender("tcp", plan.address, prefill_frames(pair, plan))
    proc.send_signal(signal.SIGSTOP)  # alive, connection open, sending nothing
    recv = pair.receiver_handle(plan)
    settle(pair, recv)
    assert isinstance(recv.poll().error, TransferTimeout)
    assert pair.b.engine.load().kv_blocks_used == 0
    pair.b.engine.check_invariants()
    proc.send_signal(signal.SIGKILL)


class SilentReceiver:
    """Accepts a transfer's header, swallows every byte after it, never gives a verdict:
    a decode worker that hangs (or dies after reading) from the sender's point of view."""

    def __init__(self, key: bytes) -> None:
        self.key = key  # of the plan it "issued": its ACCEPTED is tagged like a real one
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = "tcp://127.0.0.1:%d" % self._sock.getsockname()[1]
        self.num_bytes = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._sock.accept()
        with conn:
            prelude = conn.recv(PRELUDE.size, socket.MSG_WAITALL)
            size = PRELUDE.unpack(prelude)[4]
            conn.recv(size, socket.MSG_WAITALL)
            transfer_id = "silent"
            reply = record_frame(FrameKind.REPLY, TransferReply(transfer_id, ReplyOutcome.ACCEPTED),
                                 FrameMac(self.key, transfer_id))
            conn.sendall(b"".join(bytes(p) for p in reply))
            while data := conn.recv(1 << 16):
                self.num_bytes += len(data)

    def close(self) -> None:
        self._sock.close()


def test_sender_lease_expiry_frees_its_blocks_exactly_once(make_llm: Callable) -> None:
    from splitserve.transfer.handle import TransferPlan
    from splitserve.transfer.sender import KVSender
    a = make_llm()
    sender = KVSender(a.engine)
    silent = SilentReceiver(new_key())
    plan = TransferPlan("silent", "r", None, silent.address, 0, len(PROMPT), timeout_s=1.0,
                        key=silent.key)
    a.engine.add_request("r", PROMPT, dataclasses.replace(PARAMS, max_tokens=1), hold_kv=True)
    send = sender.start("r", plan)
    sender.poll(a.engine.step())  # the prefill, then its KV held under the lease
    assert a.engine.load().kv_blocks_used == 3
    deadline = time.monotonic() + DEADLINE_S
    finished: list = []
    while not finished:  # the engine thread's poll releases the KV once the lease is over
        assert time.monotonic() < deadline
        finished = sender.poll()
        time.sleep(0.01)
    assert finished == [send] and isinstance(send.poll().error, TransferTimeout)
    assert a.engine.load().kv_blocks_used == 0 and sender.num_released == 1
    assert sender.poll() == []
    a.engine.release_kv("r")  # idempotent, and nothing is freed twice
    assert sender.num_released == 1
    a.engine.check_invariants()
    sender.close()
    silent.close()


@pytest.mark.parametrize("recompute", [False, True])
def test_kv_that_never_arrives(make_pair: Callable[..., Pair], recompute: bool) -> None:
    pair = make_pair("tcp")
    plan = pair.expect("r", PROMPT, PARAMS, timeout_s=0.3, recompute=recompute)
    recv = pair.receiver_handle(plan)
    settle(pair, recv)
    assert isinstance(recv.poll().error, TransferTimeout)
    if recompute:  # prefilled locally instead, to the same tokens
        out = run_to_end(pair.b, "r")
        assert out.token_ids == pair.a.generate(PROMPT, PARAMS)[0].token_ids
    assert pair.b.engine.load().kv_blocks_used == 0
    pair.b.engine.check_invariants()


def test_duplicate_delivery_is_detected_and_ignored(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    plan = pair.expect("r", PROMPT, PARAMS)
    frames = prefill_frames(pair, plan)
    # A second delivery arriving while the first is in flight is refused...
    first = get_transport("tcp").connect(plan.address, time.monotonic() + DEADLINE_S)
    first.send([frames[0]], time.monotonic() + DEADLINE_S)
    reader = BlobReader(first, sender_mac(pair, frames[0]))
    assert reader.read_reply(time.monotonic() + DEADLINE_S).outcome == ReplyOutcome.ACCEPTED
    busy = deliver(pair, "tcp", frames)
    assert busy is not None and busy.outcome == ReplyOutcome.REJECTED
    assert busy.error_kind == "DuplicateTransfer"
    # ... the first completes and commits once ...
    first.send(frames[1:], time.monotonic() + DEADLINE_S)
    recv = pair.receiver_handle(plan)
    settle(pair, recv)
    assert reader.read_reply(time.monotonic() + DEADLINE_S).outcome == ReplyOutcome.COMMITTED
    first.close()
    # ... and a replay after the commit is answered DUPLICATE without touching anything.
    used = pair.b.engine.load().kv_blocks_used
    again = deliver(pair, "tcp", frames)
    assert again is not None and again.outcome == ReplyOutcome.DUPLICATE
    pair.receiver.poll()
    assert pair.b.engine.load().kv_blocks_used == used
    tokens = pair.decode(recv)
    assert tokens == pair.a.generate(PROMPT, PARAMS)[0].token_ids


def test_sender_cancel_fails_both_sides_and_frees_everything(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("shm")
    plan = pair.expect("r", PROMPT, PARAMS)
    pair.a.engine.add_request("r", PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              hold_kv=True)
    send = pair.sender.start("r", plan)
    deadline = time.monotonic() + DEADLINE_S
    while send.poll().state == TransferState.PENDING:  # until B accepted the header
        assert time.monotonic() < deadline
        time.sleep(0.002)
    pair.sender.cancel("r")
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert isinstance(send.poll().error, TransferCancelled)
    assert isinstance(recv.poll().error, (TruncatedTransfer, TransferRejected))
    assert pair.sender.num_released == 1


def test_prefill_abort_cancels_the_transfer(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    # Nothing reaches D when P aborts before its first token: D's import ends at its own
    # deadline (in a cluster the frontend aborts it at once), well before pump's.
    plan = pair.expect("r", PROMPT, PARAMS, timeout_s=2.0)
    pair.a.engine.add_request("r", PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              hold_kv=True)
    send = pair.sender.start("r", plan)
    aborted = pair.a.engine.abort("r")
    assert aborted is not None
    pair.sender.poll([aborted])
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert isinstance(send.poll().error, TransferCancelled)
    assert recv.poll().state == TransferState.FAILED


def test_expect_waits_for_room_and_close_frees_everything(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc", b_kwargs={"num_blocks": 4})  # room for one 37-token prompt
    first = pair.expect("r1", PROMPT, PARAMS)
    pair.b.engine.add_request("r2", list(range(50, 87)), PARAMS, await_kv=True)
    assert pair.receiver.expect("r2") is None  # no blocks yet: ask again later
    pair.a.engine.add_request("r1", PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              hold_kv=True)
    pair.sender.start("r1", first)  # closing mid-prefill aborts it and frees its blocks
    pair.sender.close()
    pair.receiver.close()  # fails r1's import and releases its blocks
    pair.b.engine.abort("r2")
    assert pair.a.engine.load().kv_blocks_used == pair.b.engine.load().kv_blocks_used == 0


@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp"])
def test_idle_channel_to_a_restarted_receiver_is_replaced(make_pair: Callable[..., Pair],
                                                          transport: str) -> None:
    """The decode side restarts at the same address between two transfers: the sender's
    idle channel is dead, its liveness check sees it, and a fresh channel carries on."""
    pair = make_pair(transport)
    _, first, _ = pair.handoff("r1", PROMPT, PARAMS)
    assert first.poll().state == TransferState.DONE
    address = pair.receiver.address
    pair.receiver.close()
    if transport == "shm":  # the first listener's private directory went with it
        Path(address.removeprefix("shm://")).parent.mkdir()
    listener = get_transport(transport).listen(address)
    pair.receiver = type(pair.receiver)(pair.b.engine, listener)
    tokens, second, _ = pair.handoff("r2", PROMPT, PARAMS)
    assert second.poll().state == TransferState.DONE
    assert not second.telemetry.reused_channel  # a fresh channel carried it
    assert tokens == pair.a.generate(PROMPT, PARAMS)[0].token_ids
    if transport == "shm":
        pair.receiver.close()
        Path(address.removeprefix("shm://")).parent.rmdir()
