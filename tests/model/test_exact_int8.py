"""Weight-only int8 on the exact kernels (csrc/exact.cpp) computes one specified function
per output element: y[i, j] = bf16(fold(x[i], q[j]) * scale[j] (+ bias[j])), the fold being
the bf16 linear's (pairwise FMAs over k, odd element first) over the int8 values.

Checked on whatever x86 CPU runs the tests: against a torch emulation of that function,
against the bf16 kernel over the same integers (a unit scale), rows alone vs batched, and
AVX2 vs AVX-512 BF16 bit for bit; and the quantizer's round trip."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve.model import kernels
from splitserve.model.quant import int8_weights

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """The specified arithmetic in plain torch: every product of a bf16 and an int8 is
    exact in fp32, so these adds are the kernel's FMAs; then one multiply, one add."""
    xf, qf = x.float(), q.float()
    acc = torch.zeros(x.shape[0], q.shape[0])
    for p in range((x.shape[1] + 1) // 2):
        if 2 * p + 1 < x.shape[1]:
            acc = acc + xf[:, 2 * p + 1, None] * qf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * qf[None, :, 2 * p]
    y = acc * scale
    return (y if bias is None else y + bias).to(torch.bfloat16)


@pytest.mark.parametrize("k,n,bias", [(64, 48, False), (37, 45, True), (576, 960, True),
                                      (1536, 200, False)])
def test_int8_linear_is_the_specified_function_on_every_isa(ops, isas: list[int], k: int,
                                                           n: int, bias: bool) -> None:
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    exact = kernels.ExactLinear(lin, "int8")
    assert exact.packed.dtype == torch.int8 and exact.scale is not None
    x = torch.randn(13, k, dtype=torch.bfloat16)
    q, scale = int8_weights(lin.weight)
    want = _reference(x, q, scale, exact.bias)
    for isa in isas:
        ops.set_isa(isa)
        got = exact(x)
        assert torch.equal(got, want), isa
        for rows in (1, 2, 7):  # rows alone or in any batch: the same bits
            assert torch.equal(exact(x[3:3 + rows]), want[3:3 + rows]), (isa, rows)


def test_unit_scale_int8_is_the_bf16_kernel_over_the_same_integers(ops,
                                                                  isas: list[int]) -> None:
    torch.manual_seed(1)
    q = torch.randint(-127, 128, (80, 90), dtype=torch.int8)
    x = torch.randn(5, 90, dtype=torch.bfloat16)
    for isa in isas:
        ops.set_isa(isa)
        as_int8 = ops.linear(x, kernels.pack_weight(q), 80, None, torch.ones(80))
        as_bf16 = ops.linear(x, kernels.pack_weight(q.to(torch.bfloat16)), 80, None, None)
        assert torch.equal(as_int8, as_bf16), isa


def test_int8_weights_round_trip_within_half_a_step() -> None:
    torch.manual_seed(2)
    w = torch.randn(64, 100) * torch.linspace(0.01, 3, 64)[:, None]
    w[5] = 0  # an all-zero row keeps a positive scale
    q, scale = int8_weights(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool((scale > 0).all())
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all())


def test_int8_and_bf16_operands_are_checked(ops) -> None:
    q = kernels.pack_weight(torch.zeros(32, 16, dtype=torch.int8))
    x = torch.zeros(1, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="scale"):
        ops.linear(x, q, 32, None, None)  # int8 without its scales
    with pytest.raises(RuntimeError, match="scale"):
        ops.linear(x, kernels.pack_weight(torch.zeros(32, 16, dtype=torch.bfloat16)), 32,
                   None, torch.ones(32))  # bf16 with scales
    with pytest.raises(RuntimeError, match="scale"):
        ops.linear(x, q, 32, None, torch.ones(31))  # the wrong length
