"""The exact (batch-invariant) CPU kernels compute one specified function per output element.

Guarantees checked here, on whatever x86 CPU runs the tests:
- the linear's every output is the fold written in csrc/exact.cpp (pairwise FMAs over k,
  odd element first), checked against a torch emulation of that fold;
- so its rows do not depend on the row count, the thread count or the ISA path: AVX2 and
  AVX-512 BF16 give the same bits (checked where the CPU has both; AMX tiles have bits of
  their own, test_exact_amx.py);
- attention's every output is the arithmetic written in csrc/attention.cpp (two pairwise-FMA
  chains, a bf16 softmax numerator, one exp polynomial), checked against a torch emulation
  on every ISA level, in prefill runs and decode tokens alike; so it gives every token the
  same bits alone or batched, whatever its physical blocks, and is within bf16 rounding of
  an fp32 reference.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from splitserve.model import kernels

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")


def _fold(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The specified arithmetic in plain torch: acc += x[2p+1]*w[2p+1]; acc += x[2p]*w[2p]
    (each product is exact in fp32, so these adds are the FMAs)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for p in range((x.shape[1] + 1) // 2):
        if 2 * p + 1 < x.shape[1]:
            acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
        acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
    return acc.to(torch.bfloat16)


# (576, 176): 11 blocks in groups of 4 and 1, then 4 and 2 (BlockGroups); (576, 960) the
# model's QKV, 60 blocks: 7 groups of 4 and one of 2 in each half
@pytest.mark.parametrize("k,n", [(64, 48), (37, 45), (576, 960), (576, 176)])
def test_linear_is_the_specified_fold_on_every_isa(ops, isas: list[int], k: int,
                                                   n: int) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    exact = kernels.ExactLinear(lin)
    x = torch.randn(9, k, dtype=torch.bfloat16)
    want = _fold(x, lin.weight.detach())
    for isa in isas:
        ops.set_isa(isa)
        assert torch.equal(exact(x), want), f"isa level {isa}"
        # up to 6 rows (decode) take another split over threads: the same fold
        assert_rows_free(exact, x, want, (1, 4), isa)


def assert_rows_free(exact: nn.Module, x: torch.Tensor, want: torch.Tensor,
                     row_counts: tuple[int, ...], *label: object) -> None:
    """exact's first and last `rows` rows of x are want's, for every count, at 1, 2 and 3
    threads (3: more threads than cores, their shares taken over by the others)."""
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            for rows in row_counts:
                assert torch.equal(exact(x[:rows]), want[:rows]), (*label, num_threads, rows)
                assert torch.equal(exact(x[-rows:]), want[-rows:]), (*label, num_threads, rows)
    finally:
        torch.set_num_threads(threads)


def test_linear_rows_do_not_depend_on_rows_threads_or_isa(ops, isas: list[int]) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(576, 200, bias=True).to(torch.bfloat16)
    exact = kernels.ExactLinear(lin)
    x = torch.randn(130, 576, dtype=torch.bfloat16)
    ops.set_isa(isas[-1])  # the fold (AMX tiles compute their own bits)
    want = exact(x)
    for isa in isas:
        ops.set_isa(isa)
        assert_rows_free(exact, x, want, (1, 2, 3, 5, 6, 7, 12, 32, 33, 61, 64, 65, 130), isa)
    # and it is the linear layer, to bf16 rounding
    torch.testing.assert_close(want, lin(x), rtol=2e-2, atol=2e-2)


def _reference_attention(q, kv, tables, token_seq, ctx, scale):
    out = []
    heads, kv_heads = q.shape[1], kv.shape[3]
    for t in range(q.shape[0]):
        blocks = tables[token_seq[t]].long()
        keys = kv[0][blocks].flatten(0, 1)[:ctx[t]].float()  # [L, kv_heads, D]
        values = kv[1][blocks].flatten(0, 1)[:ctx[t]].float()
        qt = q[t].float().view(kv_heads, heads // kv_heads, -1)
        probs = (torch.einsum("hgd,lhd->hgl", qt, keys) * scale).softmax(-1)
        out.append(torch.einsum("hgl,lhd->hgd", probs, values).reshape(heads, -1))
    return torch.stack(out)


def _fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add: the product is exact in fp64, the sum rounded once to fp64
    and then to fp32 (a double rounding that differs from one rounding about once in 2^29
    sums, far rarer than these tests' few thousand)."""
    return (a.double() * b.double() + c.double()).float()


def _exp_polynomial(x: torch.Tensor) -> torch.Tensor:
    """common.h's exp16 / exp8, op by op in fp32."""
    f32 = functools.partial(torch.tensor, dtype=torch.float32)
    x = x.clamp(-87.0, 88.0)
    n = torch.round(x * f32(1.44269504088896341))
    r = _fma32(n, f32(-0.693359375), x)
    r = _fma32(n, f32(2.12194440e-4), r)
    p = torch.full_like(x, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1):
        p = _fma32(p, r, f32(c).expand_as(p))
    return (_fma32(p, r * r, r) + 1.0) * torch.pow(2.0, n)


def _tree16(lanes: torch.Tensor) -> torch.Tensor:
    """Lanes i + (i+8), then i + (i+4), i + (i+2), i + (i+1) (common.h's tree16)."""
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0]


def _specified_attention(q, kv, tables, token_seq, ctx, scale):
    """csrc/attention.cpp's formulas in torch, every op an fp32 op of the same operands in
    the same order (bf16 products are exact in fp32, so each add of one is the FMA)."""
    heads, kv_heads, d = q.shape[1], kv.shape[3], q.shape[2]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        n = int(ctx[t])
        blocks = tables[token_seq[t]].long()
        keys = kv[0][blocks].flatten(0, 1)[:n].float().transpose(0, 1)  # [kv_heads, L, D]
        values = kv[1][blocks].flatten(0, 1)[:n].float().transpose(0, 1)
        qt = q[t].float().view(kv_heads, heads // kv_heads, 1, d)
        acc = torch.zeros(kv_heads, heads // kv_heads, n)
        for i in range(d // 2):
            acc = acc + qt[..., 2 * i + 1] * keys[:, None, :, 2 * i + 1]
            acc = acc + qt[..., 2 * i] * keys[:, None, :, 2 * i]
        s = acc * torch.tensor(scale, dtype=torch.float32)
        p = _exp_polynomial(s - s.max(-1, keepdim=True).values).bfloat16().float()
        lanes = torch.nn.functional.pad(p, (0, -n % 16)).unflatten(-1, (-1, 16))
        z = _tree16(functools.reduce(torch.add, lanes.unbind(-2), torch.zeros(16)))
        p = torch.nn.functional.pad(p, (0, n % 2))  # p_L = 0 for an odd L
        values = torch.nn.functional.pad(values, (0, 0, 0, n % 2))
        o = torch.zeros(kv_heads, heads // kv_heads, d)
        for j in range(0, n, 2):
            o = o + p[..., j + 1, None] * values[:, None, j + 1]
            o = o + p[..., j, None] * values[:, None, j]
        out[t] = (o / z[..., None]).bfloat16().view(heads, d)
    return out


def _poisoned(kv: torch.Tensor, table: torch.Tensor, first: int) -> torch.Tensor:
    """kv with NaN in the K and V slots of positions >= first of the sequence of `table`."""
    dirty = kv.clone()
    blocks = table.long()
    slots = dirty[:, blocks].flatten(1, 2)  # [2, positions, kv_heads, head_dim]
    slots[:, first:] = float("nan")
    dirty[:, blocks] = slots.unflatten(1, (len(blocks), kv.shape[2]))
    return dirty


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (9, 3, 16), (8, 1, 128)])
def test_attention_is_the_specified_arithmetic_on_every_isa(ops, isas: list[int], heads: int,
                                                            kv_heads: int,
                                                            head_dim: int) -> None:
    """A prefill chunk of 40 tokens over 61 cached keys (runs of tokens share key tiles) and
    three decode tokens of another sequence: every output is the formulas' bits, and each
    token alone gets them too, with NaN in every slot of its sequence past its context (a
    slot there may hold anything: the run's later tokens, a peer's partial transfer)."""
    torch.manual_seed(5)
    num_blocks, block_size = 24, 16
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.stack([perm[:12], perm[12:]])
    token_seq = torch.tensor([0] * 40 + [1] * 3, dtype=torch.int32)
    ctx = torch.tensor(list(range(62, 102)) + [1, 33, 98], dtype=torch.int32)
    q = torch.randn(43, heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    want = _specified_attention(q, kv, tables, token_seq, ctx, scale)
    for isa in isas:
        ops.set_isa(isa)
        assert torch.equal(kernels.paged_attention(q, kv, tables, token_seq, ctx, scale),
                           want), isa
        for t in (0, 17, 38, 39, 40, 42):  # odd and even contexts
            alone = kernels.paged_attention(q[t:t + 1], _poisoned(kv, tables[token_seq[t]],
                                                                  int(ctx[t])),
                                            tables, token_seq[t:t + 1], ctx[t:t + 1], scale)
            assert torch.equal(alone[0], want[t]), (isa, t)
        # Key 79 of the chunk's sequence NaN: token 17 (79 keys, odd) shares its run with
        # tokens that see key 79, and neither scores nor weighs it.
        got = kernels.paged_attention(q, _poisoned(kv, tables[0], 79), tables, token_seq, ctx,
                                      scale)
        assert torch.equal(got[:18], want[:18]), isa


# (query heads, kv heads, head_dim): groups of 3, 5, 7 and 8 heads make runs of 16, 9, 6 and 6
# tokens (48 rows), head_dim 16 to 128 every register blocking of the AVX-512 path.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 16), (9, 3, 64), (9, 3, 80),
                                                     (8, 1, 128), (10, 2, 80), (14, 2, 64)])
def test_attention_is_per_token_and_block_layout_free(ops, isas: list[int], heads: int,
                                                      kv_heads: int,
                                                      head_dim: int) -> None:
    torch.manual_seed(2)
    num_blocks, block_size = 48, 16
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    perm = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.stack([perm[:20], perm[20:40]])
    token_seq = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.int32)
    ctx = torch.tensor([1, 17, 100, 33, 320, 250, 16], dtype=torch.int32)
    q = torch.randn(7, heads + kv_heads, head_dim, dtype=torch.bfloat16)[:, :heads]  # strided
    scale = head_dim ** -0.5
    outs = {}
    for isa in isas:
        ops.set_isa(isa)
        outs[isa] = kernels.paged_attention(q, kv, tables, token_seq, ctx, scale)
    got = outs[max(outs)]
    assert all(torch.equal(o, got) for o in outs.values()), "ISA paths differ"
    torch.testing.assert_close(got.float(), _reference_attention(q, kv, tables, token_seq, ctx,
                                                                 scale), rtol=2e-2, atol=1e-2)
    # Each token alone, with its sequence's blocks moved elsewhere: the same bits.
    moved = torch.empty_like(kv)
    new_ids = torch.randperm(num_blocks)
    moved[:, new_ids] = kv
    for t in range(7):
        table = new_ids[tables[token_seq[t]].long()].to(torch.int32)[None]
        alone = kernels.paged_attention(q[t:t + 1], moved, table,
                                        torch.zeros(1, dtype=torch.int32), ctx[t:t + 1], scale)
        assert torch.equal(alone[0], got[t]), t


def test_silu_mul_gives_its_formulas_bits_for_every_bf16_gate(ops, isas: list[int]) -> None:
    """The AVX-512 rows look SiLU up in a table of every bf16 gate's value (built with the
    formula's own code), from 5 rows on; fewer rows (decode) and the AVX2 rows compute the
    formula. Every non-NaN bf16 gate, times a few ups, must give the same bits every way."""
    if len(isas) < 2:
        pytest.skip("the table is the AVX-512 path's; this CPU runs only AVX2")
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[~torch.isnan(gates.float())]
    pad = -gates.numel() % 1536
    gates = torch.cat([gates, gates[:pad]]).reshape(-1, 1536)  # 43 rows of 1,536
    for up in (1.0, -3.5, 2.0 ** -7, 0.0):
        gate_up = torch.cat([gates, torch.full_like(gates, up)], dim=1).contiguous()
        outs = []
        for isa in isas:
            ops.set_isa(isa)
            outs.append(kernels.silu_mul(gate_up).view(torch.int16))
            outs.append(torch.cat([kernels.silu_mul(gate_up[r:r + 2])  # the formula
                                   for r in range(0, len(gate_up), 2)]).view(torch.int16))
        assert all(torch.equal(o, outs[0]) for o in outs), up


def _norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm in bf16."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(torch.bfloat16)


def test_norm_and_silu_mul_rows_are_isa_and_batch_free_and_hf_close(
        ops, isas: list[int]) -> None:
    torch.manual_seed(3)
    x = (torch.randn(40, 576) * 4).to(torch.bfloat16)
    res = torch.randn(40, 576).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(576)).to(torch.bfloat16)
    gate_up = (torch.randn(40, 2 * 1536) * 3).to(torch.bfloat16)
    outs = {}
    for isa in isas:
        ops.set_isa(isa)
        y, h = kernels.rms_norm(x, w, 1e-5, res)
        outs[isa] = (y, h, kernels.silu_mul(gate_up))
        for rows in (1, 3, 17):  # any batch: the same rows
            y1, h1 = kernels.rms_norm(x[-rows:], w, 1e-5, res[-rows:])
            assert torch.equal(y1, y[-rows:]) and torch.equal(h1, h[-rows:])
            assert torch.equal(kernels.silu_mul(gate_up[-rows:]), outs[isa][2][-rows:])
    y, h, act = outs[max(outs)]
    assert all(all(torch.equal(a, b) for a, b in zip(o, outs[max(outs)])) for o in outs.values())
    assert torch.equal(h, x + res)  # the residual add is torch's bf16 add
    torch.testing.assert_close(y, _norm_reference(h, w, 1e-5), rtol=1e-2, atol=1e-2)
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)
    y0, h0 = kernels.rms_norm(x, w, 1e-5, None)
    assert h0 is x or torch.equal(h0, x)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_rope_and_kv_write_are_torchs_bf16_ops(ops, isas: list[int],
                                               head_dim: int) -> None:
    from splitserve.model.layers import RotaryEmbedding, apply_rotary
    torch.manual_seed(4)
    heads, kv_heads, tokens = 9, 3, 21
    rotary = RotaryEmbedding(head_dim, 512, 10000.0, None)
    positions = torch.randint(0, 500, (tokens,))
    cos, sin = rotary.table(positions, torch.bfloat16)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    slots = torch.randperm(64 * 16)[:tokens]
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    want = apply_rotary(qk, cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    for isa in isas:
        ops.set_isa(isa)
        kv = torch.zeros(2, 64, 16, kv_heads, head_dim, dtype=torch.bfloat16)
        q = kernels.rope_write_kv(qkv, cos, sin, kv, slots, heads)
        assert torch.equal(q, want[:, :heads]), isa
        assert torch.equal(kv[0].view(-1, kv_heads, head_dim)[slots], want[:, heads:]), isa
        assert torch.equal(kv[1].view(-1, kv_heads, head_dim)[slots], v), isa


def test_argmax_rows_is_numpys_first_maximum(ops) -> None:
    """The one-call step's greedy pick (csrc/layers.cpp first_max, by blocks of 1,024):
    numpy's argmax for ties inside and across blocks, NaN anywhere (the first wins, even
    after a larger value), +-inf, -0.0 beside 0.0, a row of -inf, rows shorter than a
    block and not a multiple of the vector width."""
    nan, inf = float("nan"), float("inf")
    rows = [torch.tensor(r) for r in ([1.0, 3.0, 3.0, 2.0], [1.0, nan, 3.0, nan],
                                      [-inf, -inf, -inf], [0.5, inf, inf, 2.0], [-0.0, 0.0],
                                      [0.0, -0.0, -1.0], [-inf], [nan])]
    torch.manual_seed(0)
    for n in (1023, 1024, 1025, 3000, 49152):
        x = torch.randn(n)
        rows.append(x)
        tie = x.clone()
        tie[n - 1] = tie[n // 3] = x.max() + 1  # the same maximum in two blocks
        rows.append(tie)
        late_nan = tie.clone()
        late_nan[n - 1] = nan  # after the maximum, in a later block
        rows.append(late_nan)
        lows = torch.full((n,), -inf)
        lows[n // 2] = -1e30
        rows.append(lows)
    for r in rows:
        x = r[None].contiguous()
        assert ops.argmax_rows(x).tolist() == x.numpy().argmax(axis=-1).tolist(), r
    both = torch.stack([rows[-4], rows[-3]])  # two rows of one tensor
    assert ops.argmax_rows(both).tolist() == both.numpy().argmax(axis=-1).tolist()
