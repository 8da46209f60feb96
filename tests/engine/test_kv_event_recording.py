"""An engine records KV events only for a consumer that attached (a worker); the offline
LLM attaches none, so a long run keeps no event backlog."""
from __future__ import annotations

from typing import Any

from splitserve import SamplingParams
from tests.kv_cache.test_kv_events import replay

PARAMS = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def test_a_long_offline_run_keeps_no_event_backlog(make_llm: Any) -> None:
    """The offline LLM attaches no consumer: its pool records nothing, however much the
    prefix cache churns (here: every prompt evicts the previous ones' blocks)."""
    llm = make_llm(num_blocks=8, block_size=16)
    for i in range(20):
        llm.generate([list(range(100 * i, 100 * i + 40))], PARAMS)
    pool = llm.engine.kv.pool
    assert len(pool.cached_hashes()) > 0 and pool._events is None


def test_an_engine_records_for_its_worker_once_enabled(make_llm: Any) -> None:
    llm = make_llm(num_blocks=8, block_size=16)
    llm.engine.enable_kv_events()
    index: set[bytes] = set()
    for i in range(5):
        llm.generate([list(range(100 * i, 100 * i + 40))], PARAMS)
        index = replay(index, llm.engine.take_kv_events())
        assert index == set(llm.engine.cached_block_hashes())
