"""Worker counters reach /metrics as cumulative totals (LoadReport): the frontend adds
what grew, and a restarted worker (same id, totals from 0 again) still counts."""
from __future__ import annotations

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.metrics import Metrics


def _value(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _report(hit_tokens: int, tier_hits: int) -> P.LoadReport:
    usage = P.TierUsage("host", 100, 0, 0, tier_hits, 0, 0, 0, 0, 0, 0.0, 0.0, [], [])
    return P.LoadReport(0, 0, 0, 0, 0, 10, num_prefix_hit_tokens=hit_tokens, tiers=[usage])


def test_totals_add_what_grew_and_survive_a_restart() -> None:
    metrics = Metrics()
    for hits, tier_hits in ((32, 2), (48, 3), (48, 3), (16, 1), (20, 4)):  # restart at 16
        metrics.observe_load("both-0", _report(hits, tier_hits))
    assert _value(metrics, "splitserve_prefix_cache_hit_tokens_total", worker="both-0",
                  tier="device") == 48 + 20
    assert _value(metrics, "splitserve_kv_tier_hits_total", worker="both-0",
                  tier="host") == 3 + 4
    other = Metrics()  # another registry starts from zero
    other.observe_load("both-0", _report(5, 1))
    assert _value(other, "splitserve_kv_tier_hits_total", worker="both-0", tier="host") == 1
