// The exact kernels' entry points, one declaration for every file that calls them (the
// Python bindings in exact.cpp, the one-call decoder stack in decoder.cpp).
//
// Each op comes twice: a tensor entry point for Python (checks its operands, allocates its
// output, ~2-4 us of aten dispatch per tensor made) and an `_into` form over raw pointers
// that checks nothing and allocates nothing, for the decoder, which checks its operands
// once per step and reuses one workspace across its layers (a decode step of one token on
// a slow core spent ~2 ms of 17 in those allocations and checks).
#pragma once

// ATen's tensor alone, not <torch/extension.h>: that header (the whole C++ frontend and
// the Python bindings) cost each file ~31 s of a ~2-minute first build on 2 cores; only
// the files that bind to Python include pybind11 (exact.cpp, decoder.cpp, helpers.cpp).
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "common.h"

namespace pybind11 {
class module_;
}

// exact.cpp: y = x @ W^T over packed bf16 or int8 (with `scale`) weights.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t N,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale);
int64_t get_isa();  // 1 = AVX2, 2 = AVX-512 BF16, 3 = AMX-BF16 (exact.cpp)
// attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& context_lens, double scale);
// layers.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);
// rope.cpp
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& kv_layer, const at::Tensor& slot_mapping, int64_t H);
// decoder.cpp
void register_decoder(pybind11::module_& m);
void register_helpers(pybind11::module_& m);  // helpers.cpp

namespace exact {

// ---- the raw forms: operands checked by the caller (the checks: operands.cpp) -------------

// A packed weight [NBLK, KP, 16, 2] (bf16, or int8 with fp32 per-column scales) and its
// fp32 bias, checked against K inputs and N outputs by packed_linear().
struct PackedLinear {
  const void* w;
  bool int8;
  const float* scale;  // int8 only
  const float* bias;   // or null
  int64_t K, N, nblk, KP;
};
PackedLinear packed_linear(const at::Tensor& w_packed, int64_t K, int64_t N,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& scale);
void linear_into(const bf16_t* x, int64_t M, const PackedLinear& w, bf16_t* y);

// Row-wise ops: each computes its M rows on the calling thread (parallel_rows shares an
// op's rows out).
// h = x + residual (when residual is not null; h may then be neither x nor residual), y its
// norm; x, residual, h, y [M, H].
void rms_norm_into(const bf16_t* x, const bf16_t* residual, const bf16_t* weight, int64_t M,
                   int64_t H, float eps, bf16_t* h, bf16_t* y);
// y [M, I] = silu(gate) * up for gate_up [M, 2I]. op_rows: the rows of the whole op these M
// are part of (M when < 0), which decides the AVX-512 path's way (the same bits).
void silu_mul_into(const bf16_t* gate_up, int64_t M, int64_t I, bf16_t* y,
                   int64_t op_rows = -1);
// The first index of v[0, n)'s maximum, a NaN counting as above everything (numpy's and
// torch's argmax): the greedy token of a row of logits.
int64_t first_max(const float* v, int64_t n);

// One layer of the paged KV cache: [2, NBLK, BS, HKV, D] bf16, contiguous.
struct KvLayer {
  int64_t num_blocks, block_size, kv_heads, head_dim;
  int64_t slots() const { return num_blocks * block_size; }
  int64_t numel() const { return 2 * slots() * kv_heads * head_dim; }
};
KvLayer kv_layer_of(const at::Tensor& kv_layer);  // checks [2, NBLK, BS, HKV, D] bf16

// A step's tokens in the cache: the block table row of each token and the keys it sees,
// every entry checked against the cache (paged_index()).
struct PagedIndex {
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* token_seq;
  const int32_t* context_lens;
  int64_t T;
};
PagedIndex paged_index(const at::Tensor& block_tables, const at::Tensor& token_seq,
                       const at::Tensor& context_lens, int64_t T, const KvLayer& kv);
// q [T, H, D] with strides (q_tok, q_head, 1); out [T, H, D] contiguous.
void paged_attention_into(const bf16_t* q, int64_t q_tok, int64_t q_head, int64_t H,
                          const bf16_t* kv, const KvLayer& layout, const PagedIndex& index,
                          float scale, bf16_t* out);

// slot_mapping [T] int64, each slot checked against the cache; returns its data.
const int64_t* checked_slots(const at::Tensor& slot_mapping, int64_t T, const KvLayer& kv);
// cos, sin [T, D] bf16 contiguous, checked.
void check_rope_tables(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t D);
// qkv [T, (H + 2 HKV) D] -> q [T, H, D]; rotated k and v written to the cache slots.
// Units [u0, u1) of each token (all when u1 < 0): its H q heads, then its HKV k heads,
// then its V (one unit).
void rope_write_kv_into(const bf16_t* qkv, const bf16_t* cos, const bf16_t* sin, int64_t T,
                        int64_t H, bf16_t* kv, const KvLayer& layout, const int64_t* slots,
                        bf16_t* q, int64_t u0 = 0, int64_t u1 = -1);

}  // namespace exact
