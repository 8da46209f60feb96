"""The dispatcher against scripted workers: real ZeroMQ sockets speaking protocol.py, no
engines (the real workers are tested end to end in tests/api/test_serving_e2e.py)."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend.recovery import RetryPolicy
from splitserve.cluster.router.router import Router, RouterConfig
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.config import DeadlineConfig
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import InvalidRequestError, RequestTimeout, WorkerFailed
from splitserve.transfer.handle import TransferPlan

FINGERPRINT = "f" * 32
PLAN = TransferPlan("t1", "r1", None, "tcp://127.0.0.1:1", 0, 3, 5.0)


class ScriptedWorker:
    """A worker's socket, driven by the test; enrolled with the dispatcher's link as the
    launcher does (its own CURVE keypair, cluster/auth.py)."""

    def __init__(self, ctx: zmq.asyncio.Context, d: Dispatcher, role: str, index: int = 0,
                 epoch: int = 1, max_num_seqs: int = 8) -> None:
        self.max_num_seqs = max_num_seqs
        self.worker_id = f"{role}-{index}"
        self.identity = f"{self.worker_id}:{epoch}".encode()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        d.link.enroll(self.identity).connect(self.sock)
        self.sock.connect(d.address)
        self.role = P.Role(role)

    async def register(self) -> None:
        address = "tcp://127.0.0.1:1" if self.role.can_decode else None
        await self.send(P.WorkerReady(self.worker_id, self.role, 1, FINGERPRINT, 16, 100, 2048,
                                      self.max_num_seqs, address, 1000))

    async def send(self, msg: P.Message) -> None:
        await self.sock.send(P.encode(msg))

    async def recv(self, timeout_s: float = 5.0) -> P.Message:
        frame = await asyncio.wait_for(self.sock.recv(), timeout_s)
        return P.decode(frame)

    async def expect(self, kind: type, timeout_s: float = 5.0) -> Any:
        while True:  # skip what the test does not look at (e.g. ResyncKV)
            msg = await self.recv(timeout_s)
            if isinstance(msg, kind):
                return msg


def output(rid: str, offset: int, tokens: list[int], text_offset: int, text: str,
           finished: bool = False) -> P.Output:
    return P.Output(rid, offset, tokens, text_offset, text, offset, None, finished,
                    "length" if finished else None, None, 3, 0)


Scenario = Callable[[Dispatcher, zmq.asyncio.Context], Awaitable[None]]


def run(scenario: Scenario, deadlines: DeadlineConfig | None = None,
        policy: str = "auto", max_queue_len: int = 256,
        router_config: RouterConfig | None = None, **kwargs: Any) -> None:
    async def main() -> None:
        dispatcher = Dispatcher(Router(router_config or RouterConfig(disagg=policy)),
                                deadlines or DeadlineConfig(), max_queue_len=max_queue_len,
                                **kwargs)
        dispatcher.start()
        ctx = zmq.asyncio.Context()
        try:
            await asyncio.wait_for(scenario(dispatcher, ctx), 20)
        finally:
            await dispatcher.close()
            ctx.destroy(linger=0)
    asyncio.run(main())


async def workers(d: Dispatcher, ctx: zmq.asyncio.Context, *roles: str) -> list[ScriptedWorker]:
    ws = [ScriptedWorker(ctx, d, role) for role in roles]
    for w in ws:
        await w.register()
    await d.wait_for_workers(len(ws), 5)
    return ws


def request(rid: str = "r1", max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(rid, [1, 2, 3], SamplingParams(temperature=0, max_tokens=max_tokens))


async def collect(stream: AsyncIterator[StreamDelta]) -> list[StreamDelta]:
    """The stream's deltas after its placement mark (checked to come first)."""
    deltas = [delta async for delta in stream]
    assert deltas and deltas[0].is_placement, deltas[:1]
    return deltas[1:]


def test_local_request_streams_and_draws_a_seed() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        assert d.router.kv_layout.kv_bytes_per_token == 1000  # learnt from WorkerReady
        task = asyncio.create_task(collect(d.generate(request())))
        gen = await w.expect(P.Generate)
        assert not gen.await_kv and gen.params.seed is not None  # drawn by the frontend
        await w.send(output("r1", 0, [7], 0, "a"))
        await w.send(output("r1", 1, [8], 1, "b", finished=True))
        deltas = await task
        assert [x.token_ids for x in deltas] == [[7], [8]] and deltas[-1].finished
        assert not d.flights and d.health()["in_flight"] == 0
    run(scenario)


def test_a_stream_opens_with_its_placement_before_any_token() -> None:
    # the HTTP layer starts a streamed response at it, while the worker prefills
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        stream = d.generate(request())
        mark = await asyncio.wait_for(stream.__anext__(), 5.0)  # no output sent yet
        assert mark.is_placement and mark.num_prompt_tokens == 3
        await w.expect(P.Generate)
        await w.send(output("r1", 0, [7], 0, "a", finished=True))
        delta = await asyncio.wait_for(stream.__anext__(), 5.0)
        assert delta.token_ids == [7] and not delta.is_placement
        await stream.aclose()
    run(scenario)


def test_a_batch_of_outputs_is_merged_as_if_each_came_alone() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        one = asyncio.create_task(collect(d.generate(request("r1"))))
        two = asyncio.create_task(collect(d.generate(request("r2"))))
        await w.expect(P.Generate)
        await w.expect(P.Generate)
        await w.send(P.OutputBatch([output("r1", 0, [7], 0, "a"), output("r2", 0, [4], 0, "c")]))
        await w.send(P.OutputBatch([output("r1", 1, [8], 1, "b", finished=True),
                                    output("r2", 1, [5], 1, "d", finished=True)]))
        assert [x.token_ids for x in await one] == [[7], [8]]
        assert [x.text for x in await two] == ["c", "d"]
        assert not d.flights
        # More than a step's worth is refused whole: nothing of it reaches a stream.
        three = asyncio.create_task(collect(d.generate(request("r3"))))
        await w.expect(P.Generate)
        too_many = [output("r3", i, [i], i, "x") for i in range(P.MAX_OUTPUT_BATCH + 1)]
        await w.send(P.OutputBatch(too_many))
        await w.send(output("r3", 0, [9], 0, "z", finished=True))
        assert [x.token_ids for x in await three] == [[9]]
        assert d.metrics.registry.get_sample_value(
            "splitserve_control_frames_dropped_total", {"reason": "refused"}) == 1
    run(scenario)


def test_remote_prefill_flow_merges_both_workers() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        gen = await dec.expect(P.Generate)
        pre = await p.expect(P.Prefill)  # at once: P does not wait for D's plan
        assert gen.await_kv and pre.params.seed == gen.params.seed
        await p.send(output("r1", 0, [5], 0, "x"))  # the first token, from P
        await dec.send(P.KVPlanReady("r1", PLAN))
        assert (await p.expect(P.KVPlan)).plan == PLAN  # relayed
        await p.send(P.PrefillDone("r1", handed_off=True))
        await dec.send(output("r1", 1, [6], 1, "y"))  # D goes on from token 2
        await dec.send(output("r1", 2, [9], 2, "z", finished=True))
        deltas = await task
        assert [x.token_ids for x in deltas] == [[5], [6], [9]]
        assert "".join(x.text for x in deltas) == "xyz"
        # P said it was done: nothing more is sent to it (a round trip proves it).
        await p.send(P.KVEventBatch(1, []))
        await p.send(P.KVEventBatch(3, []))
        assert isinstance(await p.recv(), P.ResyncKV)
    run(scenario, policy="always")


def test_every_placement_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        await w.send(output("r1", 0, [7], 0, "a", finished=True))
        await task
    with caplog.at_level(logging.DEBUG, logger="splitserve.cluster.frontend.routing"):
        run(scenario)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("placed")] == [
        "placed r1 (3 prompt tokens, attempt 0): prefill on both-0, decode on both-0, "
        "aggregated, 0 cached, predicted TTFT 0.03 s"]


def test_a_prefill_worker_that_never_hands_off_is_aborted() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        await dec.expect(P.Generate)
        await p.expect(P.Prefill)
        await p.send(output("r1", 0, [5], 0, "x"))
        await dec.send(output("r1", 1, [6], 1, "y", finished=True))
        await task
        assert (await p.expect(P.Abort)).request_id == "r1"
    run(scenario, policy="always")


def test_an_event_gap_asks_the_worker_for_a_snapshot() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        await w.send(P.KVEventBatch(1, []))
        await w.send(P.KVEventBatch(3, []))  # batch 2 was lost
        await w.expect(P.ResyncKV)
    run(scenario)


def test_a_silent_worker_is_removed_and_its_requests_fail() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        stream = d.generate(request())
        task = asyncio.create_task(collect(stream))
        await w.expect(P.Generate)
        with pytest.raises(WorkerFailed, match="heartbeat"):
            await task
        assert d.health()["workers"] == [] and not d.is_ready()
    run(scenario, DeadlineConfig(heartbeat_timeout_s=0.5))


def test_a_stalled_decode_times_out_and_is_aborted() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        await w.send(output("r1", 0, [7], 0, "a"))
        with pytest.raises(RequestTimeout) as err:
            await task
        assert err.value.stage == "decode"
        assert (await w.expect(P.Abort)).request_id == "r1"
    run(scenario, DeadlineConfig(decode_step_timeout_s=0.3), retry=RetryPolicy(max_retries=0))


def test_a_requests_own_deadline_wakes_the_reaper_and_an_idle_one_sleeps() -> None:
    """With the default timeouts (30 s and more) the reaper sleeps; a request that brings
    a 0.3 s deadline of its own still fails at it, not at the reaper's next routine
    wake-up. Without it, the reaper checks ~once a timeout, not 20 times a second."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        reaps: list[float] = []
        reap = d._reap

        def counted(now: float) -> None:
            reaps.append(now)
            reap(now)
        d._reap = counted  # type: ignore[method-assign]
        (w,) = await workers(d, ctx, "both")
        await asyncio.sleep(0.5)
        assert len(reaps) <= 1  # idle: asleep until the next worker's heartbeat deadline
        req = request()
        req.timeout_s = 0.3
        task = asyncio.create_task(collect(d.generate(req)))
        await w.expect(P.Generate)
        await w.send(output("r1", 0, [7], 0, "a"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(RequestTimeout) as err:
            await task
        assert err.value.stage == "request" and loop.time() - start < 1.0
    run(scenario, retry=RetryPolicy(max_retries=0))


def test_worker_errors_reach_the_caller_typed() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        await w.send(P.RequestFailed("r1", P.FailureKind.INVALID_REQUEST, "bad token",
                                     "prompt"))
        with pytest.raises(InvalidRequestError) as err:
            await task
        assert err.value.field == "prompt"
    run(scenario)


def test_closing_the_stream_aborts_on_the_worker() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        stream = d.generate(request())
        first = asyncio.create_task(stream.__anext__())
        await w.expect(P.Generate)
        await w.send(output("r1", 0, [7], 0, "a"))
        await first
        await stream.aclose()  # the client went away
        assert (await w.expect(P.Abort)).request_id == "r1"
        assert not d.flights
    run(scenario)


def test_messages_from_unknown_or_replaced_workers_are_ignored() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        stranger = ScriptedWorker(ctx, d, "both", index=7)
        await stranger.send(output("r1", 0, [666], 0, "evil", finished=True))
        new = ScriptedWorker(ctx, d, "both", epoch=2)  # a restart of both-0
        await new.register()
        retry = await new.expect(P.Generate)  # the request resumes on the new incarnation
        assert retry.request_id == "r1#1"
        await w.send(output("r1", 0, [1], 0, "old epoch", finished=True))  # fenced off
        await w.expect(P.Shutdown)  # and told to exit: the frontend has handled it
        assert not task.done() and (
            b"splitserve_fenced_messages_total 2.0" in d.metrics_text())  # stranger + old
        task.cancel()
    run(scenario)


def test_no_decode_worker_is_refused_up_front() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        from splitserve.errors import AdmissionRejected
        with pytest.raises(AdmissionRejected) as err:
            await collect(d.generate(request()))
        assert err.value.status_code == 503
        await workers(d, ctx, "prefill")
        with pytest.raises(AdmissionRejected):  # a prefill worker cannot decode
            await collect(d.generate(request()))
    run(scenario)


def test_admission_queue_is_fifo_bounded_and_times_out() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        from splitserve.errors import AdmissionRejected
        w = ScriptedWorker(ctx, d, "both", max_num_seqs=1)
        await w.register()
        await d.wait_for_workers(1, 5)
        tasks = {}
        for i, rid in enumerate(("r1", "r2", "r3")):
            tasks[rid] = asyncio.create_task(collect(d.generate(request(rid))))
            while len(d.flights) <= i:  # admitted in this order
                await asyncio.sleep(0)
        assert (await w.expect(P.Generate)).request_id == "r1"
        assert d.health()["queued"] == 2
        with pytest.raises(AdmissionRejected) as err:  # the queue holds two
            await collect(d.generate(request("r4")))
        assert err.value.status_code == 429 and err.value.retry_after_s >= 1
        await w.send(output("r1", 0, [1], 0, "a", finished=True))
        await tasks["r1"]
        assert (await w.expect(P.Generate)).request_id == "r2"  # oldest first
        with pytest.raises(RequestTimeout) as timeout:  # r3 waits past its queue timeout
            await tasks["r3"]
        assert timeout.value.stage == "queue"
        tasks["r2"].cancel()
    run(scenario, DeadlineConfig(queue_timeout_s=1.0), max_queue_len=2)


def test_early_rejection_refuses_a_request_predicted_to_miss_its_ttft() -> None:
    """--admission reject: the router's predicted TTFT (its prefill prior: 1,500 tokens/s)
    against the 0.5 s target; a refused request leaves no load booked. A request that
    must queue while no finish rate is known is not predicted, so it queues."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        from splitserve.errors import AdmissionRejected
        (w,) = [ScriptedWorker(ctx, d, "both", max_num_seqs=1)]
        await w.register()
        await d.wait_for_workers(1, 5)
        long = GenerateRequest("long", list(range(1500)), SamplingParams(max_tokens=4))
        with pytest.raises(AdmissionRejected, match="predicted time to first token") as err:
            await collect(d.generate(long))
        assert err.value.status_code == 429
        assert not d.router._in_flight and not d.flights  # nothing booked, nothing kept
        first = asyncio.create_task(collect(d.generate(request("r1"))))
        assert (await w.expect(P.Generate)).request_id == "r1"  # short: predicted in time
        second = asyncio.create_task(collect(d.generate(request("r2"))))
        while d.health()["queued"] != 1:  # no room, no finish rate yet: it queues
            await asyncio.sleep(0.01)
        await w.send(output("r1", 0, [1], 0, "a", finished=True))
        await first
        assert (await w.expect(P.Generate)).request_id == "r2"
        await w.send(output("r2", 0, [1], 0, "a", finished=True))
        await second
        assert d.metrics.admission_rejections.labels("early")._value.get() == 1
    run(scenario, slo_ttft_s=0.5, reject_early=True)
