"""asyncio front of an engine for servers: add requests, stream outputs, abort.

The engine steps on one dedicated thread (torch releases the GIL in its kernels); every
engine mutation runs on that thread, submitted through a queue, so the engine needs no
locks. Outputs are handed to each request's asyncio queue on the caller's loop.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import EngineDeadError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="splitserve-engine", daemon=True)
        self._thread.start()

    # -- public API (call from the event loop) ------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, *, timeout_s: float | None = None,
                       **request_kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Streams this request's outputs until the finished one. Cancelling the iteration
        (client gone) or passing `timeout_s` without progress aborts it in the engine."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        q: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        finished = False
        try:
            await self.call(lambda e: e.add_request(request_id, prompt, params,
                                                    **request_kwargs))
            while True:
                item = await asyncio.wait_for(q.get(), timeout_s)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self._dead is None:
                self._submit(lambda: self._abort_now(request_id))

    def _abort_now(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def abort(self, request_id: str) -> None:
        out = await self.call(lambda e: e.abort(request_id))
        if out is not None:
            self._deliver([out])

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread (KV import/export, stats) and returns its value."""
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller
                fut.set_exception(exc)
        self._submit(run)
        return await asyncio.wrap_future(fut)

    def shutdown(self) -> None:
        """Stops the engine thread, then checks the block pool (no leaked or double-freed blocks)."""
        self._commands.put(None)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.engine.check_invariants()

    # -- engine thread ------------------------------------------------------------------------
    def _submit(self, command: Callable[[], None]) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead!r}")
        self._commands.put(command)

    def _loop(self) -> None:
        try:
            while True:
                # Block for work only when idle; otherwise drain commands between steps.
                block = not self.engine.has_unfinished
                while True:
                    try:
                        command = self._commands.get(block=block, timeout=0.5 if block else None)
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    command()
                    block = False
                if self.engine.has_unfinished:
                    self._deliver(self.engine.step())
        except BaseException as exc:
            logger.exception("engine loop died")
            self._dead = exc
            for loop, q in list(self._streams.values()):
                loop.call_soon_threadsafe(q.put_nowait, EngineDeadError(f"engine failed: {exc!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                loop, q = stream
                loop.call_soon_threadsafe(q.put_nowait, out)
