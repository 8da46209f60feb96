"""The frontend's socket hands a step's outputs to their streams before the bookkeeping
frames the worker sent behind them (KV events, a load report): a drain's turn of the
event loop ends after a frame that carries outputs, so the streams those outputs woke
write to their clients first. Real sockets, a real CURVE handshake."""
from __future__ import annotations

import asyncio
import time

import zmq

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.worker.control import FrontendSocket
from tests.cluster.test_dispatcher import output


def test_the_streams_an_output_woke_run_before_the_frames_behind_it() -> None:
    async def scenario() -> list[str]:
        link = WorkerLink(Metrics())
        identity = b"decode-0:1"
        worker = FrontendSocket(link.address, identity, link.enroll(identity),
                                send_timeout_s=5)
        seen: list[str] = []
        loop = asyncio.get_running_loop()

        def on_message(_: bytes, msg: P.Message) -> None:
            seen.append(type(msg).__name__)
            if isinstance(msg, (P.Output, P.OutputBatch)):  # as a stream's queue wakes
                loop.call_soon(seen.append, "stream")

        try:
            for msg in (output("r1", 0, [7], 0, "a"),
                        P.KVEventBatch(1, []), P.LoadReport(1, 0, 0, 0, 1, 8),
                        P.OutputBatch([output("r1", 1, [8], 1, "b"),
                                       output("r2", 0, [9], 0, "c")]),
                        P.LoadReport(1, 0, 0, 0, 1, 8)):
                assert worker.send(msg)
            # All five are waiting at the frontend's socket before it reads any.
            deadline = time.monotonic() + 10
            while not link.sock.poll(0, zmq.POLLIN):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            task = asyncio.create_task(link.receive(on_message))
            while len(seen) < 7 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return seen
        finally:
            worker.close(linger_ms=0)
            link.close()

    assert asyncio.run(scenario()) == ["Output", "stream", "KVEventBatch", "LoadReport",
                                       "OutputBatch", "stream", "LoadReport"]

