"""Peer fetch in the dispatcher, against scripted workers: a request placed on a worker
that lacks its prefix gets Generate(kv_prefix_end) there and ExportPrefix on the holder;
the plan is relayed to the holder; a holder that fails, gives up or dies never fails the
request: the importing worker is told to prefill it all (CancelImport)."""
from __future__ import annotations

import asyncio
from typing import Any

import zmq.asyncio

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.frontend.stream import GenerateRequest
from splitserve.cluster.router.router import RouterConfig
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kv_cache.events import BlockStored

from test_dispatcher import PLAN, ScriptedWorker, collect, output
from test_dispatcher import run as run_scenario

PROMPT = list(range(100, 612))  # 512 tokens: the holder has all 32 blocks, 31 can be fetched


def run(scenario: Any, peer_fetch: bool = True) -> None:
    run_scenario(scenario, router_config=RouterConfig(disagg="never", peer_fetch=peer_fetch))


async def holder_and_idle(d: Dispatcher, ctx: zmq.asyncio.Context
                          ) -> tuple[ScriptedWorker, ScriptedWorker]:
    """both-0 holds PROMPT's blocks and has no room for a sequence; both-1 is idle."""
    holder, idle = (ScriptedWorker(ctx, d, "both", i, max_num_seqs=4) for i in (0, 1))
    for w in (holder, idle):
        await w.register()
    await d.wait_for_workers(2, 5)
    hashes = tuple(d.workers.block_hashes(None, PROMPT))
    await holder.send(P.KVEventBatch(1, [BlockStored(hashes, None)]))
    await holder.send(P.LoadReport(4, 0, 0, 0, 40, 100))
    while d.router.index.match(list(hashes)).get("both-0") != len(hashes) or \
            d.router.worker_state("both-0").load.num_running != 4:  # type: ignore[union-attr]
        await asyncio.sleep(0.01)
    return holder, idle


def request(rid: str = "r1") -> GenerateRequest:
    return GenerateRequest(rid, list(PROMPT), SamplingParams(temperature=0, max_tokens=2))


def test_the_idle_worker_imports_the_holders_prefix_and_the_plan_reaches_the_holder() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        holder, idle = await holder_and_idle(d, ctx)
        task = asyncio.create_task(collect(d.generate(request())))
        gen = await idle.expect(P.Generate)
        assert gen.await_kv and gen.recompute_on_failure and gen.kv_prefix_end == 496
        export = await holder.expect(P.ExportPrefix)
        assert export.request_id == "r1" and export.prompt_token_ids == PROMPT[:496]
        await idle.send(P.KVPlanReady("r1", PLAN))
        assert (await holder.expect(P.KVPlan)).plan == PLAN
        await holder.send(P.PrefillDone("r1", handed_off=True))
        await idle.send(output("r1", 0, [7, 8], 0, "ab", finished=True))
        [delta] = await task
        assert delta.token_ids == [7, 8] and delta.finished
        text = d.metrics_text().decode()
        assert 'splitserve_kv_peer_fetches_total{outcome="committed"} 1.0' in text
        assert "splitserve_kv_peer_fetch_tokens_total 496.0" in text
    run(scenario)


def test_without_peer_fetch_the_idle_worker_prefills_everything() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        holder, idle = await holder_and_idle(d, ctx)
        task = asyncio.create_task(collect(d.generate(request())))
        gen = await idle.expect(P.Generate)
        assert not gen.await_kv and gen.kv_prefix_end is None
        await idle.send(output("r1", 0, [7, 8], 0, "ab", finished=True))
        await task
        try:
            msg = await holder.recv(0.3)
        except asyncio.TimeoutError:
            msg = None
        assert not isinstance(msg, P.ExportPrefix)
    run(scenario, peer_fetch=False)


def test_a_holder_that_fails_or_dies_only_makes_the_importer_prefill() -> None:
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        holder, idle = await holder_and_idle(d, ctx)
        first = asyncio.create_task(collect(d.generate(request("r1"))))
        await holder.expect(P.ExportPrefix)
        await idle.expect(P.Generate)
        await holder.send(P.RequestFailed("r1", P.FailureKind.KV_TRANSFER, "evicted", None))
        assert (await idle.expect(P.CancelImport)).request_id == "r1"
        await idle.send(output("r1", 0, [7, 8], 0, "ab", finished=True))
        assert (await first)[-1].finished  # the holder's failure was not the request's

        second = asyncio.create_task(collect(d.generate(request("r2"))))
        await holder.expect(P.ExportPrefix)
        await idle.expect(P.Generate)
        d.mark_dead(holder.sock.getsockopt(zmq.ROUTING_ID), "was killed")
        assert (await idle.expect(P.CancelImport)).request_id == "r2"
        await idle.send(output("r2", 0, [7, 8], 0, "ab", finished=True))
        assert (await second)[-1].finished
        text = d.metrics_text().decode()
        assert 'splitserve_kv_peer_fetches_total{outcome="failed"} 2.0' in text
        assert 'splitserve_failures_total{kind="worker_dead"}' not in text
    run(scenario)
