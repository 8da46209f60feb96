"""The linear and attention on AMX-BF16 tiles (csrc/linear_amx.h, attention_amx.h):
batch-invariant, with bits of their own.

TDPBF16PS does not compute the fold the other paths share (its rounding inside a 32-product
sum is not documented), so there is no emulation to compare with. What is checked instead,
on CPUs with AMX (the tests skip elsewhere): a row's bits do not depend on the row count,
the rows around it or the thread count; int8 weights are the bf16 tiles over the same
integers; a K that is not a multiple of 32 takes the specified fold; the layer is the
linear to bf16 rounding; attention gives every token of a causal step its bits alone, in
chunks of any size and batched, within bf16 rounding of an fp32 reference; and the
fingerprint of an engine on AMX is not the fold's.
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch import nn

from splitserve.model import kernels

from tests.model.conftest import native_isa
from tests.model.test_exact_kernels import _fold, _reference_attention, assert_rows_free


def test_amx_rows_do_not_depend_on_rows_neighbours_or_threads(amx: ModuleType) -> None:
    torch.manual_seed(3)
    lin = nn.Linear(576, 200, bias=True).to(torch.bfloat16)
    exact = kernels.ExactLinear(lin)
    x = torch.randn(130, 576, dtype=torch.bfloat16)
    want = exact(x)
    assert_rows_free(exact, x, want, (1, 2, 15, 16, 17, 31, 63, 64, 65, 130))
    # other rows beside it in the same tile change nothing
    noisy = torch.randn(16, 576, dtype=torch.bfloat16) * 100
    noisy[5] = x[7]
    assert torch.equal(exact(noisy)[5], want[7])
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


def _causal_step(num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    """A cache and a step of causal prefills: sequence i's tokens 0..lengths[i]-1, each
    seeing itself and the ones before it. Returns kv, tables, token_seq, ctx."""
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    per = -(-max(lengths) // block_size)
    tables = torch.randperm(num_blocks)[:per * len(lengths)].view(len(lengths), per)
    token_seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    ctx = torch.cat([torch.arange(1, n + 1) for n in lengths])
    return kv, tables.to(torch.int32), token_seq.to(torch.int32), ctx.to(torch.int32)


def _batched_and_alone(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor,
                       token_seq: torch.Tensor, ctx: torch.Tensor, scale: float) -> torch.Tensor:
    """The step's attention, checked against the fp32 reference, and each token alone (its
    blocks moved elsewhere in the cache) against it bit for bit."""
    got = kernels.paged_attention(q, kv, tables, token_seq, ctx, scale)
    torch.testing.assert_close(got.float(), _reference_attention(q, kv, tables, token_seq, ctx,
                                                                 scale), rtol=2e-2, atol=1e-2)
    moved = torch.empty_like(kv)
    new_ids = torch.randperm(kv.shape[1])
    moved[:, new_ids] = kv
    for t in torch.randperm(len(ctx)).tolist():
        table = new_ids[tables[token_seq[t]].long()].to(torch.int32)[None]
        alone = kernels.paged_attention(q[t:t + 1], moved, table,
                                        torch.zeros(1, dtype=torch.int32), ctx[t:t + 1], scale)
        assert torch.equal(alone[0], got[t]), (t, int(ctx[t]))
    return got


# (query heads, kv heads, head_dim): 5, 2 and 16 tokens a tile; head_dim 80 takes the fold
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 2, 32), (4, 4, 64),
                                                     (10, 2, 80)])
def test_amx_attention_gives_a_token_its_bits_in_any_tile(amx: ModuleType, heads: int,
                                                          kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(heads + head_dim)
    kv, tables, token_seq, ctx = _causal_step(64, 16, kv_heads, head_dim, [70, 37, 1])
    T = len(ctx)
    q = torch.randn(T, heads + kv_heads, head_dim, dtype=torch.bfloat16)[:, :heads]  # strided
    scale = head_dim ** -0.5
    got = _batched_and_alone(q, kv, tables, token_seq, ctx, scale)
    # and the step in chunks of every size
    for chunk in (2, 3, 7, 16, 17, 50):
        for t0 in range(0, T, chunk):
            part = kernels.paged_attention(q[t0:t0 + chunk], kv, tables, token_seq[t0:t0 + chunk],
                                           ctx[t0:t0 + chunk], scale)
            assert torch.equal(part, got[t0:t0 + chunk]), (chunk, t0)
    # the tiles are a path of their own where they run (head_dim 32, 64)
    amx.set_isa(kernels.ISAS["avx512_bf16"])
    fold = kernels.paged_attention(q, kv, tables, token_seq, ctx, scale)
    assert torch.equal(fold, got) == (head_dim not in (32, 64))


# (query heads, kv heads, head_dim): 5, 2 and 16 sequences' decode tokens share a tile
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (16, 2, 32), (4, 4, 64)])
def test_amx_attention_packs_decode_tokens_of_many_sequences(amx: ModuleType, heads: int,
                                                             kv_heads: int,
                                                             head_dim: int) -> None:
    """A decode step's tokens (one per sequence, contexts from 1 to 300 keys) share tiles;
    each gets the bits it has alone, with its blocks elsewhere in the cache."""
    torch.manual_seed(heads * head_dim)
    lengths = [1, 300, 17, 16, 32, 33, 190, 5, 64, 2, 129, 48, 7, 250, 15, 96, 31, 1, 80, 12]
    kv = torch.randn(2, 400, 16, kv_heads, head_dim, dtype=torch.bfloat16)
    per = -(-max(lengths) // 16)
    tables = torch.randperm(400)[:per * len(lengths)].view(len(lengths), per).to(torch.int32)
    ctx = torch.tensor(lengths, dtype=torch.int32)
    token_seq = torch.arange(len(lengths), dtype=torch.int32)
    q = torch.randn(len(lengths), heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    got = _batched_and_alone(q, kv, tables, token_seq, ctx, scale)
    # in another order, with other neighbours in each tile
    order = torch.randperm(len(lengths))
    shuffled = kernels.paged_attention(q[order], kv, tables, token_seq[order], ctx[order], scale)
    assert torch.equal(shuffled, got[order])


def test_attention_ignores_whatever_lies_past_a_context(ops: ModuleType) -> None:
    """A cache slot past a token's context (a block's tail, left by its last owner: a peer's
    transfer may have put NaN or inf there) changes no bit of any token, its own or a
    neighbour's in the tile (on AMX a zero p times a NaN value would be NaN), at every ISA
    level this CPU runs."""
    for level in range(1, native_isa(ops) + 1):
        ops.set_isa(level)
        _past_context_changes_nothing()


def _past_context_changes_nothing() -> None:
    torch.manual_seed(11)
    kv = torch.randn(2, 36, 16, 3, 64, dtype=torch.bfloat16)
    tables = torch.arange(36, dtype=torch.int32).view(6, 6)
    # five decode tokens (one context an exact block: 64) and a prefill's 23 tokens after 49
    # cached ones (on AMX its V is packed once for all of its tiles, up to its last context)
    ctx = torch.tensor([40, 1, 95, 17, 64, *range(50, 73)], dtype=torch.int32)
    token_seq = torch.tensor([0, 1, 2, 3, 4, *[5] * 23], dtype=torch.int32)
    q = torch.randn(len(ctx), 9, 64, dtype=torch.bfloat16)
    clean = kernels.paged_attention(q, kv, tables, token_seq, ctx, 0.125)
    dirty = kv.clone()
    for s, n in enumerate([40, 1, 95, 17, 64, 72]):
        flat = dirty[:, tables[s].long()].flatten(1, 2)  # [2, 6 * 16, 3, 64], a copy
        flat[:, n:] = float("nan")
        flat[:, n:, :, ::7] = float("inf")
        dirty[:, tables[s].long()] = flat.view(2, 6, 16, 3, 64)
    got = kernels.paged_attention(q, dirty, tables, token_seq, ctx, 0.125)
    assert torch.equal(got, clean)
