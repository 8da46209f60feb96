"""Tiers below the block pool, from the engine's side (engine/kv_tiers.py): an evicted
cached block goes down with its KV; a later request whose prefix is below brings it up and
gets exactly the output of a cold run, in the default dtype (bf16, exact kernels). The
tiers here are a dict (the store's own tests cover the real tiers; the worker tests run
the engine with them)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve import SamplingParams
from splitserve.engine.kv_tiers import TieredBlock
from splitserve.kv_cache import BlockHash

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class DictTiers:
    def __init__(self) -> None:
        self.blocks: dict[BlockHash, tuple[TieredBlock, bytes]] = {}
        self.loads = 0

    def offload(self, block: TieredBlock, payload: memoryview) -> None:
        self.blocks[block.block_hash] = (block, bytes(payload))

    def available(self, block_hashes: Sequence[BlockHash], tenant: str | None) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.blocks or self.blocks[h][0].tenant != tenant:
                break
            n += 1
        return n

    def load(self, block_hash: BlockHash, tenant: str | None) -> bytes | None:
        entry = self.blocks.get(block_hash)
        if entry is None or entry[0].tenant != tenant:
            return None
        self.loads += 1
        return entry[1]


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def _run(llm: Any, prompt: list[int], rid: str, **kwargs: Any) -> tuple[list[int], int]:
    llm.engine.add_request(rid, prompt, GREEDY, **kwargs)
    out = None
    while llm.engine.has_unfinished:
        for o in llm.engine.step():
            out = o
    assert out is not None and out.finished
    return list(out.token_ids), out.num_cached_tokens


def test_evicted_prefix_comes_back_from_below_exactly(make_llm: Any,
                                                      default_model_path: str) -> None:
    llm = make_llm(model=default_model_path, dtype="auto", num_blocks=16)
    tiers = DictTiers()
    bridge = llm.engine.attach_tiers(tiers)
    a = _prompt(1, 100)  # 6 full blocks
    expected, cached = _run(llm, a, "a1")  # the cold run
    assert cached == 0 and bridge.num_promoted == 0
    for i in range(3):  # 3 x 7 blocks through a 16-block pool: a's blocks are reused
        _run(llm, _prompt(10 + i, 100), f"fill{i}")
    assert bridge.num_offloaded >= 6
    again, cached = _run(llm, a, "a2")
    assert again == expected
    assert cached == 96 and tiers.loads == 6 and bridge.num_promoted == 6


def test_another_tenants_blocks_do_not_come_up(make_llm: Any, default_model_path: str) -> None:
    llm = make_llm(model=default_model_path, dtype="auto", num_blocks=16)
    tiers = DictTiers()
    llm.engine.attach_tiers(tiers)
    a = _prompt(2, 64)
    _run(llm, a, "a1", namespace="shared", tenant="A")
    for i in range(3):
        _run(llm, _prompt(20 + i, 100), f"fill{i}", tenant="C")
    assert any(b.tenant == "A" for b, _ in tiers.blocks.values())
    # Same namespace (same hashes), another tenant: nothing comes up for B.
    _, cached = _run(llm, a, "b1", namespace="shared", tenant="B")
    assert cached == 0 and tiers.loads == 0


def test_purge_overwrites_the_tenants_free_blocks(make_llm: Any,
                                                   default_model_path: str) -> None:
    llm = make_llm(model=default_model_path, dtype="auto", num_blocks=32)
    engine = llm.engine
    _run(llm, _prompt(3, 64), "a", tenant="A")
    _run(llm, _prompt(4, 64), "b", tenant="B")
    pool = engine.kv.pool
    owned = {t: [b for b in pool.cached_block_ids() if pool.block(b).owner == t]
             for t in ("A", "B")}
    assert len(owned["A"]) == 4 and len(owned["B"]) == 4  # 75 tokens computed: 4 full
    assert engine.purge_tenant("A") == 4
    assert not any(pool.block(b).owner == "A" for b in pool.cached_block_ids())
    for b in owned["A"]:
        assert not engine.kv_cache[:, :, b].any()
    for b in owned["B"]:
        assert engine.kv_cache[:, :, b].any()
    _, cached = _run(llm, _prompt(4, 64), "b2", tenant="B")
    assert cached == 48
