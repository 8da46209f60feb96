"""Fixtures of the exact-kernel tests: the kernel module with its ISA level put back after
each test, the ISA levels of the fold this CPU can run, and whether it has AMX."""
from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest

from splitserve.model import kernels


@pytest.fixture
def ops() -> Iterator[ModuleType]:
    """The kernel module; the ISA level set by a test is put back afterwards."""
    ops = kernels.load()
    before = ops.get_isa()
    yield ops
    ops.set_isa(before)


def native_isa(ops: ModuleType) -> int:
    """The highest ISA level this CPU runs (AVX2 = 1, AVX-512 BF16 = 2, AMX-BF16 = 3)."""
    before = ops.get_isa()
    ops.set_isa(0)
    native = ops.get_isa()
    ops.set_isa(before)
    return int(native)


@pytest.fixture
def isas(ops: ModuleType) -> list[int]:
    """The levels of the specified fold this CPU can run (AVX2 = 1, then AVX-512 BF16 = 2
    where present); AMX (3) computes bits of its own (test_exact_amx.py)."""
    return list(range(1, min(native_isa(ops), kernels.ISAS["avx512_bf16"]) + 1))


@pytest.fixture
def amx(ops: ModuleType) -> ModuleType:
    """The kernel module at the AMX-BF16 level (put back afterwards, as `ops`); skips on a
    CPU without AMX-BF16 or where Linux does not grant it."""
    if native_isa(ops) < kernels.ISAS["amx_bf16"]:
        pytest.skip("this CPU has no AMX-BF16 (or Linux does not grant its tile state)")
    ops.set_isa(kernels.ISAS["amx_bf16"])
    return ops
