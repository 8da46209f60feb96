"""The one-call decoder stack (kernels.exact_decoder, csrc/decoder.cpp) is the kernels
composed op by op, bit for bit: the "captured" step against its eager composition, in bf16,
for a whole stack and for the per-layer calls layer-wise KV streaming makes, on both ISA
paths, with bf16 and with int8 weights; its KV writes are the same bits too."""
from __future__ import annotations

from typing import cast

import pytest
import torch

from splitserve.model import kernels
from splitserve.model.attention import AttentionMetadata, ExactBatch, forward_context
from splitserve.model.llama import LlamaDecoderLayer, LlamaForCausalLM
from splitserve.model.packed import PackedLinear
from splitserve.model.spec import ModelSpec

pytestmark = pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                                reason="exact kernels need an x86 CPU with AVX2")

BLOCK, NUM_BLOCKS = 16, 24


def _model(attention_bias: bool, quantization: str | None = None) -> LlamaForCausalLM:
    torch.manual_seed(7)
    spec = ModelSpec("qwen2" if attention_bias else "llama", vocab_size=300, hidden_size=128,
                     intermediate_size=320, num_layers=3, num_heads=6, num_kv_heads=2,
                     head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=512, tie_word_embeddings=True,
                     attention_bias=attention_bias)
    model = LlamaForCausalLM(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model = model.to(torch.bfloat16)
    kernels.use_exact_kernels_(model, quantization)
    return model


def _step(model: LlamaForCausalLM, decodes: int = 0
          ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A mixed step: a 20-token prefill chunk after 9 cached tokens, and two decodes; or
    (`decodes` 1 or 2) a decode step of that many sequences."""
    spec = model.spec
    kv = (torch.randn(spec.num_layers, 2, NUM_BLOCKS, BLOCK, spec.num_kv_heads, spec.head_dim)
          * 0.5).to(torch.bfloat16)
    tables = [[3, 7, 1], [5, 0, 0], [9, 11, 2]]
    seqs = [(0, list(range(9, 29))), (1, [13]), (2, [40])]
    if decodes:
        seqs = [(2, [40]), (0, [33])][:decodes]
    token_seq, positions, slots = [], [], []
    for s, pos in seqs:
        for p in pos:
            token_seq.append(s)
            positions.append(p)
            slots.append(tables[s][p // BLOCK] * BLOCK + p % BLOCK)
    exact = ExactBatch(slots, sum(tables, []), 3, token_seq, [p + 1 for p in positions])
    meta = AttentionMetadata(kv, None, 0, None, None, [], [], exact=exact)
    ids = torch.randint(0, spec.vocab_size, (len(positions),))
    return meta, ids, torch.tensor(positions)


def _eager(model: LlamaForCausalLM, meta: AttentionMetadata, ids: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """The stack op by op, each kernel called from Python (the former module path)."""
    m, spec, e = model.model, model.spec, meta.exact
    assert e is not None
    slots = torch.tensor(e.slots)
    tables = torch.tensor(e.block_tables, dtype=torch.int32).view(-1, e.width)
    token_seq = torch.tensor(e.token_seq, dtype=torch.int32)
    context_lens = torch.tensor(e.context_lens, dtype=torch.int32)
    x = m.embed_tokens(ids)
    cos, sin = m.rotary.table(positions, x.dtype)
    residual = None
    for i, layer in enumerate(cast(list[LlamaDecoderLayer], list(m.layers))):
        a = layer.self_attn
        h, residual = kernels.rms_norm(x, layer.input_layernorm.weight, spec.rms_norm_eps,
                                       residual)
        q = kernels.rope_write_kv(a.qkv_proj(h), cos, sin, meta.kv_cache[i], slots,
                                  spec.num_heads)
        out = kernels.paged_attention(q, meta.kv_cache[i], tables, token_seq, context_lens,
                                      spec.head_dim ** -0.5)
        h, residual = kernels.rms_norm(a.o_proj(out.flatten(1)),
                                       layer.post_attention_layernorm.weight,
                                       spec.rms_norm_eps, residual)
        x = layer.mlp.down_proj(kernels.silu_mul(layer.mlp.gate_up_proj(h)))
    return kernels.rms_norm(x, m.norm.weight, spec.rms_norm_eps, residual)[0]


@pytest.mark.parametrize("attention_bias,quantization",
                         [(False, None), (True, None), (False, "int8"), (True, "int8")])
def test_the_one_call_stack_is_the_kernels_op_by_op(attention_bias: bool,
                                                    quantization: str | None) -> None:
    model = _model(attention_bias, quantization)
    assert model.model.exact_decoder is not None
    down = cast(LlamaDecoderLayer, model.model.layers[0]).mlp.down_proj
    assert (cast(PackedLinear, down).packed.dtype == torch.int8) == bool(quantization)
    ops = kernels.load()
    before = ops.get_isa()
    try:
        for isa in range(1, before + 1):  # AVX2, then AVX-512 BF16 and AMX where present
            ops.set_isa(isa)
            meta, ids, positions = _step(model)
            kv0 = meta.kv_cache.clone()
            want = _eager(model, meta, ids, positions)
            kv_want = meta.kv_cache.clone()
            hooks: tuple[list[int] | None, ...] = (None, [])
            for hook in hooks:  # one call; one call per layer with a hook between
                meta.kv_cache.copy_(kv0)
                meta.on_layer_end = None if hook is None else hook.append
                with forward_context(meta), torch.inference_mode():
                    got = model(ids, positions)
                assert torch.equal(got, want), (isa, hook)
                assert torch.equal(meta.kv_cache, kv_want), (isa, hook)
                if hook is not None:
                    assert hook == list(range(model.spec.num_layers))
            assert not torch.equal(kv0, kv_want)  # the step did write its KV
    finally:
        ops.set_isa(before)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_one_call_step_gives_the_logits_of_the_ops_around_the_stack(
        quantization: str | None) -> None:
    """sampled_logits (the embedding, rotary rows, layers, final norm and LM head in one C++
    call) against compute_logits over the eager stack's rows: the same bits and KV writes,
    for every row, some rows and none, on every ISA; with a layer hook the module path."""
    model = _model(False, quantization)
    ops = kernels.load()
    before = ops.get_isa()
    try:
        for isa in range(1, before + 1):
            ops.set_isa(isa)
            for rows in (None, [19, 20, 21], [21, 0], []):
                meta, ids, positions = _step(model)
                kv0 = meta.kv_cache.clone()
                with torch.inference_mode():
                    hidden = _eager(model, meta, ids, positions)
                    want = model.compute_logits(hidden if rows is None else hidden[rows])
                kv_want = meta.kv_cache.clone()
                hooks: tuple[list[int] | None, ...] = (None, [])
                for hook in hooks:
                    meta.kv_cache.copy_(kv0)
                    meta.on_layer_end = None if hook is None else hook.append
                    with torch.inference_mode():
                        got, first_max = model.sampled_logits(ids.tolist(),
                                                              positions.tolist(), rows, meta)
                    # the one call finds each row's argmax on the way; the module path not
                    assert first_max == (want.argmax(-1).tolist() if hook is None else None)
                    assert got.dtype == torch.float32
                    assert got.shape == (len(ids) if rows is None else len(rows), 300)
                    assert torch.equal(got, want), (isa, rows, hook)
                    assert torch.equal(meta.kv_cache, kv_want), (isa, rows, hook)
    finally:
        ops.set_isa(before)


def test_a_one_call_step_refuses_ids_positions_rows_and_tables_out_of_range() -> None:
    model = _model(False)
    meta, id_tensor, pos_tensor = _step(model)
    ids, positions = id_tensor.tolist(), pos_tensor.tolist()
    n = len(ids)
    bad: list[tuple[list[int], list[int], list[int] | None, str]] = [
        ([300] * n, positions, None, "token id 300 out of range"),
        ([-1] * n, positions, None, "token id -1 out of range"),
        (ids, [512] * n, None, "position 512 out of range"),
        (ids, positions[:-1], None, "input_ids and positions must be"),
        (ids, positions, [22], "row 22 out of range")]
    for i, p, rows, message in bad:
        with torch.inference_mode():
            with pytest.raises(RuntimeError, match=message):
                model.sampled_logits(i, p, rows, meta)
    e = meta.exact
    assert e is not None
    for width, tables, message in ((2, e.block_tables, "9 entries are not rows of 2"),
                                   (0, [], "0 entries are not rows of 0"),
                                   (3, [3, 7, 1, 5, 0, 0, 9, 11, 24], "block id 24 out of range")):
        e.width, e.block_tables = width, tables
        with torch.inference_mode():
            with pytest.raises(RuntimeError, match=message):
                model.sampled_logits(ids, positions, None, meta)
    with torch.inference_mode(), pytest.raises(TypeError):  # not a list of ints
        model.sampled_logits([float(t) for t in ids],  # type: ignore[misc]
                             positions, None, meta)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_decode_step_gives_the_eager_bits_at_any_thread_count(
        quantization: str | None) -> None:
    """With fewer tokens than threads every thread of the team runs the norms and SiLU * up
    in full into buffers of its own (the linears after them read each thread's copy), the
    rotary is split by heads, and SiLU * up computes its formula, not the table: one and
    two tokens at 1, 2 and 3 threads, on every ISA, give the eager ops' bits."""
    model = _model(True, quantization)
    ops = kernels.load()
    before_isa, before_threads = ops.get_isa(), torch.get_num_threads()
    try:
        for isa in range(1, before_isa + 1):
            ops.set_isa(isa)
            for decodes in (1, 2):
                torch.set_num_threads(1)
                meta, ids, positions = _step(model, decodes)
                kv0 = meta.kv_cache.clone()
                with torch.inference_mode():
                    want = _eager(model, meta, ids, positions)
                kv_want = meta.kv_cache.clone()
                for threads in (1, 2, 3):
                    torch.set_num_threads(threads)
                    meta.kv_cache.copy_(kv0)
                    with forward_context(meta), torch.inference_mode():
                        got = model(ids, positions)
                    assert torch.equal(got, want), (isa, decodes, threads)
                    assert torch.equal(meta.kv_cache, kv_want), (isa, decodes, threads)
    finally:
        ops.set_isa(before_isa)
        torch.set_num_threads(before_threads)
