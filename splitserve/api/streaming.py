"""The client connection: server-sent events, and aborting the generation when the client
leaves.

The backend aborts a request when its delta iterator is closed, so every path that stops
reading early closes it: the request's `DisconnectWatch` cancels the read of the first
delta or of a whole non-streaming answer, and `EventStreamResponse` closes the event stream,
which closes the deltas, as soon as the client's `http.disconnect` arrives.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any, TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from splitserve.api.errors import ClientDisconnected, api_error
from splitserve.api.request_id import logger
from splitserve.api.response_builder import ResponseBuilder
from splitserve.cluster.frontend.stream import StreamDelta

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"


async def close_iterator(iterator: AsyncIterator[Any]) -> None:
    """Closes an async generator (running its cleanup: the backend's abort) if it is one."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (or the response is complete). The request body
    must have been read already: this consumes the remaining ASGI messages."""
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectWatch:
    """The client's `http.disconnect`, watched by one task for the whole request (ASGI has
    one reader of `receive`): `run(work)` awaits `work` in the calling task and, if the
    client leaves first, cancels it there and raises ClientDisconnected. `close()` when the
    request is done.

    NOTE: the work runs in the caller's task, not a task of its own (a task pair per wait
    cost ~25 us warm, several times that between two steps); the cancellation is plain
    asyncio's, delivered once and taken back with `uncancel` as `asyncio.timeout` does, so
    cleanup that awaits (the backend's abort in its generator's `finally`) still runs, and
    a cancellation from elsewhere (the server's shutdown) still propagates.
    """

    def __init__(self, receive: Receive) -> None:
        self._running: asyncio.Task[Any] | None = None
        self._cancelled_it = False
        self._watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        self._watcher.add_done_callback(self._on_disconnect)

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        """`await work`, unless the client leaves first (ClientDisconnected)."""
        if self._watcher.done():
            work.close()
            raise _disconnected()
        task = asyncio.current_task()
        assert task is not None and self._running is None, "one run at a time, in a task"
        self._running, self._cancelled_it = task, False
        try:
            result = await work
        except asyncio.CancelledError:
            if self._cancelled_it and task.uncancel() == 0:
                raise _disconnected() from None
            raise
        finally:
            self._running = None
        if self._cancelled_it:  # the work caught the cancellation and finished: take it back
            task.uncancel()
        return result

    def close(self) -> None:
        self._watcher.cancel()

    def _on_disconnect(self, watcher: asyncio.Future[None]) -> None:
        if self._running is not None and not watcher.cancelled():
            self._cancelled_it = True
            self._running.cancel()


def _disconnected() -> ClientDisconnected:
    return ClientDisconnected("the client disconnected before the response was complete; "
                              "the request was aborted")


async def prepend(first: StreamDelta, rest: AsyncIterator[StreamDelta]
                  ) -> AsyncGenerator[StreamDelta, None]:
    """`first`, then `rest`; closing this closes `rest`."""
    try:
        yield first
        async for delta in rest:
            yield delta
    finally:
        await close_iterator(rest)


async def sse_events(deltas: AsyncGenerator[StreamDelta, None], builder: ResponseBuilder
                     ) -> AsyncGenerator[bytes, None]:
    """The SSE body: one `data:` event per chunk, the usage chunk if asked, then `[DONE]`.

    An error after the stream started cannot change the status any more: it is sent as one
    `data: {"error": {...}}` event before `[DONE]`.
    """
    try:
        async with contextlib.aclosing(deltas):
            # The opening chunks (chat's role) go with the first token, in one write: clients
            # such as vLLM's `bench serve` time the first token at the first chunk.
            opening = b"".join(_event(chunk.model_dump_json()) for chunk in builder.head())
            async for delta in deltas:
                event = builder.add(delta)
                if event is not None:
                    yield opening + _event(event.model_dump_json())
                    opening = b""
            builder.check_finished()
            usage = builder.usage_chunk()
            if usage is not None:
                yield _event(usage.model_dump_json())
    except Exception as exc:
        yield _event(api_error(exc).body().model_dump_json())
    yield DONE_EVENT


def _event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` that closes its events (so the backend aborts) the moment the
    client disconnects, whatever the ASGI server's spec version, and always closes them when
    the response ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], watch: DisconnectWatch) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache"})
        self._events = events
        self._watch = watch

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._watch.run(self._stream(send))
        except ClientDisconnected:
            logger.info("client disconnected mid-stream; request aborted")
        finally:
            self._watch.close()
            await self._events.aclose()

    async def _stream(self, send: Send) -> None:
        try:
            await self.stream_response(send)
        except OSError:  # servers on ASGI spec >= 2.4 raise when the client is gone
            logger.info("client disconnected mid-stream; request aborted")
