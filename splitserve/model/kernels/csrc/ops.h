// The exact kernels' entry points, one declaration for every file that calls them (the
// Python bindings in exact.cpp, the one-call decoder stack in decoder.cpp).
#pragma once

#include <torch/extension.h>

#include <tuple>

// exact.cpp: y = x @ W^T over packed bf16 or int8 (with `scale`) weights.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t N,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale);
int64_t get_isa();  // 1 = AVX2, 2 = AVX-512 BF16 (exact.cpp)
// attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& context_lens, double scale);
// layers.cpp
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual);
at::Tensor silu_mul(const at::Tensor& gate_up);
// rope.cpp
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& kv_layer, const at::Tensor& slot_mapping, int64_t H);
// decoder.cpp
void register_decoder(pybind11::module& m);
