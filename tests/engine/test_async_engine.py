"""AsyncLLM: concurrent streams, abort on cancel, deadlines, calls on the engine thread."""
from __future__ import annotations

import asyncio

import pytest

from splitserve import SamplingParams
from splitserve.engine.async_engine import AsyncLLM

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def async_llm(make_llm):
    llm = make_llm()
    engine = AsyncLLM(llm.engine)
    yield engine, make_llm()  # a second engine for offline references: one thread per engine
    engine.shutdown()


def test_concurrent_streams_match_offline(async_llm) -> None:
    engine, llm = async_llm
    ps = [list(range(500 + i, 520 + 3 * i)) for i in range(6)]

    async def collect(p: list[int]) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(p, PARAMS):
            tokens += out.delta_token_ids
        return tokens

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(collect(p) for p in ps))

    streamed = asyncio.run(main())
    offline = [o.token_ids for o in llm.generate(ps, PARAMS)]
    assert streamed == offline


def test_cancelled_stream_aborts_and_frees_blocks(async_llm) -> None:
    engine, _ = async_llm

    async def main() -> int:
        stream = engine.generate(list(range(100, 140)), SamplingParams(max_tokens=10_000,
                                                                        ignore_eos=True), "c")
        async for _ in stream:
            break
        await stream.aclose()  # the client went away
        for _ in range(100):
            used = await engine.call(lambda e: e.kv.pool.num_used_blocks)
            if used == 0:
                return used
            await asyncio.sleep(0.01)
        return used

    assert asyncio.run(main()) == 0


def test_timeout_without_progress_raises_and_aborts(async_llm) -> None:
    engine, _ = async_llm

    async def main() -> None:
        # WAITING_FOR_KV: no KV will come, so no output ever arrives.
        async for _ in engine.generate(list(range(100, 120)), PARAMS, "t", timeout_s=0.3,
                                       await_kv=True):
            pass

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(main())

    async def remaining() -> int:
        return await engine.call(lambda e: len(e.scheduler.requests))
    assert asyncio.run(remaining()) == 0


def test_bad_request_raises_in_the_caller(async_llm) -> None:
    engine, _ = async_llm
    from splitserve.errors import InvalidRequestError

    async def main() -> None:
        async for _ in engine.generate([], PARAMS):
            pass

    with pytest.raises(InvalidRequestError):
        asyncio.run(main())
