"""Running a bench: discover the server, build the workload and its arrival schedule,
probe, scrape /metrics, send every request on time (asyncio), scrape again, summarize.

The library entry points are `run_bench(config) -> BenchReport` and
`run_sweep(config, rates) -> SweepReport`; `splitserve bench` is a thin layer over them.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence

from splitserve.bench.arrivals import schedule
from splitserve.bench.client import (RequestOptions, ServerInfo, fetch_metrics_text,
                                     fetch_server_info, make_client, send_request)
from splitserve.bench.config import BenchConfig
from splitserve.bench.errors import BenchSetupError
from splitserve.bench.metrics import compute_metrics
from splitserve.bench.progress import Progress
from splitserve.bench.record import RequestRecord
from splitserve.bench.report import BenchReport, SweepReport
from splitserve.bench.request import BenchRequest
from splitserve.bench.server_metrics import server_breakdown
from splitserve.bench.workload import build_workload

METRICS_SETTLE_S = 0.5  # worker reports (KV transfer telemetry) trail the last response


def run_bench(config: BenchConfig, command: str | None = None,
              server: ServerInfo | None = None) -> BenchReport:
    """One run of `config` against its server. Raises BenchSetupError when the run cannot
    start (server unreachable, unknown model, probe request refused); failed requests
    during the run are counted in the report, never raised."""
    server = server or fetch_server_info(config.base_url, config.model)
    limit = config.max_model_len or server.max_model_len
    workload = build_workload(config, limit)
    arrivals, arrival_info = schedule(config, workload)
    options = RequestOptions(server.model, config.endpoint, config.temperature,
                             config.request_timeout_s)
    asyncio.run(_probe(config, options))
    before = fetch_metrics_text(server.base_url)
    rate = "" if arrival_info.rate is None else f" {arrival_info.rate:g} req/s"
    with Progress(f"{config.label}: {arrival_info.kind}{rate}", len(workload.requests),
                  enabled=config.show_progress) as progress:
        records, duration = asyncio.run(
            _send_all(config, options, workload.requests, arrivals, progress))
    time.sleep(METRICS_SETTLE_S)
    after = fetch_metrics_text(server.base_url)
    return BenchReport(config=config, server=server, workload=workload.info,
                       arrivals=arrival_info,
                       metrics=compute_metrics(records, duration, config.slo),
                       server_breakdown=server_breakdown(before, after), records=records,
                       command=command)


def run_sweep(config: BenchConfig, rates: Sequence[float],
              command: str | None = None) -> SweepReport:
    """One run per rate (in the given order), labelled `config.label`. Every run has the
    same lengths and arrival draws; run i salts its tokens with i, so no run hits the
    prefix cache entries an earlier one left behind."""
    if not rates:
        raise ValueError("a sweep needs at least one rate")
    server = fetch_server_info(config.base_url, config.model)
    runs = [run_bench(dataclasses.replace(config, rate=rate, run_index=config.run_index + i),
                      command, server) for i, rate in enumerate(rates)]
    return SweepReport(config.label, runs, command)


async def _probe(config: BenchConfig, options: RequestOptions) -> None:
    """One small request before the run, so a wrong endpoint fails the setup, not the run."""
    client = make_client(config.base_url, options.timeout_s)
    probe = BenchRequest([config.token_low] * 4, 2)
    record = RequestRecord(0, 4, 2, 0.0)  # not part of the run's records
    try:
        await send_request(client, options, probe, record, time.perf_counter)
    finally:
        await client.close()
    if not record.is_completed:
        raise BenchSetupError(f"the probe request to {config.base_url}/v1/{options.endpoint} "
                              f"failed (HTTP {record.status}): {record.error}")


async def _send_all(config: BenchConfig, options: RequestOptions,
                    requests: list[BenchRequest], arrivals: list[float],
                    progress: Progress) -> tuple[list[RequestRecord], float]:
    """Sends request i at arrivals[i] (after its session predecessor finished and within
    the concurrency cap); returns the records and the run's duration (start -> last end)."""
    client = make_client(config.base_url, options.timeout_s)
    cap: contextlib.AbstractAsyncContextManager[object] = (
        asyncio.Semaphore(config.max_concurrency) if config.max_concurrency
        else contextlib.nullcontext())
    finished = [asyncio.Event() for _ in requests]
    records = [RequestRecord(i, len(r.prompt_token_ids), r.output_len, arrivals[i],
                             session_id=r.session_id) for i, r in enumerate(requests)]
    start = time.perf_counter()
    clock: Callable[[], float] = lambda: time.perf_counter() - start  # noqa: E731

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, arrivals[i] - clock()))
        after = requests[i].after
        if after is not None:
            await finished[after].wait()
        async with cap:
            progress.sent()
            await send_request(client, options, requests[i], records[i], clock)
        finished[i].set()
        progress.finished(records[i].is_completed)

    try:
        await asyncio.gather(*(one(i) for i in range(len(requests))))
    finally:
        await client.close()
    duration = max((r.end_s for r in records if r.end_s is not None), default=0.0)
    return records, duration
