"""Model runner: turns a ScheduledBatch into tensors, runs the forward pass, samples."""
from __future__ import annotations

from collections.abc import Callable

import torch

from splitserve.engine.batch import RunnerOutput, ScheduledBatch, ScheduledSeq
from splitserve.engine.sampler import sample
from splitserve.model.attention import AttentionMetadata, ExactBatch, PrefillSlice
from splitserve.model.llama import LlamaForCausalLM, index_tensor


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device, exact: bool = False) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.block_size = block_size
        self.device = device
        self.exact = exact  # batch-invariant attention (the model's linears are exact too)

    def execute(self, batch: ScheduledBatch,
                on_layer_end: Callable[[int], None] | None = None) -> RunnerOutput:
        if not batch.seqs:
            return RunnerOutput()
        # Decodes (one query token) first, then prefill chunks: the layout paged_attention expects.
        seqs = sorted(batch.seqs, key=lambda s: len(s.token_ids) != 1)
        meta, input_ids, positions = self._prepare(seqs)
        meta.on_layer_end = on_layer_end
        sampled_seqs = [s for s in seqs if s.sample is not None]
        ends, offset = [], 0
        for s in seqs:
            offset += len(s.token_ids)
            if s.sample is not None:
                ends.append(offset - 1)
        rows = ends if len(ends) < offset else None  # not a decode-only step: sampled rows
        logits, first_max = self.model.sampled_logits(input_ids, positions, rows, meta)
        result = RunnerOutput(num_computed_tokens=offset)
        if sampled_seqs:
            tokens = sample(logits, [s.sample for s in sampled_seqs],  # type: ignore[misc]
                            first_max)
            result.sampled = {s.request_id: t for s, t in zip(sampled_seqs, tokens)}
        return result

    def _prepare(self, seqs: list[ScheduledSeq]
                 ) -> tuple[AttentionMetadata, list[int], list[int]]:
        bs, dev = self.block_size, self.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for s in seqs:
            input_ids.extend(s.token_ids)
            pos = range(s.start_pos, s.start_pos + len(s.token_ids))
            positions.extend(pos)
            slots.extend(s.block_table[p // bs] * bs + p % bs for p in pos)
        if self.exact:
            return self._prepare_exact(seqs, input_ids, positions, slots)
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        nd = len(decodes)
        decode_tables = decode_padding = None
        ctx_lens: list[int] = [s.start_pos + 1 for s in decodes]
        if nd:
            max_blocks = max(len(s.block_table) for s in decodes)
            decode_tables = index_tensor(
                [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in decodes], dev)
            key_pos = torch.arange(max_blocks * bs, device=dev)
            lens = index_tensor(ctx_lens, dev)
            decode_padding = (key_pos[None, :] >= lens[:, None])[:, None, None, :]
        prefills: list[PrefillSlice] = []
        start = nd
        for s in seqs[nd:]:
            q_len = len(s.token_ids)
            mask = None
            if s.start_pos:
                ctx = s.start_pos + q_len
                q_pos = torch.arange(s.start_pos, ctx, device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= q_pos[:, None]  # [q_len, ctx]
            table = index_tensor(s.block_table, dev)
            prefills.append(PrefillSlice(start, start + q_len, s.start_pos, table, mask))
            start += q_len
        meta = AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=index_tensor(slots, dev),
            num_decodes=nd, decode_block_tables=decode_tables, decode_padding=decode_padding,
            decode_context_lens=ctx_lens,
            prefills=prefills)
        return meta, input_ids, positions

    def _prepare_exact(self, seqs: list[ScheduledSeq], input_ids: list[int],
                       positions: list[int], slots: list[int]
                       ) -> tuple[AttentionMetadata, list[int], list[int]]:
        """Every token names its sequence and its context length (position + 1): nothing
        about the rest of the batch reaches the kernel. Lists, as the C++ takes them."""
        width = max(len(s.block_table) for s in seqs)
        tables: list[int] = []
        for s in seqs:
            tables += s.block_table
            tables += [0] * (width - len(s.block_table))
        token_seq = [i for i, s in enumerate(seqs) for _ in s.token_ids]
        exact = ExactBatch(slots, tables, width, token_seq, [p + 1 for p in positions])
        meta = AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=None, num_decodes=0,
            decode_block_tables=None, decode_padding=None, decode_context_lens=[],
            prefills=[], exact=exact)
        return meta, input_ids, positions
