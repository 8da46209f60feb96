"""The goodput study's pure logic (benchmarks/goodput_study.py): the rate search, the SLO rule,
the table's texts, the checkpoint round trip, the hand-written parts of its section, the
configuration list and the prompts' salting (no prefix cache hit across runs). The vLLM
peer's own parts are in test_vllm_peer.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import goodput_report as gp_doc  # noqa: E402
from benchmarks import goodput_setups as setups  # noqa: E402
from benchmarks import goodput_study as study  # noqa: E402
from splitserve.bench import (SLO, BenchConfig, BenchReport, RequestRecord,  # noqa: E402
                              SweepReport, compute_metrics, write_json)
from splitserve.bench.arrivals import ArrivalInfo  # noqa: E402
from splitserve.bench.client import ServerInfo  # noqa: E402
from splitserve.bench.workload import WorkloadInfo, build_workload  # noqa: E402


def search(knee: int, start: int, size: int, max_points: int = 99) -> dict[int, float]:
    """Runs next_index against a system that meets the target below ladder index `knee`."""
    results: dict[int, float] = {}
    while len(results) < max_points:
        i = study.next_index(results, start, size)
        if i is None:
            break
        results[i] = 1.0 if i < knee else 0.5
    return results


def test_next_index_doubles_up_then_bisects() -> None:
    assert study.next_index({}, 3, 8) == 3
    assert study.next_index({3: 0.95}, 3, 8) == 5
    assert study.next_index({3: 0.95, 5: 0.95}, 3, 8) == 7
    assert study.next_index({3: 0.95, 5: 0.5}, 3, 8) == 4
    assert study.next_index({3: 0.95, 5: 0.5, 4: 0.9}, 3, 8) is None  # 0.9 meets the target


def test_next_index_halves_down_and_stops_at_the_ends() -> None:
    assert study.next_index({3: 0.5}, 3, 8) == 1
    assert study.next_index({3: 0.5, 1: 0.5}, 3, 8) == 0
    assert study.next_index({3: 0.5, 1: 0.5, 0: 0.5}, 3, 8) is None
    assert study.next_index({6: 1.0}, 6, 8) == 7
    assert study.next_index({6: 1.0, 7: 1.0}, 6, 8) is None


def test_next_index_brackets_below_the_lowest_miss() -> None:
    # A noisy pass above a miss is ignored: the bracket ends at the lowest miss.
    assert study.next_index({1: 1.0, 3: 0.5, 5: 1.0}, 1, 8) == 2


@pytest.mark.parametrize("knee", range(0, 9))
def test_search_finds_every_knee_to_one_step(knee: int) -> None:
    results = search(knee, start=3, size=8)
    passed = [i for i, a in results.items() if a >= study.TARGET]
    assert max(passed, default=None) == (min(knee, 8) - 1 if knee > 0 else None)
    if 0 < knee < 8:
        assert knee in results  # the first miss was run, so the bracket is one step
    assert len(results) <= 5


def test_ladders_start_where_every_configuration_starts() -> None:
    a = study.WORKLOADS["a"]
    ladder = a.ladder(quick=False)
    assert len(ladder) == a.steps and ladder[0] == a.low
    assert ladder[2] == pytest.approx(2 * a.low)
    assert a.ladder(quick=True)[0] == 2 * a.low
    assert a.config(quick=True).length_scale == 0.25
    assert study.WORKLOADS["c"].config(quick=True).length_scale == pytest.approx(1 / 64)
    assert a.config(quick=False).input_len.mean == 1536


def test_derive_slo_is_factor_times_unloaded_in_whole_ms() -> None:
    assert study.derive_slo(4.1053, 0.0581, 3.0, 1.5) == SLO(ttft_ms=12316, tpot_ms=87)


def row(max_rate: float | None, first_miss: float | None, points: list[list[float]]) -> dict:
    return {"max_rate": max_rate, "first_miss": first_miss, "points": points}


def test_rate_and_ratio_texts() -> None:
    agg = row(0.1, 0.14, [[0.1, 0.95], [0.14, 0.5]])
    disagg = row(0.25, 0.35, [[0.18, 1.0], [0.25, 0.9], [0.35, 0.6]])
    assert gp_doc._rate_text(agg) == "0.1 (misses at 0.14)"
    assert gp_doc.ratio_text(disagg, agg) == "2.50x"
    assert gp_doc.ratio_text(agg, agg) == "1"
    none = row(None, 0.18, [[0.18, 0.5]])
    assert gp_doc._rate_text(none) == "< 0.18"
    assert gp_doc.ratio_text(disagg, none) == "> 1.39x"
    assert gp_doc.ratio_text(none, agg) == "< 1.80x"
    top = row(0.5, None, [[0.25, 1.0], [0.5, 1.0]])
    assert gp_doc._rate_text(top) == ">= 0.5 (no miss)"
    assert gp_doc.ratio_text(top, agg) == ">= 5.00x"
    assert gp_doc.ratio_text(agg, top) == "<= 0.20x"


def report(rate: float, ttfts: list[float]) -> BenchReport:
    slo = SLO(ttft_ms=500, tpot_ms=50)
    config = BenchConfig(rate=rate, slo=slo, label="agg", run_index=10)
    records = []
    for i, ttft in enumerate(ttfts):
        records.append(RequestRecord(i, 100, 3, i / rate, send_s=i / rate,
                                     chunk_s=[i / rate + ttft + k * 0.04 for k in range(3)],
                                     end_s=i / rate + ttft + 0.1, output_tokens=3))
    info = WorkloadInfo("synthetic", "x", len(records), 1.0, 4096, 0, 100, 100, 3, 3, 0.0)
    duration = max(r.end_s or 0.0 for r in records)
    return BenchReport(config, ServerInfo("http://x", "m", ["m"], 4096), info,
                       ArrivalInfo("poisson", rate, 1.0, None, None, rate, 1.0),
                       compute_metrics(records, duration, slo), None, records)


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    sweep = SweepReport("agg", [report(1.0, [0.1] * 10), report(2.0, [0.1] * 8 + [0.9] * 2)])
    write_json(sweep, tmp_path / "a_agg.json")
    back = study.load_sweep(tmp_path / "a_agg.json")
    assert back.label == "agg" and back.rates == [1.0, 2.0]
    assert [r.metrics.slo_attainment for r in back.runs] == [1.0, 0.8]
    assert back.max_rate_meeting(0.9) == sweep.max_rate_meeting(0.9) == 1.0
    assert back.runs[1].records[9].ttft_s == pytest.approx(0.9)
    assert study.cdf_rate([sweep, back]) == 2.0  # no spread: the highest common rate


def test_hand_written_parts_survive_and_default(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Goodput study\n\nMeasured x.\n\n"
                   "### Method (hand-written)\n\nM1\n\n### (a) generated\n\n| t |\n\n"
                   "### Reading (hand-written)\n\nR1\nR2\n\n## Other\n\nkeep\n")
    method, reading = gp_doc.hand_written(doc)
    assert method == "### Method (hand-written)\n\nM1"
    assert reading == "### Reading (hand-written)\n\nR1\nR2"
    method, reading = gp_doc.hand_written(tmp_path / "missing.md")
    assert method.startswith("### Method (hand-written)")
    assert reading.startswith(gp_doc.READING)


def test_default_configs_include_the_vllm_peer() -> None:
    args = study.parse_args([])
    assert args.configs == ["agg", "disagg", "auto", "default", "vllm"]
    assert study.parse_args(["--configs", "agg, vllm"]).configs == ["agg", "vllm"]
    with pytest.raises(SystemExit):
        study.parse_args(["--configs", "agg,sglang"])
    vllm = setups.SETUPS["vllm"]
    assert vllm.server is setups.Server.VLLM and not vllm.takes_slo
    assert setups.VLLM_CONFIGS == ("vllm", "vllm-fp32")
    fp32 = setups.SETUPS["vllm-fp32"]
    assert fp32.server is setups.Server.VLLM and fp32.flags[:2] == ("--dtype", "float32")
    assert vllm.flags[:2] == ("--dtype", "bfloat16")


def test_vllm_setup_needs_its_prepared_peer() -> None:
    with pytest.raises(ValueError, match="VllmPeer.prepare"):
        with setups.serving(setups.SETUPS["vllm"], None):
            pass


def test_estimate_counts_vllm_load() -> None:
    args = study.parse_args(["--configs", "agg,vllm"])
    args.quick, args.max_points = False, 5
    with_vllm = study.estimate_s(setups.WORKLOADS["b"], args, 40)
    args.configs = ["agg", "disagg"]
    assert with_vllm - study.estimate_s(setups.WORKLOADS["b"], args, 40) == study.VLLM_LOAD_S
    args.configs = ["agg", "vllm", "vllm-fp32"]  # each vLLM server loads and compiles anew
    both = study.estimate_s(setups.WORKLOADS["b"], args, 40)
    args.configs = ["agg", "vllm", "disagg"]
    assert both - study.estimate_s(setups.WORKLOADS["b"], args, 40) == study.VLLM_LOAD_S


@pytest.mark.parametrize("key", sorted(setups.WORKLOADS))
def test_no_run_reuses_another_runs_prompt_blocks(key: str) -> None:
    """vLLM caches prefixes by default (16-token blocks): the warm-up, the calibration and
    every ladder point of the study must share no block, or a later run reads as faster."""
    w = setups.WORKLOADS[key]
    runs = [setups.WARMUP_RUN, setups.CALIBRATE_RUN,
            *(setups.FIRST_POINT_RUN + i for i in range(w.steps))]
    assert len(set(runs)) == len(runs)
    prompts = [[r.prompt_token_ids for r in build_workload(
        w.config(quick=True, num_requests=6, run_index=run), setups.MAX_MODEL_LEN).requests]
        for run in runs]
    blocks = [{tuple(p[i:i + 16]) for p in run for i in range(0, len(p) - 15, 16)}
              for run in prompts]
    for a in range(len(blocks)):
        for b in range(a + 1, len(blocks)):
            assert not blocks[a] & blocks[b], (runs[a], runs[b])


def test_the_default_setup_is_told_the_workload_and_reports_its_choice() -> None:
    import http.server
    import threading

    from benchmarks.goodput_setups import SETUPS, chosen_layout

    default = SETUPS["default"]
    assert default.flags == () and default.takes_slo and default.takes_hint
    assert not any(s.takes_hint for name, s in SETUPS.items() if name != "default")
    pages = ['splitserve_layout_info{decode="2",layout="agg",prefill="0",reason="r"} 1.0\n',
             'x 1\nsplitserve_layout_info{decode="1",layout="disagg",prefill="1",'
             'reason="a, b"} 1.0\n', "x 1\n"]

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = pages.pop(0).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert chosen_layout(url) == "chose agg x2"
        assert chosen_layout(url) == "chose disagg 1P+1D"
        with pytest.raises(RuntimeError, match="no splitserve_layout_info"):
            chosen_layout(url)
    finally:
        server.shutdown()


def test_rerun_hint_repeats_the_tables_configs_and_given_slos() -> None:
    rows = [{"config": "agg"}, {"config": "vllm"}]
    given = {"key": "a", "rows": rows,
             "calibration": {"override": True, "slo": {"ttft_ms": 8000.0, "tpot_ms": 100.0}}}
    assert gp_doc._rerun(given) == ("python benchmarks/goodput_study.py --table a --configs "
                                   "agg,vllm --slo-ttft-ms 8000 --slo-tpot-ms 100")
    derived = {**given, "calibration": {"slo": {"ttft_ms": 9534, "tpot_ms": 30}}}
    assert gp_doc._rerun(derived).endswith("--table a --configs agg,vllm")  # measured again
    variant = {**derived, "key": "a-derived", "table": "a", "variant": "derived"}
    assert gp_doc._rerun(variant).endswith("--table a --configs agg,vllm --variant derived")
    shorter = {**variant, "length_scale": 0.25}
    assert gp_doc._rerun(shorter).endswith("--variant derived --length-scale 0.25")


def test_length_scale_is_a_variant_of_a_table() -> None:
    for bad in (["--length-scale", "0.25"], ["--variant", "x", "--length-scale", "0"]):
        with pytest.raises(SystemExit):
            study.parse_args(["--table", "c", *bad])
    args = study.parse_args(["--table", "c", "--variant", "x", "--length-scale", "0.25"])
    assert args.length_scale == 0.25


def test_a_variant_is_kept_beside_its_plain_table(tmp_path: Path) -> None:
    for name in ("b.json", "a-strict.json", "a.json", "a_agg.json", "a-strict_agg.json",
                 "a_slo.json", "a-strict_slo.json", "c-x.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in gp_doc.tables_in(tmp_path)] == [
        "a.json", "a-strict.json", "b.json", "c-x.json"]
    with pytest.raises(SystemExit):
        study.parse_args(["--variant", "Bad_Name"])
    args = study.parse_args(["--table", "a", "--variant", "strict-tpot"])
    assert args.variant == "strict-tpot"


def test_default_is_told_the_workloads_prompt_spread() -> None:
    """`default` gets --workload-hint MEAN:OUTPUT:CV of the prompts the sweeps send, which
    ServeConfig accepts; the Mooncake replay is far more spread than chat's uniform."""
    from splitserve.config import ServeConfig

    hints = {key: study.workload_hint(setups.WORKLOADS[key], False, 30) for key in "bc"}
    parsed = {key: ServeConfig(workload_hint=hint).workload_tokens
              for key, hint in hints.items()}
    chat, replay = parsed["b"], parsed["c"]
    assert chat[2] is not None and replay[2] is not None
    assert 0.1 < chat[2] < 0.6 < replay[2]
    assert replay[0] == 839 and replay[1] == 24  # the (c) table's mean prompt and output
