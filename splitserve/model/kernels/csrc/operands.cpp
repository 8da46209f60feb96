// The checks of a step's operands that the kernels share: a layer of the paged KV cache,
// the step's block tables and context lengths, its KV slots and rotary tables. The tensor
// entry points run them on every call; the decoder once per step, for all its layers.
#include <ATen/core/Tensor.h>

#include "ops.h"

namespace exact {

KvLayer kv_layer_of(const at::Tensor& kv_layer) {
  TORCH_CHECK(kv_layer.device().is_cpu() && kv_layer.scalar_type() == at::kBFloat16 &&
              kv_layer.is_contiguous() && kv_layer.dim() == 5 && kv_layer.size(0) == 2,
              "kv_layer must be a contiguous CPU bfloat16 [2, NBLK, BS, HKV, D]");
  return KvLayer{kv_layer.size(1), kv_layer.size(2), kv_layer.size(3), kv_layer.size(4)};
}

PagedIndex paged_index(const at::Tensor& block_tables, const at::Tensor& token_seq,
                       const at::Tensor& context_lens, int64_t T, const KvLayer& kv) {
  for (const at::Tensor* t : {&block_tables, &token_seq, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors must be int32");
  TORCH_CHECK(token_seq.numel() == T && context_lens.numel() == T, "one entry per token");
  const int64_t S = block_tables.dim() == 2 ? block_tables.size(0) : 0;
  const int64_t stride = S ? block_tables.size(1) : 0;
  const int64_t max_keys = stride * kv.block_size;
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(seq[t] >= 0 && seq[t] < S && lens[t] >= 1 && lens[t] <= max_keys,
                "token ", t, ": sequence ", seq[t], " of ", S, ", ", lens[t],
                " keys (its block table holds ", max_keys, ")");
  const int32_t* tbl = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(tbl[i] >= 0 && tbl[i] < kv.num_blocks, "block id ", tbl[i], " out of range");
  return PagedIndex{tbl, stride, seq, lens, T};
}

const int64_t* checked_slots(const at::Tensor& slot_mapping, int64_t T, const KvLayer& kv) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == T, "slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < kv.slots(), "slot ", slots[t], " out of range");
  return slots;
}

void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D) {
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == T * D,
                "cos and sin must be contiguous bfloat16 [T, D]");
}

}  // namespace exact
