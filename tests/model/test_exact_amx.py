"""The linear on AMX-BF16 tiles (csrc/linear_amx.h): batch-invariant, with bits of its own.

TDPBF16PS does not compute the fold the other paths share (its rounding inside a 32-product
sum is not documented), so there is no emulation to compare with. What is checked instead,
on CPUs with AMX (the tests skip elsewhere): a row's bits do not depend on the row count,
the rows around it or the thread count; int8 weights are the bf16 tiles over the same
integers; a K that is not a multiple of 32 takes the specified fold; the layer is the
linear to bf16 rounding; and the fingerprint of an engine on AMX is not the fold's.
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn

from splitserve.model import kernels

from tests.model.test_exact_kernels import _fold


def test_amx_rows_do_not_depend_on_rows_neighbours_or_threads(amx: ModuleType) -> None:
    torch.manual_seed(3)
    lin = nn.Linear(576, 200, bias=True).to(torch.bfloat16)
    exact = kernels.ExactLinear(lin)
    x = torch.randn(130, 576, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = exact(x)
        for num_threads in (1, 2, 3):  # 3: more threads than cores, shares taken over
            torch.set_num_threads(num_threads)
            for rows in (1, 2, 15, 16, 17, 31, 63, 64, 65, 130):
                assert torch.equal(exact(x[:rows]), want[:rows]), (num_threads, rows)
                assert torch.equal(exact(x[-rows:]), want[-rows:]), (num_threads, rows)
        # other rows beside it in the same tile change nothing
        noisy = torch.randn(16, 576, dtype=torch.bfloat16) * 100
        noisy[5] = x[7]
        assert torch.equal(exact(noisy)[5], want[7])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(want, lin(x), rtol=2e-2, atol=2e-2)
    # the tiles are a path of their own: the fold (AVX-512 BF16) differs somewhere
    amx.set_isa(kernels.ISAS["avx512_bf16"])
    assert not torch.equal(exact(x), want)


def test_amx_int8_is_the_bf16_tiles_over_the_same_integers(amx: ModuleType) -> None:
    torch.manual_seed(4)
    q = torch.randint(-127, 128, (80, 1536), dtype=torch.int8)
    x = torch.randn(37, 1536, dtype=torch.bfloat16)
    as_bf16 = amx.linear(x, kernels.pack_weight(q.to(torch.bfloat16)), 80, None, None)
    for rows in (1, 5, 37):  # decode rows too: the int8 group is widened for the tiles
        as_int8 = amx.linear(x[:rows], kernels.pack_weight(q), 80, None, torch.ones(80))
        assert torch.equal(as_int8, as_bf16[:rows]), rows


@pytest.mark.parametrize("k", [48, 37])
def test_amx_takes_the_fold_where_k_is_not_a_multiple_of_32(amx: ModuleType, k: int) -> None:
    torch.manual_seed(k)
    lin = nn.Linear(k, 70, bias=False).to(torch.bfloat16)
    x = torch.randn(20, k, dtype=torch.bfloat16)
    assert torch.equal(kernels.ExactLinear(lin)(x), _fold(x, lin.weight.detach()))


def test_an_amx_engine_has_a_fingerprint_of_its_own(amx: ModuleType) -> None:
    assert kernels.kernels_version() == kernels.EXACT_KERNELS + "+amx"
    amx.set_isa(kernels.ISAS["avx512_bf16"])
    assert kernels.kernels_version() == kernels.EXACT_KERNELS
