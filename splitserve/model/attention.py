"""Paged attention over the engine's block-structured KV cache.

The runner describes one step's batch in an `AttentionMetadata` and enters
`forward_context(meta)`; model code keeps the signature `forward(input_ids, positions)`
and each attention layer reads the metadata from the context (the only global).

Token layout of a step (built by the runner):

    [ d0 d1 ... d{D-1} | p0 p0 p0 ... | p1 p1 ... ]
      one token per       prefill chunks, one contiguous
      decoding sequence   slice per sequence

KV cache layout, one tensor for the whole model:
    kv_cache: [num_layers, 2 (K,V), num_blocks, block_size, num_kv_heads, head_dim]
Token t of a sequence lives in block `block_table[t // block_size]` at offset
`t % block_size`, i.e. flat slot `block_id * block_size + offset`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F



@dataclass(slots=True)
class PrefillSlice:
    """One sequence's prefill chunk: query tokens [start, end) of the step's flat batch."""
    start: int
    end: int
    # Tokens of this sequence already in the cache before this chunk (prefix hit, earlier
    # chunks, imported KV). 0 means plain causal attention over the chunk itself.
    num_cached: int
    # [num_blocks_for_context] block ids covering num_cached + (end - start) tokens
    block_table: torch.Tensor
    # [end - start, num_cached + end - start] True where the key is visible; None if num_cached == 0
    mask: torch.Tensor | None


@dataclass(slots=True)
class ExactBatch:
    """What the batch-invariant kernels need: every token on its own, keys from the cache.
    Plain lists, as the C++ takes them (a numpy array and a tensor of each cost ~60 us of
    the cold Python between two decode steps)."""
    slots: list[int]  # [num_tokens] flat cache slot of each new token
    block_tables: list[int]  # [num_seqs * width] row by row, padded with block 0
    width: int  # entries a row of block_tables
    token_seq: list[int]  # [num_tokens]: the row of block_tables of each token
    context_lens: list[int]  # [num_tokens]: keys each token sees (itself included)


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: torch.Tensor
    # [num_tokens] flat cache slot of each new token; None on the exact path (ExactBatch.slots)
    slot_mapping: torch.Tensor | None
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks], padded with block 0
    # [num_decodes, 1, 1, max_blocks * block_size] True where a key is padding (hidden)
    decode_padding: torch.Tensor | None
    decode_context_lens: list[int]  # keys each decode attends to (its new token included)
    prefills: list[PrefillSlice]
    # Called with the layer index after each layer wrote its KV (layer-wise KV streaming).
    on_layer_end: Callable[[int], None] | None = None
    # Set: the exact kernels attend every token (LlamaModel._exact_layers; the fields above
    # unused).
    exact: ExactBatch | None = None


_current: AttentionMetadata | None = None


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    global _current
    prev, _current = _current, meta
    try:
        yield
    finally:
        _current = prev


def get_forward_context() -> AttentionMetadata:
    assert _current is not None, "model forward must run inside forward_context(meta)"
    return _current


def paged_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> torch.Tensor:
    """Writes this step's k, v into the cache, then attends every query to its context.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].
    """
    meta = get_forward_context()
    assert meta.slot_mapping is not None, "the module path needs the slot mapping"
    k_cache, v_cache = meta.kv_cache[layer_idx]  # each [num_blocks, block_size, kv_heads, head_dim]
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    nd = meta.num_decodes
    decoded = None
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_padding is not None
        decoded = _decode_attention(q[:nd], meta.kv_cache[layer_idx], meta.decode_block_tables,
                                    meta.decode_padding, meta.decode_context_lens)
        if not meta.prefills:
            return decoded
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if decoded is not None:
        out[:nd] = decoded
    for p in meta.prefills:
        # 4-D [1, heads, len, head_dim] inputs: 3-D ones miss SDPA's fast CPU kernel.
        query = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
        if p.num_cached == 0:
            keys = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            values = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                               enable_gqa=True)
        else:
            ctx = p.num_cached + (p.end - p.start)
            keys = _gather(k_cache, p.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
            values = _gather(v_cache, p.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=p.mask,
                                               enable_gqa=True)
        out[p.start:p.end] = o[0].transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[n * block_size, kv_heads, head_dim] tokens of the given blocks, in order.

    NOTE: index_select on dim 0 copies whole contiguous blocks; it is ~20x faster on CPU
    than advanced indexing `cache[block_ids]` for these shapes.
    """
    return cache.index_select(0, block_ids.flatten()).flatten(0, 1)


def _decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, tables: torch.Tensor,
                      padding: torch.Tensor, context_lens: list[int]) -> torch.Tensor:
    """One query per sequence over its paged context, as two batched matmuls.

    q: [nd, num_heads, head_dim]; kv_layer: [2, num_blocks, block_size, kv_heads, head_dim];
    tables: [nd, max_blocks]; padding: [nd, 1, 1, L].
    Query heads are grouped by the KV head they share (GQA), so no K/V repeat is needed:
    head h uses KV head h // group, matching HF's repeat_interleave layout.
    (SDPA's CPU kernels are tuned for long queries and are ~10x slower for this shape.)
    """
    nd, num_heads, head_dim = q.shape
    num_kv_heads = kv_layer.shape[3]
    qg = q.view(nd, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if nd == 1:
        # A lone sequence needs no padding mask: its K and V (one gather) are cut to its
        # length. That length changes every step, and a bf16 matmul of a new shape pays
        # oneDNN's primitive creation (~35 us, twice per layer): fp32 has no such cost.
        kv = kv_layer.index_select(1, tables[0]).flatten(1, 2)[:, :context_lens[0]].float()
        keys, values = kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None]  # [1, h, L, d]
        scores = torch.matmul(qg.float(), keys.transpose(-1, -2)).mul_(head_dim ** -0.5)
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, values).view(1, num_heads, head_dim).to(q.dtype)
    # [nd, kv_heads, L, head_dim]
    keys = _gather(kv_layer[0], tables).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = _gather(kv_layer[1], tables).view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
    scores = torch.matmul(qg, keys.contiguous().transpose(-1, -2))  # [nd, kv_heads, group, L]
    scores = scores.mul_(head_dim ** -0.5).masked_fill_(padding, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values.contiguous()).view(nd, num_heads, head_dim)
