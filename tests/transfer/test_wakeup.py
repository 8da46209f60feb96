"""Transfers wake the engine thread instead of its polling them every few ms: the wake-up
flag (transfer/wakeup.py), the transfers that raise it, and the worker's control socket
that sleeps on it beside the frontend's messages."""
from __future__ import annotations

import dataclasses
import select
import threading
import time
from collections.abc import Callable

from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.worker.control import FrontendSocket
from splitserve.engine.output import RequestOutput
from splitserve.transfer.transport import TransferState
from splitserve.transfer.wakeup import Wakeup
from tests.transfer.conftest import PARAMS, PROMPT, Pair


def readable(wakeup: Wakeup) -> bool:
    return bool(select.select([wakeup.fileno()], [], [], 0)[0])


def test_a_wakeup_is_readable_while_set_and_once_cleared_is_not() -> None:
    wakeup = Wakeup()
    assert not wakeup.is_set() and not readable(wakeup) and not wakeup.wait(0.01)
    wakeup.set()
    wakeup.set()  # twice: still one event to clear
    assert wakeup.is_set() and readable(wakeup) and wakeup.wait(0)
    wakeup.clear()
    assert not wakeup.is_set() and not readable(wakeup)
    wakeup.close()
    wakeup.set()  # a transfer thread finishing after its receiver closed: nothing happens
    wakeup.clear()


def test_a_set_from_another_thread_ends_a_wait_at_once() -> None:
    wakeup = Wakeup()
    threading.Timer(0.05, wakeup.set).start()
    start = time.monotonic()
    assert wakeup.wait(10.0)
    assert time.monotonic() - start < 5.0
    wakeup.close()


def test_the_control_socket_wakes_for_a_transfer_not_only_for_messages() -> None:
    link = WorkerLink(Metrics())
    identity = b"decode-0:1"
    worker = FrontendSocket(link.address, identity, link.enroll(identity), send_timeout_s=5)
    wakeup = Wakeup()
    try:
        threading.Timer(0.05, wakeup.set).start()
        start = time.monotonic()
        assert worker.receive(10.0, [wakeup.fileno()]) == []  # woken, no message
        assert time.monotonic() - start < 5.0
        wakeup.clear()
        start = time.monotonic()
        assert worker.receive(0.2, [wakeup.fileno()]) == []  # cleared: the whole timeout
        assert time.monotonic() - start >= 0.15
    finally:
        wakeup.close()
        worker.close(linger_ms=0)
        link.close()


def test_a_transfer_raises_the_wakeups_of_both_sides(make_pair: Callable[..., Pair]) -> None:
    # the receiver's when layers and the trailer arrive, the sender's when the answer
    # ends the transfer; each cleared by its side's poll
    pair = make_pair("tcp")
    plan = pair.expect("r", PROMPT, PARAMS)
    pair.a.engine.add_request("r", PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              hold_kv=True)
    send = pair.sender.start("r", plan)
    recv = pair.receiver_handle(plan)
    outs: list[RequestOutput] = []
    while not outs:
        outs = pair.a.engine.step()
    pair.sender.poll(outs)  # ends the stream with its trailer
    deadline = time.monotonic() + 30
    while not recv.poll().is_terminal:
        assert time.monotonic() < deadline
        assert pair.receiver.wakeup.wait(10.0), "a transfer in flight never woke the receiver"
        pair.receiver.poll()
    assert recv.poll().state == TransferState.DONE
    assert pair.sender.wakeup.wait(10.0), "the transfer's end did not wake the sender"
    assert pair.sender.poll() == [send]  # its KV released
    assert not pair.sender.wakeup.is_set() and not readable(pair.sender.wakeup)
    pair.decode(recv)
