// Rotary embedding of q and k plus the step's KV write, in one call per layer (it was ~12
// aten ops: slices, views, roll, two multiplies, an add, two index_copy_). The arithmetic
// is torch's bf16 ops, element for element:
//   y[d] = bf16( bf16(x[d] * cos[d]) + bf16(x[(d + D/2) % D] * signed_sin[d]) )
// (rotate-half with its sign folded into the sin table, as layers.apply_rotary does).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "common.h"
#include "ops.h"

namespace {

using namespace exact;

inline float f32(bf16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline bf16_t to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (bf16_t)((u >> 16) | 0x40);
  return (bf16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void rope_head_scalar(const bf16_t* x, const bf16_t* cos, const bf16_t* sin, int64_t D,
                      bf16_t* y) {
  for (int64_t d = 0; d < D; ++d) {
    const float a = f32(to_bf16(f32(x[d]) * f32(cos[d])));
    const float b = f32(to_bf16(f32(x[(d + D / 2) % D]) * f32(sin[d])));
    y[d] = to_bf16(a + b);
  }
}

AVX512_TARGET void rope_head_avx512(const bf16_t* x, const bf16_t* cos, const bf16_t* sin,
                                    int64_t D, bf16_t* y) {  // D % 32 == 0
  for (int64_t c = 0; c < D; c += 16) {
    const __m512 a = bf16x16_to_f32(x + c), r = bf16x16_to_f32(x + (c + D / 2) % D);
    const __m512 p = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        f32x16_to_bf16(_mm512_mul_ps(a, bf16x16_to_f32(cos + c)))), 16));
    const __m512 q = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
        f32x16_to_bf16(_mm512_mul_ps(r, bf16x16_to_f32(sin + c)))), 16));
    _mm256_storeu_si256((__m256i*)(y + c), f32x16_to_bf16(_mm512_add_ps(p, q)));
  }
}

}  // namespace


// qkv [T, (H + 2 HKV) * D] bf16 (q heads, k heads, v heads); cos, signed_sin [T, D] bf16;
// kv_layer [2, NBLK, BS, HKV, D]; slot_mapping [T] int64 (flat cache slot of each token).
// Writes rotated k and v into the cache; returns rotated q [T, H, D].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& kv_layer, const at::Tensor& slot_mapping, int64_t H) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() && qkv.dim() == 2,
              "qkv must be contiguous bfloat16 [T, (H + 2 HKV) * D]");
  TORCH_CHECK(kv_layer.scalar_type() == at::kBFloat16 && kv_layer.is_contiguous() &&
              kv_layer.dim() == 5 && kv_layer.size(0) == 2, "kv_layer must be [2, NBLK, BS, HKV, D]");
  const int64_t T = qkv.size(0), HKV = kv_layer.size(3), D = kv_layer.size(4);
  TORCH_CHECK(qkv.size(1) == (H + 2 * HKV) * D && D % 2 == 0, "qkv width does not match heads");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() == T * D,
                "cos and sin must be contiguous bfloat16 [T, D]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == T, "slot_mapping must be int64 [T]");
  const int64_t num_slots = kv_layer.size(1) * kv_layer.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const auto* src = reinterpret_cast<const bf16_t*>(qkv.data_ptr());
  const auto* cp = reinterpret_cast<const bf16_t*>(cos.data_ptr());
  const auto* sp = reinterpret_cast<const bf16_t*>(sin.data_ptr());
  auto* qp = reinterpret_cast<bf16_t*>(q.data_ptr());
  auto* kp = reinterpret_cast<bf16_t*>(kv_layer.data_ptr());
  bf16_t* vp = kp + num_slots * HKV * D;
  const int64_t W = (H + 2 * HKV) * D;
  const auto head = get_isa() == 2 && D % 32 == 0 ? rope_head_avx512 : rope_head_scalar;
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    FlushDenormals guard;
    for (int64_t t = begin; t < end; ++t) {
      const bf16_t* row = src + t * W;
      for (int64_t j = 0; j < H; ++j) head(row + j * D, cp + t * D, sp + t * D, D, qp + (t * H + j) * D);
      for (int64_t j = 0; j < HKV; ++j)
        head(row + (H + j) * D, cp + t * D, sp + t * D, D, kp + (slots[t] * HKV + j) * D);
      std::memcpy(vp + slots[t] * HKV * D, row + (H + HKV) * D, sizeof(bf16_t) * HKV * D);
    }
  });
  return q;
}
