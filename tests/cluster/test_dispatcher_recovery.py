"""The dispatcher's recovery (DESIGN 7) against scripted workers: retries resume the
stream from the tokens already merged, late messages of old attempts and removed
incarnations are refused, stale routed hits are invalidated. The same paths with real
worker processes and fault injection: tests/api/test_faults_e2e.py."""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast

import pytest
import zmq
import zmq.asyncio

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend.flight import FlightState
from splitserve.cluster.frontend.recovery import KVFailurePolicy, RetryPolicy
from splitserve.config import DeadlineConfig
from splitserve.errors import RequestTimeout, WorkerFailed
from tests.cluster.test_dispatcher import (PLAN, ScriptedWorker, collect, output, request,
                                           run, workers)


async def until(condition: Callable[[], bool]) -> None:
    """Waits for the dispatcher to have handled what the test sent (bounded by run())."""
    while not condition():
        await asyncio.sleep(0.005)


def test_a_stalled_decode_resumes_from_the_merged_tokens() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        await w.send(output("r1", 0, [7], 0, "a"))
        assert (await w.expect(P.Abort)).request_id == "r1"  # stalled: attempt 0 dropped
        retry = await w.expect(P.Generate)
        assert retry.request_id == "r1#1" and retry.resume_token_ids == [7]
        await w.send(output("r1", 1, [99], 1, "LATE"))  # the old attempt: refused
        await w.send(output("r1#1", 0, [7, 8], 0, "ab", finished=True))
        deltas = await task
        assert [x.token_ids for x in deltas] == [[7], [8]]
        assert "".join(x.text for x in deltas) == "ab"
        assert b'splitserve_retries_total{reason="timeout_decode"} 1.0' in d.metrics_text()
        assert b"splitserve_migrations_total 1.0" in d.metrics_text()
    run(scenario, DeadlineConfig(decode_step_timeout_s=0.3))


def test_a_dead_prefill_worker_is_replaced_by_a_local_prefill() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        assert (await dec.expect(P.Generate)).await_kv
        await p.expect(P.Prefill)
        d.mark_dead(p.identity, "exited")
        assert (await dec.expect(P.Abort)).request_id == "r1"
        retry = await dec.expect(P.Generate)
        assert retry.request_id == "r1#1" and not retry.await_kv and not retry.resume_token_ids
        await dec.send(output("r1#1", 0, [5, 6], 0, "xy", finished=True))
        assert [x.token_ids for x in await task] == [[5, 6]]
    run(scenario, policy="always")


@pytest.mark.parametrize("policy", ["retry", "fail"])
def test_kv_failure_policy(policy: str) -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        gen = await dec.expect(P.Generate)
        assert not gen.recompute_on_failure  # only "recompute" lets D fall back by itself
        await p.expect(P.Prefill)
        await p.send(output("r1", 0, [5], 0, "x"))
        await dec.send(P.RequestFailed("r1", P.FailureKind.KV_TRANSFER, "layer 0 checksum"))
        if policy == "fail":
            with pytest.raises(WorkerFailed, match="checksum.*kv-failure-policy fail"):
                await task
            return
        retry = await dec.expect(P.Generate)
        assert retry.request_id == "r1#1" and retry.await_kv and retry.resume_token_ids == [5]
        prefill = await p.expect(P.Prefill)
        assert prefill.request_id == "r1#1" and prefill.resume_token_ids == [5]
        await dec.send(output("r1#1", 0, [5, 6, 7], 0, "xyz", finished=True))
        assert [x.token_ids for x in await task] == [[5], [6, 7]]
    run(scenario, policy="always", retry=RetryPolicy(kv_failure_policy=KVFailurePolicy(policy)))


def test_retries_stop_at_the_budget() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        for attempt in ("r1", "r1#1"):
            assert (await w.expect(P.Generate)).request_id == attempt
            await w.send(P.RequestFailed(attempt, P.FailureKind.WORKER_ERROR, "boom"))
        with pytest.raises(WorkerFailed, match="boom"):
            await task
    run(scenario, retry=RetryPolicy(max_retries=1))


def test_a_removed_incarnation_is_fenced_and_told_to_exit() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (old,) = await workers(d, ctx, "both")
        new = ScriptedWorker(ctx, d, "both", epoch=2)
        await new.register()  # a restart: the new epoch replaces the old one
        await until(lambda: d.table.by_id["both-0"].identity == b"both-0:2")
        await old.send(P.KVEventBatch(1, []))
        await old.expect(P.Shutdown)
        assert b"splitserve_fenced_messages_total 1.0" in d.metrics_text()
        listed = cast(list[dict[str, object]], d.health()["workers"])
        assert [w["id"] for w in listed] == ["both-0"]
    run(scenario)


def test_a_routed_hit_the_worker_lacks_is_invalidated() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        req = request()
        req.prompt_token_ids = list(range(40))  # 2 full blocks + 8 tokens
        hashes = d.workers.block_hashes(req.namespace, req.prompt_token_ids)
        from splitserve.kv_cache import BlockStored
        await w.send(P.KVEventBatch(1, [BlockStored(tuple(hashes), None)]))
        await until(lambda: bool(d.router.index.match(hashes)))
        task = asyncio.create_task(collect(d.generate(req)))
        await w.expect(P.Generate)
        out = output("r1", 0, [7], 0, "a", finished=True)
        out.num_cached_tokens = 0  # the router expected 32
        await w.send(out)
        await task
        await w.expect(P.ResyncKV)
        assert d.router.index.match(hashes) == {}
        assert b"splitserve_stale_routes_total 1.0" in d.metrics_text()
    run(scenario)


def test_fault_injection_is_refused_unless_enabled() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        with pytest.raises(PermissionError):
            d.admin.inject_fault("both-0", {"kind": "kill"})
        d.admin.enabled = True
        with pytest.raises(KeyError):
            d.admin.inject_fault("nobody", {"kind": "kill"})
        d.admin.inject_fault("both-0", {"kind": "kill", "point": "decode", "after": 2})
        msg = await w.expect(P.InjectFault)
        assert msg.spec == P.FaultSpec("kill", "decode", after=2)
    run(scenario)


def test_a_prefill_worker_dying_after_the_handoff_concerns_nobody() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        await dec.expect(P.Generate)
        await p.expect(P.Prefill)
        await p.send(output("r1", 0, [5], 0, "x"))
        await dec.send(output("r1", 1, [6], 1, "y"))  # D committed the KV and goes on
        await until(lambda: d.flights["r1"].state is FlightState.DECODE)
        d.mark_dead(p.identity, "exited")
        await dec.send(output("r1", 2, [7], 2, "z", finished=True))
        assert [x.token_ids for x in await task] == [[5], [6], [7]]
        assert b"splitserve_retries_total" not in d.metrics_text().replace(
            b"# HELP splitserve_retries_total", b"").replace(
            b"# TYPE splitserve_retries_total", b"")
    run(scenario, policy="always")


def test_the_retry_budget_counts_the_retries_since_the_request_last_decoded() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        tokens: list[int] = []
        for attempt in ("r1", "r1#1"):  # each decodes a token, then its worker fails it
            gen = await w.expect(P.Generate)
            assert gen.request_id == attempt and gen.resume_token_ids == tokens
            tokens.append(len(tokens) + 5)
            await w.send(output(attempt, 0, tokens, 0, "x" * len(tokens)))
            await until(lambda: d.flights["r1"].state is FlightState.DECODE)
            await w.send(P.RequestFailed(attempt, P.FailureKind.WORKER_ERROR, "boom"))
        # Two failures, one retry allowed: each came after the request recovered.
        assert (await w.expect(P.Generate)).request_id == "r1#2"
        await w.send(P.RequestFailed("r1#2", P.FailureKind.WORKER_ERROR, "boom again"))
        with pytest.raises(WorkerFailed, match="boom again"):  # no decode in between: final
            await task
    run(scenario, retry=RetryPolicy(max_retries=1))


def test_a_retry_with_no_decode_worker_up_waits_for_a_restarted_one() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        await dec.expect(P.Generate)
        await p.expect(P.Prefill)
        await p.send(output("r1", 0, [5], 0, "x"))
        await until(lambda: d.flights["r1"].state is FlightState.HANDOFF)
        d.mark_dead(dec.identity, "exited")  # the only decode worker
        assert (await p.expect(P.Abort)).request_id == "r1"
        assert d.flights.stranded == [d.flights["r1"]]
        restarted = ScriptedWorker(ctx, d, "decode", epoch=2)
        await restarted.register()
        gen = await restarted.expect(P.Generate)  # the retry goes on, remote as before
        assert gen.request_id == "r1#1" and gen.await_kv and gen.resume_token_ids == [5]
        assert (await p.expect(P.Prefill)).request_id == "r1#1"
        await restarted.send(output("r1#1", 1, [6], 1, "y", finished=True))
        assert [x.token_ids for x in await task] == [[5], [6]]
    run(scenario, policy="always", retry=RetryPolicy(wait_for_restarts=True))


@pytest.mark.parametrize("restarts", [True, False])
def test_a_request_arriving_with_no_decode_worker_up(restarts: bool) -> None:
    """With restarts it waits for a restarted decode worker within its queue deadline, as
    when none has room; without, nothing will come back: 503 at once."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        from splitserve.errors import AdmissionRejected
        (w,) = await workers(d, ctx, "both")
        d.mark_dead(w.identity, "exited")
        task = asyncio.create_task(collect(d.generate(request())))
        if not restarts:
            with pytest.raises(AdmissionRejected) as err:
                await task
            assert err.value.status_code == 503
            return
        await until(lambda: d.health()["queued"] == 1)
        assert not d.is_ready()  # load balancers steer around meanwhile
        restarted = ScriptedWorker(ctx, d, "both", epoch=2)
        await restarted.register()
        assert (await restarted.expect(P.Generate)).request_id == "r1"
        await restarted.send(output("r1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]
    run(scenario, retry=RetryPolicy(wait_for_restarts=restarts))


def test_a_request_waiting_for_a_decode_worker_times_out_in_the_queue() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        d.mark_dead(w.identity, "exited")
        with pytest.raises(RequestTimeout, match="none was up") as err:
            await collect(d.generate(request()))
        assert err.value.stage == "queue"
    run(scenario, DeadlineConfig(queue_timeout_s=0.3), retry=RetryPolicy(wait_for_restarts=True))


def test_the_decode_workers_token_2_may_come_before_the_prefill_workers_token_1() -> None:
    """P's token 1 and D's token 2 travel on different connections: D's may come first
    (a busy frontend reads its sockets round-robin). It waits for token 1, not a failure."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        await dec.expect(P.Generate)
        await p.expect(P.Prefill)
        await dec.send(output("r1", 1, [6], 0, "xy"))  # D committed the KV: token 2 on
        await until(lambda: bool(d.flights["r1"].held))
        await p.send(output("r1", 0, [5], 0, "x"))
        await dec.send(output("r1", 2, [9], 2, "z", finished=True))
        deltas = await task
        assert [x.token_ids for x in deltas] == [[5], [6], [9]]
        assert "".join(x.text for x in deltas) == "xyz"
        assert b"splitserve_failures_total{" not in d.metrics_text()
    run(scenario, policy="always")


def test_a_decode_worker_that_recomputes_another_token_1_is_retried_from_the_streamed_one(
        ) -> None:
    """Where outputs depend on batching (oneDNN or CUDA kernels), a decode worker that
    prefilled locally after a failed import may sample another token 1 than the prefill
    worker streamed. The client keeps the streamed one; the attempt is retried from it."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        p, dec = await workers(d, ctx, "prefill", "decode")
        task = asyncio.create_task(collect(d.generate(request())))
        await dec.expect(P.Generate)
        await p.expect(P.Prefill)
        await p.send(output("r1", 0, [5], 0, "x"))
        await until(lambda: d.flights["r1"].merger.num_tokens == 1)
        await dec.send(output("r1", 0, [6, 9], 0, "yz"))  # recomputed: 6, not the streamed 5
        assert (await dec.expect(P.Abort)).request_id == "r1"
        retry = await dec.expect(P.Generate)
        assert retry.request_id == "r1#1" and retry.resume_token_ids == [5]
        if retry.await_kv:  # prefilled remotely again: P streams its token after 5
            await p.expect(P.Prefill)
            await p.send(output("r1#1", 0, [5, 6], 0, "xy"))
            await dec.send(output("r1#1", 2, [7], 2, "z", finished=True))
        else:
            await dec.send(output("r1#1", 0, [5, 6, 7], 0, "xyz", finished=True))
        deltas = await task
        assert [t for x in deltas for t in x.token_ids] == [5, 6, 7]
        assert "".join(x.text for x in deltas) == "xyz"
        assert b'kind="diverged"' in d.metrics_text()
    run(scenario, policy="always")
