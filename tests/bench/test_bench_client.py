"""The client and runner against a scripted OpenAI server over real HTTP: chunk timing,
usage vs chunk counting, failures as data, timeouts, the concurrency cap, session order,
setup errors, and the CLI's files and exit codes."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from fake_openai_server import MODEL, FakeOpenAI
from splitserve.bench.client import (RequestOptions, fetch_server_info, make_client,
                                     normalize_base_url, send_request)
from splitserve.bench.config import SLO, BenchConfig, LengthDist
from splitserve.bench.errors import BenchSetupError
from splitserve.bench.record import RequestRecord
from splitserve.bench.request import BenchRequest
from splitserve.bench.runner import run_bench
from splitserve.cli import main


def _send(url: str, max_tokens: int, endpoint: str = "completions",
          timeout_s: float = 10.0) -> RequestRecord:
    async def go() -> RequestRecord:
        client = make_client(url, timeout_s)
        record = RequestRecord(0, 3, max_tokens, 0.0)
        try:
            await send_request(client, RequestOptions(MODEL, endpoint, 0.0, timeout_s),
                               BenchRequest([5, 6, 7], max_tokens), record, time.perf_counter)
        finally:
            await client.close()
        return record
    return asyncio.run(go())


def test_chunks_are_timed_and_usage_counted(fake: FakeOpenAI, fake_url: str) -> None:
    fake.chunk_delay_s = 0.03
    r = _send(fake_url, 5)
    assert r.is_completed and r.status == 200 and r.error is None
    assert len(r.chunk_s) == 5 and r.output_tokens == 5 and r.usage_reported
    assert (r.prompt_tokens, r.cached_tokens) == (3, 3)
    assert all(gap >= 0.02 for gap in r.itl_s)
    assert r.send_s is not None and r.end_s is not None and r.send_s < r.chunk_s[0] <= r.end_s
    body = fake.received[0].body
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 5
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}


def test_without_usage_the_chunks_are_counted(fake: FakeOpenAI, fake_url: str) -> None:
    fake.send_usage = False
    r = _send(fake_url, 4)
    assert r.is_completed and r.output_tokens == 4 and not r.usage_reported


def test_chat_head_chunk_is_not_a_token(fake: FakeOpenAI, fake_url: str) -> None:
    r = _send(fake_url, 3, endpoint="chat")
    assert r.is_completed and len(r.chunk_s) == 3
    assert fake.received[0].body["messages"][0]["role"] == "user"


def test_http_error_is_recorded(fake: FakeOpenAI, fake_url: str) -> None:
    fake.fail_status = 503
    r = _send(fake_url, 4)
    assert not r.is_completed and r.status == 503 and "scripted failure" in (r.error or "")


def test_error_event_mid_stream_fails_the_request(fake: FakeOpenAI, fake_url: str) -> None:
    fake.error_after_chunks = 2
    r = _send(fake_url, 6)
    assert not r.is_completed and r.status == 200 and "boom mid-stream" in (r.error or "")
    assert len(r.chunk_s) == 2


def test_per_request_timeout(fake: FakeOpenAI, fake_url: str) -> None:
    fake.hang = True
    t0 = time.monotonic()
    r = _send(fake_url, 4, timeout_s=0.5)
    assert time.monotonic() - t0 < 3.0
    assert not r.is_completed and "0.5 s" in (r.error or "")


def test_server_info(fake: FakeOpenAI, fake_url: str) -> None:
    info = fetch_server_info(fake_url + "/v1/", None)
    assert (info.model, info.max_model_len, info.base_url) == (MODEL, 4096, fake_url)
    assert fetch_server_info(fake_url, "other-model").max_model_len is None
    with pytest.raises(BenchSetupError, match="fake-model, other-model"):
        fetch_server_info(fake_url, "nope")
    assert normalize_base_url("http://h:1/v1/") == "http://h:1"


def _cfg(url: str, **kw: object) -> BenchConfig:
    base: dict[str, object] = dict(base_url=url, num_requests=9, input_len=LengthDist("fixed", 8),
                                   output_len=LengthDist("fixed", 3))
    return BenchConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_failed_requests_are_counted_not_raised(fake: FakeOpenAI, fake_url: str) -> None:
    report = run_bench(_cfg(fake_url, slo=SLO(ttft_ms=10_000)))  # the probe succeeds first
    assert report.metrics.num_completed == 9
    fake.reset()
    fake.fail_status, fake.fail_every = 500, 3  # the probe is request 1; 3, 6, 9 fail
    report = run_bench(_cfg(fake_url, slo=SLO(ttft_ms=10_000)))
    m = report.metrics
    assert (m.num_sent, m.num_completed, m.num_failed) == (9, 6, 3)
    assert m.slo_attainment == pytest.approx(6 / 9)
    assert report.server_breakdown is None  # the fake has no /metrics
    assert all(r.output_tokens == 3 for r in report.records if r.is_completed)


def test_concurrency_cap(fake: FakeOpenAI, fake_url: str) -> None:
    fake.chunk_delay_s = 0.02
    run_bench(_cfg(fake_url, max_concurrency=2))
    assert fake.max_in_flight == 2


def test_session_turns_wait_for_their_previous_turn(fake: FakeOpenAI, fake_url: str) -> None:
    fake.chunk_delay_s = 0.02  # all arrive at once: only `after` holds later turns back
    report = run_bench(_cfg(fake_url, workload="sessions", turns=3, system_len=4,
                            num_requests=6))
    assert all(r.is_completed for r in report.records)
    got = {tuple(r.body["prompt"]): r for r in fake.received[1:]}  # [0] is the probe
    num_pairs = 0
    for prompt, later in got.items():
        for earlier_prompt, earlier in got.items():
            if len(earlier_prompt) < len(prompt) and prompt[:len(earlier_prompt)] == earlier_prompt:
                assert earlier.finished is not None and later.arrived >= earlier.finished
                num_pairs += 1
    assert num_pairs == 2 * 3  # per session: turn 1 after 0, turn 2 after 0 and 1


def test_probe_failure_is_a_setup_error(fake: FakeOpenAI, fake_url: str) -> None:
    fake.fail_status = 404
    with pytest.raises(BenchSetupError, match="probe request .* failed \\(HTTP 404\\)"):
        run_bench(_cfg(fake_url))


def test_cli_writes_every_output(fake: FakeOpenAI, fake_url: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--base-url", fake_url, "--num-requests", "4", "--input-len", "8",
                 "--output-len", "3", "--rate-sweep", "inf,50", "--slo-ttft-ms", "1000",
                 "--output-dir", str(tmp_path), "--label", "fk", "--no-progress"])
    assert code == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["fk.json", "fk.md", "fk_attainment.png", "fk_tpot_cdf.png",
                     "fk_ttft_cdf.png"]
    out = capsys.readouterr().out
    assert "# bench sweep `fk`" in out and (tmp_path / "fk.md").read_text() in out
    data = json.loads((tmp_path / "fk.json").read_text())
    assert [row["rate"] for row in data["summary"]] == ["inf", 50.0]
    assert [len(run["requests"]) for run in data["runs"]] == [4, 4]


def test_cli_setup_error_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "--base-url", "http://127.0.0.1:9", "--output-dir", str(tmp_path),
                 "--no-progress"])
    assert code == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
    assert main(["bench", "--workload", "azure", "--burstiness", "2", "--no-progress"]) == 2
    assert "--burstiness" in capsys.readouterr().err
