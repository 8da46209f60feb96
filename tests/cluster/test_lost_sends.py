"""Messages lost at ZeroMQ's high-water mark are detected, not only logged (issue 16 item
6; frontend/delivery.py): real sockets with tiny high-water marks and peers that do not
read. A lost request message takes the worker out and the request goes on elsewhere (or
fails with a clear error); other messages are resent, then the worker is marked dead.
The worker's own sends time out instead of blocking its engine thread."""
from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import ControlAuthenticator, KeyRing, ServerKeys, WorkerSecret
from splitserve.cluster.frontend.delivery import RESEND_DELAYS_S
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend import link as link_module
from splitserve.cluster.frontend.link import LostSend, WorkerLink
from splitserve.cluster.frontend.metrics import LostReason, Metrics
from splitserve.cluster.frontend.recovery import RetryPolicy
from splitserve.cluster.worker.control import FrontendSocket
from splitserve.errors import WorkerFailed
from tests.cluster.test_control_auth import until
from tests.cluster.test_dispatcher import ScriptedWorker, collect, output, request, run

FILLER = P.encode(P.EvictBlocks([bytes(16)] * 50_000))  # ~0.9 MB


@pytest.fixture(autouse=True)
def tiny_send_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short queue per worker on the frontend's side (links made in these tests), so a
    worker that does not read fills it with a few MB; healthy ones never do."""
    monkeypatch.setattr(link_module, "SEND_HWM", 16)


def lost(d: Dispatcher, message: str) -> float:
    return sum(d.metrics.registry.get_sample_value(
        "splitserve_control_sends_lost_total", {"message": message, "reason": r.value}) or 0.0
        for r in LostReason)


class SlowReader(ScriptedWorker):
    """A scripted worker whose socket queues one message (its receive high-water mark
    must be set before it connects)."""

    def __init__(self, ctx: zmq.asyncio.Context, d: Dispatcher, role: str, index: int) -> None:
        self.max_num_seqs, self.role = 8, P.Role(role)
        self.worker_id = f"{role}-{index}"
        identity = f"{self.worker_id}:1".encode()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        d.link.enroll(identity).connect(self.sock)
        self.sock.connect(d.address)


async def stuck_worker(d: Dispatcher, ctx: zmq.asyncio.Context, role: str = "both",
                       index: int = 0) -> ScriptedWorker:
    """A registered worker that stops reading, with the frontend's queue to it full: the
    next send to it is refused (EAGAIN) until it reads again."""
    w = SlowReader(ctx, d, role, index=index)
    await w.register()
    await until(lambda: w.worker_id in d.table.by_id)
    router: zmq.Socket[bytes] = zmq.Socket.shadow(d.link.sock.underlying)
    identity = d.table.by_id[w.worker_id].identity
    refused = 0
    for _ in range(500):  # loopback TCP buffers take a few MB
        try:
            router.send_multipart([identity, FILLER], zmq.NOBLOCK)
            refused = 0
        except zmq.Again:
            refused += 1
            if refused == 3:  # full, and it stays full: nothing drains it any more
                return w
            await asyncio.sleep(0.1)
    raise AssertionError("the queue to the worker never filled")


def test_the_link_reports_a_lost_send_with_its_message() -> None:
    async def main() -> None:
        link = WorkerLink(Metrics())
        reports: list[LostSend] = []
        link.on_lost = reports.append
        link.send(b"nobody:1", P.Abort("r1"))  # no such peer (ROUTER_MANDATORY)
        assert not reports  # reported on a later turn of the loop, never inside send()
        await until(lambda: len(reports) == 1)
        assert reports[0].msg == P.Abort("r1") and reports[0].identity == b"nobody:1"
        assert reports[0].reason is LostReason.UNREACHABLE and reports[0].num_resends == 0
        link.close()
    asyncio.run(main())


def test_a_lost_generate_goes_to_another_worker_and_completes() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        stuck = await stuck_worker(d, ctx)
        task = asyncio.create_task(collect(d.generate(request())))
        # Lost: the stuck worker is out at once, the attempt waits for another worker.
        await until(lambda: "both-0" not in d.table.by_id and bool(d.flights.stranded))
        assert lost(d, "Generate") == 1
        healthy = ScriptedWorker(ctx, d, "both", index=1)
        await healthy.register()
        gen = await healthy.expect(P.Generate)
        assert gen.request_id == "r1#1"
        await healthy.send(output("r1#1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]
        del stuck
    run(scenario, retry=RetryPolicy(wait_for_restarts=True))


def test_a_lost_generate_with_nowhere_to_go_fails_clearly_and_at_once() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        await stuck_worker(d, ctx)
        t0 = time.monotonic()
        with pytest.raises(WorkerFailed, match="did not take Generate"):
            await collect(d.generate(request()))
        assert time.monotonic() - t0 < 5.0  # at once: no stage deadline was waited for
        assert not d.table.workers
    run(scenario)


def test_a_lost_prefill_retries_the_request() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        dec = ScriptedWorker(ctx, d, "decode")
        await dec.register()
        await stuck_worker(d, ctx, "prefill")
        task = asyncio.create_task(collect(d.generate(request())))
        assert (await dec.expect(P.Generate)).request_id == "r1"
        # The prefill worker is out; the retry prefills on the decode worker itself.
        retry = await dec.expect(P.Generate)
        assert retry.request_id == "r1#1" and not retry.await_kv
        await dec.send(output("r1#1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]
        assert lost(d, "Prefill") == 1
    run(scenario, policy="always")


def test_a_lost_abort_is_resent_then_the_worker_is_marked_dead() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        await stuck_worker(d, ctx)
        d.link.send(d.table.by_id["both-0"].identity, P.Abort("r9"))
        t0 = time.monotonic()
        await until(lambda: "both-0" not in d.table.by_id, 10)
        assert time.monotonic() - t0 >= sum(RESEND_DELAYS_S) * 0.9
        assert lost(d, "Abort") == 1 + len(RESEND_DELAYS_S)
    run(scenario)


def test_a_resent_message_arrives_once_the_worker_reads_again() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        w = await stuck_worker(d, ctx)
        d.link.send(d.table.by_id["both-0"].identity, P.ResyncKV())
        await until(lambda: lost(d, "ResyncKV") == 1)
        await w.expect(P.ResyncKV, 5)  # it reads again: the resend gets through
        assert "both-0" in d.table.by_id and lost(d, "ResyncKV") < 1 + len(RESEND_DELAYS_S)
    run(scenario)


def test_a_worker_s_send_times_out_when_the_frontend_does_not_read() -> None:
    """The worker's socket against a frontend that never reads: sends are taken until
    the queues are full, then one fails after the send timeout instead of blocking."""
    ctx = zmq.Context()
    keys, server = KeyRing(), ServerKeys.generate()
    auth = ControlAuthenticator(ctx, keys)
    auth.start()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVHWM, 1)  # before bind: accepted connections copy it
    server.serve(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    identity = b"decode-0:1"
    secret = WorkerSecret.generate(server.public)
    keys.allow(identity, secret.client_public)
    worker = FrontendSocket(f"tcp://127.0.0.1:{port}", identity, secret, send_timeout_s=0.2,
                            send_hwm=1)
    try:
        sent = 0
        while worker.send(P.KVSnapshot(1, [bytes(16)] * 50_000)):
            sent += 1
            assert sent < 500, "the frontend's queue never filled"
        assert sent >= 1  # the first sends went through
        t0 = time.monotonic()
        assert not worker.send(P.LoadReport(0, 0, 0, 0, 0, 1))
        assert 0.15 <= time.monotonic() - t0 < 5.0  # the timeout, not forever
    finally:
        worker.close()
        router.close()
        auth.stop()
        ctx.term()
