"""A decode worker lends its cores to a prefill worker while it has nothing to step.

With --prefill-borrows-cores (cluster/specs.py) the prefill worker runs a helper thread on
each lent core, at nice 19, that takes tasks of its ops (model/kernels/csrc/helpers.h).
Each lent core has a lease: a 128-byte file in shared memory both workers map. The decode
worker raises it when it gets work (`Lending.busy(True)`), waiting a moment for the helper
to finish the task it holds, and lowers it when it has none left; a helper takes no task
while it is raised. So the prefill's ops never wait for a helper the decode worker
preempted (they did when the borrowed thread was a member of the team: 4.4x the TTFT
under a steady decode load), and prefill uses the core whenever decode leaves it idle.

With a TPOT target (--slo-tpot-ms) the decode worker also paces itself while the prefill
worker has prompts to compute (the lease's `demand` word): it starts a decode-only step at
most every config.PACE_SHARE x the target and lowers the lease in between, so the prefill
gets most of the core while the decode worker holds sequences, and every token still
comes within the target (`Lending.pause_s`; --no-pace-decode turns it off).

The lease only decides who computes an op's tasks, never what they compute: the outputs
are the same bits with or without helpers (tests/model/test_helpers.py).
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import tempfile
import time
from collections.abc import Iterable

logger = logging.getLogger(__name__)

LEASE_BYTES = 128  # kernels/csrc/helpers.h: struct Lease
HOLD_TIMEOUT_S = 0.005  # longest wait for a helper to leave: its task (~0.01-2 ms)
BORROWER_NICE = 19  # the helpers: every other thread on the lent core goes first
DEMAND_OFFSET = 68  # struct Lease's `demand` word


def lease_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def lease_path(tag: str, core: int) -> str:
    """The lease file of lent core `core` of the server `tag` names."""
    return os.path.join(lease_dir(), f"{tag}-core{core}.lease")


def remove_leases(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class LeaseFile:
    """One lease, mapped: its address is what the kernels read and write."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < LEASE_BYTES:
                os.ftruncate(fd, LEASE_BYTES)
            self._map = mmap.mmap(fd, LEASE_BYTES)  # page-aligned, as the kernels need
        finally:
            os.close(fd)
        self._view = ctypes.c_char.from_buffer(self._map)
        self._demand = ctypes.c_uint32.from_buffer(self._map, DEMAND_OFFSET)
        self.address = ctypes.addressof(self._view)
        self.path = path

    @property
    def demand(self) -> bool:
        return bool(self._demand.value)

    @demand.setter
    def demand(self, wanted: bool) -> None:
        self._demand.value = int(wanted)  # one aligned 4-byte store

    def close(self) -> None:
        del self._view, self._demand
        self._map.close()


class Lending:
    """A worker's part in lending: a decode worker's leases (lender), or a prefill
    worker's helpers (borrower)."""

    def __init__(self, lent: list[LeaseFile], kernels: object | None,
                 pace_s: float | None = None) -> None:
        self.lent, self.kernels, self.held = lent, kernels, False
        self.pace_s, self.stepped_at = pace_s, 0.0

    @staticmethod
    def borrow(cores: tuple[int, ...], leases: tuple[str, ...]) -> Lending:
        """Starts a helper on each of `cores`, watching its lease."""
        from splitserve.model import kernels
        files = [LeaseFile(p) for p in leases]
        for lease in files:  # a predecessor killed while it had prompts
            lease.demand = False
        kernels.load().start_helpers(list(cores), list(leases), BORROWER_NICE)
        logger.info("helper threads on the lent cores %s at nice %d", cores, BORROWER_NICE)
        return Lending(files, None)

    @staticmethod
    def lend(leases: tuple[str, ...], pace_s: float | None = None) -> Lending:
        from splitserve.model import kernels
        files, ops = [LeaseFile(p) for p in leases], kernels.load()
        for lease in files:  # a predecessor killed while it held one
            ops.lease_free(lease.address)
        return Lending(files, ops, pace_s)

    def pause_s(self, decode_only: bool) -> float:
        """How long a pacing lender waits before its next step: until its pace after the
        last one began, while that step would only decode and a borrower has prompts;
        else 0."""
        if self.pace_s is None or not decode_only or not any(f.demand for f in self.lent):
            return 0.0
        return max(0.0, self.stepped_at + self.pace_s - time.monotonic())

    def busy(self, busy: bool) -> None:
        """The lender steps now (raise every lease, wait for the helpers to leave) or does
        not (lower them); the borrower has prompts to compute or has none (`demand`)."""
        if self.kernels is None:
            if busy != self.held:
                self.held = busy
                for lease in self.lent:
                    lease.demand = busy
            return
        if busy:
            self.stepped_at = time.monotonic()
        if busy == self.held:
            return
        self.held = busy
        for lease in self.lent:
            if not busy:
                self.kernels.lease_free(lease.address)  # type: ignore[attr-defined]
            elif not self.kernels.lease_hold(  # type: ignore[attr-defined]
                    lease.address, HOLD_TIMEOUT_S):
                logger.debug("a helper on %s kept its task past %.0f ms", lease.path,
                             HOLD_TIMEOUT_S * 1e3)

    def close(self) -> None:
        """A lender's leases lowered and unmapped (a borrower's stay, its demand lowered:
        its helpers run until the process ends)."""
        self.busy(False)
        if self.kernels is None:
            return
        for lease in self.lent:
            lease.close()
