"""ClusterAdmin.check_pools (GET /admin/pools): concurrent calls share one round of checks,
each gets every worker's answer, a worker that does not answer times out alone."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.admin import ClusterAdmin


class Link:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def send(self, identity: bytes, msg: object) -> None:
        self.sent.append((identity, msg))


def _admin(*worker_ids: str) -> tuple[ClusterAdmin, Link]:
    workers = {w.encode(): SimpleNamespace(identity=w.encode(), worker_id=w, healthy=True)
               for w in worker_ids}
    link = Link()
    table: Any = SimpleNamespace(workers=workers)
    return ClusterAdmin(table, link, metrics=None,  # type: ignore[arg-type]
                        fault_injection=False), link


def test_concurrent_checks_share_one_round_and_all_get_every_answer() -> None:
    async def main() -> None:
        admin, link = _admin("decode-0", "prefill-0")
        calls = [asyncio.create_task(admin.check_pools(timeout_s=5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert sorted(i for i, _ in link.sent) == [b"decode-0", b"prefill-0"], "asked once"
        admin.on_answer(b"decode-0", P.PoolReport(admin._round, True, None, 0, 0))
        admin.on_answer(b"prefill-0", P.PoolReport(admin._round, False, "leak", 3, 1))
        results = await asyncio.gather(*calls)
        expected = {"decode-0": {"ok": True, "error": None, "used_blocks": 0, "requests": 0},
                    "prefill-0": {"ok": False, "error": "leak", "used_blocks": 3, "requests": 1}}
        assert results == [expected] * 3
        results[0]["decode-0"]["ok"] = False  # callers get copies
        assert results[1]["decode-0"]["ok"] is True
        # the round is over: the next call asks again
        again = asyncio.create_task(admin.check_pools(timeout_s=0.05))
        await asyncio.sleep(0.01)
        assert len(link.sent) == 4
        admin.on_answer(b"decode-0", P.PoolReport(admin._round, True, None, 0, 0))
        out = await again
        assert out["decode-0"]["ok"] and "no answer" in str(out["prefill-0"]["error"])
    asyncio.run(main())


def test_a_caller_that_leaves_does_not_end_the_round_for_the_others() -> None:
    async def main() -> None:
        admin, _ = _admin("decode-0")
        first = asyncio.create_task(admin.check_pools(timeout_s=5.0))
        second = asyncio.create_task(admin.check_pools(timeout_s=5.0))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        admin.on_answer(b"decode-0", P.PoolReport(admin._round, True, None, 0, 0))
        assert (await second)["decode-0"]["ok"] is True
    asyncio.run(main())


def test_no_live_worker_is_an_empty_answer() -> None:
    admin, _ = _admin()
    assert asyncio.run(admin.check_pools(timeout_s=0.1)) == {}


def test_a_late_answer_never_counts_for_a_later_round() -> None:
    """A worker that answered after its round timed out must not answer the next one."""
    async def main() -> None:
        admin, link = _admin("decode-0")
        first = await admin.check_pools(timeout_s=0.02)
        assert "no answer" in str(first["decode-0"]["error"])
        late = P.PoolReport(link.sent[0][1].round, True, None, 0, 0)  # type: ignore[attr-defined]
        second = asyncio.create_task(admin.check_pools(timeout_s=0.1))
        await asyncio.sleep(0.01)
        admin.on_answer(b"decode-0", late)  # round 1's answer, in round 2
        assert "no answer" in str((await second)["decode-0"]["error"])
        assert [m.round for _, m in link.sent] == [1, 2]  # type: ignore[attr-defined]
    asyncio.run(main())
