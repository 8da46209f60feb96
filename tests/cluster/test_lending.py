"""The lease's two sides as the worker loop drives them (cluster/worker/lending.py): a
borrower tells its demand through the shared file, a lender raises and lowers the lease
and, with a pace, waits between decode-only steps only while that demand is up. Two
mappings of one file stand for the two processes; the lender's side runs the real kernels'
lease_hold/lease_free (no helper threads: those are tests/model/test_helpers.py's)."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest
import torch

from splitserve.cluster.worker.lending import LeaseFile, Lending
from splitserve.config import PACE_SHARE, ServeConfig
from splitserve.model import kernels

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")


def _words(path: Path) -> tuple[int, int, int]:
    """(wanted, active, demand) as a third process reads them."""
    raw = path.read_bytes()
    return struct.unpack_from("I", raw, 0)[0], *struct.unpack_from("II", raw, 64)


def test_demand_travels_through_the_file_and_a_borrower_lowers_it(tmp_path: Path) -> None:
    path = tmp_path / "core1.lease"
    borrower = Lending([LeaseFile(str(path))], None)
    lender_view = LeaseFile(str(path))
    assert not lender_view.demand
    borrower.busy(True)  # prompts to compute
    assert lender_view.demand and _words(path) == (0, 0, 1)
    borrower.busy(False)
    assert not lender_view.demand
    borrower.busy(True)
    borrower.close()  # a borrower that stops leaves no demand behind
    assert not lender_view.demand
    lender_view.close()


def test_a_pacing_lender_waits_only_while_the_borrower_has_prompts(tmp_path: Path) -> None:
    path = tmp_path / "core1.lease"
    pace = 0.2
    lender = Lending.lend((str(path),), pace_s=pace)
    borrower = Lending([LeaseFile(str(path))], None)
    lender.busy(True)  # a step begins: the lease is raised
    assert _words(path)[0] == 1
    assert lender.pause_s(decode_only=True) == 0.0  # nobody wants the core
    borrower.busy(True)
    wait = lender.pause_s(decode_only=True)
    assert 0.15 < wait <= pace
    assert lender.pause_s(decode_only=False) == 0.0  # a prompt of its own: no waiting
    lender.busy(False)  # the worker loop lowers it before it sleeps
    assert _words(path)[0] == 0
    time.sleep(wait)
    assert lender.pause_s(decode_only=True) == 0.0  # its time has come
    lender.busy(True)
    assert lender.pause_s(decode_only=True) > 0.15  # counted from the new step
    borrower.busy(False)
    assert lender.pause_s(decode_only=True) == 0.0
    unpaced = Lending.lend((str(path),))  # a restarted lender lowers what it finds raised
    assert _words(path)[0] == 0
    borrower.busy(True)
    assert unpaced.pause_s(decode_only=True) == 0.0  # no pace: it never waits
    lender.close()
    unpaced.close()


def test_the_pace_is_a_share_of_the_tpot_target() -> None:
    assert ServeConfig(slo_tpot_ms=100).decode_pace_s == pytest.approx(PACE_SHARE * 0.1)
    assert ServeConfig().decode_pace_s is None  # no target
    assert ServeConfig(slo_tpot_ms=100, pace_decode=False).decode_pace_s is None
    assert 0.5 <= PACE_SHARE < 1.0
