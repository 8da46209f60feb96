"""A client that goes away aborts its generation: the backend's delta iterator is closed
before it finished, streaming or not, before or after the first delta."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from fake_backend import FakeBackend, wait_until
from splitserve.api.errors import ClientDisconnected
from splitserve.api.streaming import DisconnectWatch

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi!"}]


def _aborted(fake: FakeBackend, request_id: str) -> bool:
    return wait_until(lambda: fake.outcomes.get(request_id) is not None) and \
        fake.outcomes[request_id] == "aborted"


def test_streaming_client_leaving_mid_stream_aborts(http: httpx2.Client, client: openai.OpenAI,
                                                    fake: FakeBackend) -> None:
    fake.hang_at = 3
    with http.stream("POST", "/v1/completions", headers={"X-Request-Id": "leaver-1"},
                     json={"prompt": "Hi", "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert wait_until(lambda: bool(fake.requests))
    assert _aborted(fake, fake.last.request_id)
    fake.hang_at = None
    assert client.completions.create(model="smollm2", prompt="Hi", max_tokens=1).choices


def test_a_stream_starts_when_its_request_is_placed(http: httpx2.Client,
                                                     fake: FakeBackend) -> None:
    # hangs after the placement mark, before any token: the response's head is on the
    # wire while the prompt would be prefilling; its first chunk waits for the first token
    fake.hang_at = 0
    with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "placed-1"},
                     json={"messages": CHAT, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert fake.outcomes.get(fake.last.request_id) is None  # still generating
    assert _aborted(fake, fake.last.request_id)


def test_streaming_client_leaving_before_the_first_delta_aborts(client: openai.OpenAI,
                                                                fake: FakeBackend) -> None:
    fake.placed = False  # a backend still placing the request
    fake.hang_at = 0
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).chat.completions.create(
            model="smollm2", messages=CHAT, stream=True,
            extra_headers={"X-Request-Id": "leaver-2"})
    assert wait_until(lambda: bool(fake.requests))
    assert _aborted(fake, fake.last.request_id)


def test_non_streaming_client_leaving_aborts(client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.hang_at = 2
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(
            model="smollm2", prompt="Hi", extra_headers={"X-Request-Id": "leaver-3"})
    assert wait_until(lambda: bool(fake.requests))
    assert _aborted(fake, fake.last.request_id)


def test_completed_requests_are_not_aborted(client: openai.OpenAI, fake: FakeBackend) -> None:
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=3)
    list(client.chat.completions.create(model="smollm2", messages=CHAT, stream=True))
    assert wait_until(lambda: len(fake.outcomes) == 2)
    assert set(fake.outcomes.values()) == {"finished"}


# ---- DisconnectWatch on its own ------------------------------------------------------------

class _Receive:
    """An ASGI receive whose http.disconnect arrives when `leave` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def __call__(self) -> dict[str, object]:
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def _slow(log: list[str]) -> AsyncIterator[int]:
    try:
        yield 1
        await asyncio.sleep(10)
        yield 2
    finally:
        log.append("closed")


def test_a_watch_returns_each_result_while_the_client_stays() -> None:
    async def main() -> list[int]:
        watch = DisconnectWatch(_Receive())
        results = [await watch.run(asyncio.sleep(0, result=7)),
                   await watch.run(asyncio.sleep(0.01, result=8))]
        watch.close()
        return results
    assert asyncio.run(main()) == [7, 8]


def test_a_watch_cancels_the_work_when_the_client_leaves() -> None:
    log: list[str] = []

    async def main() -> None:
        receive = _Receive()
        deltas = _slow(log)

        async def read_all() -> list[int]:
            return [d async for d in deltas]

        watch = DisconnectWatch(receive)
        asyncio.get_running_loop().call_later(0.05, receive.leave.set)
        with pytest.raises(ClientDisconnected):
            await watch.run(read_all())
        # the caller's task is not left cancelled: it goes on (its cleanup awaits)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await asyncio.sleep(0)

    asyncio.run(main())
    assert log == ["closed"]


def test_a_client_gone_between_two_waits_stops_the_second_before_it_starts() -> None:
    async def main() -> None:
        receive = _Receive()
        watch = DisconnectWatch(receive)
        assert await watch.run(asyncio.sleep(0, result=1)) == 1
        receive.leave.set()
        await asyncio.sleep(0.01)  # the disconnect arrives while nothing is running
        started = []

        async def work() -> None:
            started.append(True)
        with pytest.raises(ClientDisconnected):
            await watch.run(work())
        assert not started

    asyncio.run(main())


def test_a_cancellation_from_elsewhere_is_not_taken_for_a_disconnect() -> None:
    async def main(leave_too: bool) -> None:
        receive = _Receive()
        watch = DisconnectWatch(receive)
        task = asyncio.ensure_future(watch.run(asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        task.cancel()  # the server shutting down, say
        if leave_too:  # and the client leaving in the same turn of the loop
            receive.leave.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        watch.close()

    asyncio.run(main(leave_too=False))
    asyncio.run(main(leave_too=True))


def test_work_that_catches_the_cancellation_leaves_its_task_uncancelled() -> None:
    async def main() -> tuple[str, int]:
        receive = _Receive()
        watch = DisconnectWatch(receive)

        async def stubborn() -> str:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return "finished anyway"
            return "slept"
        asyncio.get_running_loop().call_later(0.02, receive.leave.set)
        result = await watch.run(stubborn())
        watch.close()
        return result, asyncio.current_task().cancelling()  # type: ignore[union-attr]

    assert asyncio.run(main()) == ("finished anyway", 0)


def test_a_closed_watch_leaves_no_task_behind() -> None:
    async def main() -> None:
        watch = DisconnectWatch(_Receive())
        await watch.run(asyncio.sleep(0))
        watch.close()
        await asyncio.sleep(0)
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(main())
