"""Fixtures of the exact-kernel tests: the kernel module with its ISA level put back after
each test, and the ISA levels this CPU can run."""
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


@pytest.fixture
def isas(ops: ModuleType) -> list[int]:
    """ISA levels this CPU can run (AVX2 = 1, then AVX-512 BF16 = 2 where present)."""
    before = ops.get_isa()
    ops.set_isa(0)
    native = ops.get_isa()
    ops.set_isa(before)
    return list(range(1, native + 1))
