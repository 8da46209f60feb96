"""The KV store benchmark's outputs (benchmarks/kv_store.py runs it): the hit-rate plot and
the markdown of the "KV store tiers" section of docs/benchmarks.md, whose hand-written
reading is kept across runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import _split_sections, markdown_table

SECTION, READING = "KV store tiers", "### Reading (hand-written)"
TIERS = ("host", "disk")


def plot_hits(results: list[dict[str, Any]], path: Path) -> None:
    """Hit rate by tier, stacked, per setup; one panel per workload; the infinite cache
    dashed, 90% of it dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.4 * len(results), 4.6), squeeze=False)
    for ax, res in zip(axes[0], results):
        names, bottom = [row["setup"] for row in res["rows"]], np.zeros(len(res["rows"]))
        for tier, color in (("device", "tab:blue"), ("host", "tab:orange"),
                            ("disk", "tab:green")):
            values = np.array([row["hit"][tier] for row in res["rows"]])
            ax.bar(names, values, bottom=bottom, color=color, label=f"{tier} hits", width=0.55)
            bottom += values
        inf = res["offline"]["rates"]["infinite"]
        ax.axhline(inf, color="black", linestyle="--", label=f"infinite cache {inf:.1%}")
        ax.axhline(0.9 * inf, color="grey", linestyle=":", label="90% of infinite")
        for x, total in enumerate(bottom):
            ax.text(x, total + 0.01, f"{total:.1%}", ha="center", fontsize="small")
        ax.set_title(res["title"], fontsize="medium")
        ax.set_ylim(0, max(inf, float(bottom.max())) * 1.15 + 0.02)
        ax.legend(fontsize="x-small", loc="lower center", bbox_to_anchor=(0.5, -0.32), ncol=2)
    axes[0][0].set_ylabel("share of prompt tokens served from a cache")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _traffic(t: dict[str, dict[str, float]], tier: str) -> str:
    refusals = ", ".join(f"{k.split('/')[1]} {v:.0f}" for k, v in t.get("refusals", {}).items()
                         if k.startswith(tier + "/") and v) or "none"
    return (f"{tier}: {t.get('hits', {}).get(tier, 0):.0f} blocks up in "
            f"{t.get('load_seconds', {}).get(tier, 0) * 1e3:.0f} ms, "
            f"{t.get('written_bytes', {}).get(tier, 0) / 2**20:.0f} MiB written in "
            f"{t.get('store_seconds', {}).get(tier, 0) * 1e3:.0f} ms, "
            f"{t.get('evictions', {}).get(tier, 0):.0f} evictions, refusals {refusals}")


def render(res: dict[str, Any], c: dict[str, Any], plots: Path) -> str:
    """One workload's subsection; `c`: the benchmark's constants (kv_store.settings())."""
    w, r, base = res["offline"], res["offline"]["rates"], res["calibration"]["pool"]
    info, slo, pool, host = w["info"], base["slo"], c["pool_blocks"], c["host_blocks"]
    rows = [[f"`{x['setup']}`", _pct(x["hit"]["device"]), _pct(x["hit"]["host"]),
             _pct(x["hit"]["disk"]), f"**{_pct(x['hit']['total'])}**", _pct(x["vs_infinite"]),
             f"{x['ttft_mean_ms']:.0f}", f"{x['ttft_p90_ms']:.0f}", f"{x['tpot_p90_ms']:.0f}",
             f"{x['attainment']:.0%}", f"{x['goodput']:.3f}", x["failed"],
             f"{x['other_cpu_cores']:.2f}"]
            for x in res["rows"]]
    tiered = next(x for x in res["rows"] if x["setup"] == "tiered")
    sample = (f"{len(res['trace_lines'])} turns, up to {c['window_s'] / 60:g} min into the trace, "
              f"of conversations drawn at random (seed 0); lengths x{info['length_scale']:g}, "
              f"{info['block_size']} tokens per hash id" if res["trace_lines"]
              else info["description"])
    cold = " / ".join(f"{k} {c['ttft0_ms']:.0f} ms" for k, c in res["calibration"].items())
    return "\n".join([
        f"### {res['title']}", "",
        f"Workload: {sample}; {info['num_requests']} requests, prompt mean "
        f"{info['mean_input_len']:.0f} / max {info['max_input_len']} tokens, output mean "
        f"{info['mean_output_len']:.0f}; {w['unique_blocks']} distinct 16-token blocks "
        f"({w['unique_blocks'] * c['block_bytes'] / 2**30:.2f} GiB of KV). Arrivals: "
        f"{tiered['rate']:g} req/s, Poisson or the trace's rescaled times ({c['load']:g} x the "
        f"cold capacity estimate: {base['service_s']:.2f} s per mean request, its prompt's "
        f"prefill and its decode unbatched).",
        "", f"SLO: TTFT <= {slo['ttft_ms']:g} ms ({c['k_ttft']:g} x {base['ttft0_ms']:.0f} ms, "
        f"the unloaded cold TTFT of a {w['p90_prompt']}-token prompt, the p90, on `pool`; by "
        f"setup: {cold}); no TPOT target (unloaded TPOT {base['tpot0_ms']:.1f} ms).", "",
        f"Infinite-cache hit rate **{_pct(r['infinite'])}**; offline, an LRU cache of "
        f"{pool} blocks keeps {_pct(r['lru_pool'])}, of {pool + host} "
        f"{_pct(r['lru_pool_host'])}.", "",
        markdown_table(["setup", "device pool", "host", "disk", "hit rate", "of infinite",
                        "mean TTFT ms", "p90 TTFT ms", "p90 TPOT ms", "SLO attainment",
                        "goodput req/s",
                        "failed", "other CPU (cores)"], rows), "",
        f"Tier traffic (`tiered`): {'; '.join(_traffic(tiered['tiers'], t) for t in TIERS)}."
        + (" A hit rate above the infinite cache's: requests were preempted (the pool ran "
           "out) and hit their own blocks when re-admitted; the server was overloaded."
           if any((x["vs_infinite"] or 0) > 1.0 for x in res["rows"]) else ""),
        "", f"Plots: [TTFT CDF]({plots / (res['key'] + '_ttft_cdf.png')}), "
        f"[hit rate by tier]({plots / 'hits.png'})."])


def method(quiet: dict[str, Any], c: dict[str, Any]) -> str:
    """The setups and definitions; `c`: the benchmark's constants."""
    nbytes = c["block_bytes"]
    return (
        f"Setups (one worker: `splitserve serve --mode agg --decode 1 --max-model-len "
        f"{c['max_model_len']} --enable-prompt-tokens-details`): `pool`, an engine pool of "
        f"{c['pool_blocks']} blocks alone (`--kv-cache-memory-bytes "
        f"{c['pool_blocks'] * nbytes}`, {c['pool_blocks'] * nbytes / 2**20:.0f} MiB); "
        f"`tiered`, the same pool + a host tier of {c['host_blocks']} blocks "
        f"({c['host_blocks'] * nbytes / 2**20:.0f} MiB) + a disk tier of {c['disk_blocks']} "
        f"blocks ({c['disk_blocks'] * nbytes / 2**30:.1f} GiB, a fresh directory under /tmp, "
        "`--kv-disk-admission all`). Hit rate = prompt tokens served from a cache / prompt "
        "tokens sent (`cached_tokens`; `splitserve_kv_tier_hits_total{tier}` x 16 of them came "
        "from a tier). Infinite cache: an unbounded prefix cache over the chained 16-token "
        "block hashes of the same prompts in arrival order, counting each prompt's leading "
        "blocks seen in an earlier one, at most (len - 1) // 16 (as the engine). Goodput: "
        "requests meeting the SLO per second of the run (duration: first arrival to last "
        "answer). Before the run other "
        f"processes used {quiet['other_cpu_cores']:.2f} cores"
        + (f" ({'; '.join(quiet['busy'])})" if quiet["busy"] else "") + f"; {quiet['code']}.")


def hand_written(doc: Path) -> str:
    text = doc.read_text() if doc.exists() else ""
    body = next((b for title, b in _split_sections(text)[1] if title == SECTION), "")
    start = body.find(READING)
    return body[start:].strip() if start >= 0 else f"{READING}\n\n_Not written yet._"
