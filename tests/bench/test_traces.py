"""Trace parsing (Mooncake JSONL, Azure CSV) and Mooncake prefix reconstruction from
hash_ids: equal ids, equal token blocks."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from splitserve.bench.config import BenchConfig
from splitserve.bench.errors import BenchSetupError
from splitserve.bench.tokens import TokenSynth
from splitserve.bench.traces import (default_trace_path, prompt_from_hash_ids, read_trace,
                                     scaled_block_size)
from splitserve.bench.workload import build_workload

MOONCAKE = [  # a and b share hash ids 0, 1; c shares only 0
    {"timestamp": 0, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 1536, "output_length": 30, "hash_ids": [0, 1, 3]},
    {"timestamp": 5999, "input_length": 600, "output_length": 5, "hash_ids": [0, 4]},
]


def _write_mooncake(tmp_path: Path, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_mooncake(tmp_path: Path) -> None:
    records = read_trace("mooncake", _write_mooncake(tmp_path, MOONCAKE), None)
    assert [r.timestamp_s for r in records] == [0.0, 3.0, 5.999]
    assert records[1].input_len == 1536 and records[1].output_len == 30
    assert records[2].hash_ids == (0, 4)
    assert len(read_trace("mooncake", _write_mooncake(tmp_path, MOONCAKE), 2)) == 2


def test_read_azure(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.5,396,109\n")
    records = read_trace("azure", path, None)
    assert [(r.timestamp_s, r.input_len, r.output_len, r.hash_ids) for r in records] == [
        (0.0, 374, 44, ()), (4.5, 396, 109, ())]


@pytest.mark.parametrize("row,message", [
    ({"timestamp": 0, "input_length": 1300, "output_length": 2, "hash_ids": [0, 1]}, "2 hash_ids"),
    ({"timestamp": 0, "input_length": 10, "hash_ids": [0]}, "line 1.*output_length"),
])
def test_bad_mooncake_lines_are_named(tmp_path: Path, row: dict[str, object],
                                      message: str) -> None:
    with pytest.raises(BenchSetupError, match=message):
        read_trace("mooncake", _write_mooncake(tmp_path, [row]), None)


def test_missing_trace_file_is_a_setup_error(tmp_path: Path) -> None:
    with pytest.raises(BenchSetupError, match="--trace"):
        read_trace("azure", tmp_path / "nope.csv", None)


def test_shared_hash_ids_share_exactly_their_blocks() -> None:
    synth = TokenSynth(seed=3)
    a = prompt_from_hash_ids((0, 1, 2), 1300, 512, synth, 0)
    b = prompt_from_hash_ids((0, 1, 3), 1536, 512, synth, 1)
    c = prompt_from_hash_ids((0, 4), 600, 512, synth, 2)
    assert (len(a), len(b), len(c)) == (1300, 1536, 600)  # last block cut to input_length
    assert a[:1024] == b[:1024]  # k = 2 shared ids -> exactly 2 * 512 shared tokens
    assert a[1024:1300] != b[1024:1300]
    assert a[:512] == c[:512] and a[512:600] != c[512:600]
    assert TokenSynth(seed=3).block(2, 512)[:276] == a[1024:]  # block = f(seed, hash id)
    assert TokenSynth(seed=4).block(0, 512) != synth.block(0, 512)


def test_mooncake_workload_scales_blocks_with_lengths(tmp_path: Path) -> None:
    cfg = BenchConfig(workload="mooncake", trace=str(_write_mooncake(tmp_path, MOONCAKE)),
                      num_requests=3, length_scale=1 / 16)
    wl = build_workload(cfg, None)
    a, b, c = (r.prompt_token_ids for r in wl.requests)
    assert scaled_block_size(1 / 16) == wl.info.block_size == 32
    assert (len(a), len(b), len(c)) == (81, 96, 38)  # round(length / 16)
    assert [r.output_len for r in wl.requests] == [1, 2, 1]
    assert a[:64] == b[:64] and a[64:] != b[64:81]
    assert a[:32] == c[:32] and a[32:38] != c[32:]
    assert [r.timestamp_s for r in wl.requests] == [0.0, 3.0, 5.999]
    assert wl.jitter_s == 3.0  # the Mooncake clock's granularity


def _real(kind: str) -> Path:
    path = default_trace_path(kind)
    # The traces live in ../shared beside the checkout, on CI and every developer machine.
    assert path.exists(), f"{path} is missing: clone the repository next to shared/"
    return path


def test_real_mooncake_trace_first_lines() -> None:
    records = read_trace("mooncake", _real("mooncake"), 300)
    assert len(records) == 300
    first = records[0]
    assert (first.timestamp_s, first.input_len, first.output_len) == (0.0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert all(len(r.hash_ids) == math.ceil(r.input_len / 512) for r in records)
    assert all(a.timestamp_s <= b.timestamp_s for a, b in zip(records, records[1:]))
    assert sum(r.hash_ids[0] == 0 for r in records) > 1  # a shared first block exists


def test_real_mooncake_prefix_sharing_is_reproduced() -> None:
    cfg = BenchConfig(workload="mooncake", num_requests=50, length_scale=1 / 16)
    wl = build_workload(cfg, None)
    records = read_trace("mooncake", _real("mooncake"), 50)
    for i, j in [(0, 1), (0, 2), (1, 2)]:
        shared = next((k for k, (x, y) in enumerate(zip(records[i].hash_ids,
                                                        records[j].hash_ids)) if x != y), 0)
        pi, pj = wl.requests[i].prompt_token_ids, wl.requests[j].prompt_token_ids
        assert pi[:shared * 32] == pj[:shared * 32]
        assert pi[shared * 32:shared * 32 + 32] != pj[shared * 32:shared * 32 + 32]


def test_real_azure_trace_first_lines() -> None:
    records = read_trace("azure", _real("azure"), 300)
    assert len(records) == 300
    assert (records[0].timestamp_s, records[0].input_len, records[0].output_len) == (0.0, 374, 44)
    assert (records[1].timestamp_s, records[1].input_len) == (pytest.approx(4.314579), 396)
    assert all(r.input_len > 0 and r.output_len > 0 for r in records)
