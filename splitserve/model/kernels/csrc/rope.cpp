// Rotary embedding of q and k plus the step's KV write, in one call per layer (it was ~12
// aten ops: slices, views, roll, two multiplies, an add, two index_copy_). The arithmetic
// is torch's bf16 ops, element for element:
//   y[d] = bf16( bf16(x[d] * cos[d]) + bf16(x[(d + D/2) % D] * signed_sin[d]) )
// (rotate-half with its sign folded into the sin table, as layers.apply_rotary does).
#include <ATen/ops/empty.h>

#include <cstring>

#include "common.h"
#include "ops.h"

namespace {

using namespace exact;

AVX2_TARGET void rope_head_avx2(const bf16_t* x, const bf16_t* cos, const bf16_t* sin,
                                int64_t D, bf16_t* y) {  // D % 16 == 0
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 a = bf16x8_to_f32(x + c), r = bf16x8_to_f32(x + (c + D / 2) % D);
    const __m256 p = round_bf16(_mm256_mul_ps(a, bf16x8_to_f32(cos + c)));
    const __m256 q = round_bf16(_mm256_mul_ps(r, bf16x8_to_f32(sin + c)));
    _mm_storeu_si128((__m128i*)(y + c), f32x8_to_bf16(_mm256_add_ps(p, q)));
  }
}

AVX512_TARGET void rope_head_avx512(const bf16_t* x, const bf16_t* cos, const bf16_t* sin,
                                    int64_t D, bf16_t* y) {  // D % 32 == 0
  for (int64_t c = 0; c < D; c += 16) {
    const __m512 a = bf16x16_to_f32(x + c), r = bf16x16_to_f32(x + (c + D / 2) % D);
    const __m512 p = round_bf16(_mm512_mul_ps(a, bf16x16_to_f32(cos + c)));
    const __m512 q = round_bf16(_mm512_mul_ps(r, bf16x16_to_f32(sin + c)));
    _mm256_storeu_si256((__m256i*)(y + c), f32x16_to_bf16(_mm512_add_ps(p, q)));
  }
}

}  // namespace


namespace exact {

void rope_write_kv_into(const bf16_t* qkv, const bf16_t* cos, const bf16_t* sin, int64_t T,
                        int64_t H, bf16_t* kv, const KvLayer& layout, const int64_t* slots,
                        bf16_t* q, int64_t u0, int64_t u1) {
  const int64_t HKV = layout.kv_heads, D = layout.head_dim;
  bf16_t* v = kv + layout.slots() * HKV * D;
  const int64_t W = (H + 2 * HKV) * D;
  if (u1 < 0) u1 = H + HKV + 1;
  const auto head = get_isa() >= 2 && D % 32 == 0 ? rope_head_avx512 : rope_head_avx2;
  FlushDenormals guard;
  for (int64_t t = 0; t < T; ++t) {
    const bf16_t* row = qkv + t * W;
    for (int64_t j = u0; j < u1; ++j) {
      if (j < H) head(row + j * D, cos + t * D, sin + t * D, D, q + (t * H + j) * D);
      else if (j < H + HKV)
        head(row + j * D, cos + t * D, sin + t * D, D, kv + (slots[t] * HKV + j - H) * D);
      else std::memcpy(v + slots[t] * HKV * D, row + (H + HKV) * D, sizeof(bf16_t) * HKV * D);
    }
  }
}

}  // namespace exact

// qkv [T, (H + 2 HKV) * D] bf16 (q heads, k heads, v heads); cos, signed_sin [T, D] bf16;
// kv_layer [2, NBLK, BS, HKV, D]; slot_mapping [T] int64 (flat cache slot of each token).
// Writes rotated k and v into the cache; returns rotated q [T, H, D].
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& kv_layer, const at::Tensor& slot_mapping, int64_t H) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.is_contiguous() && qkv.dim() == 2,
              "qkv must be contiguous bfloat16 [T, (H + 2 HKV) * D]");
  const exact::KvLayer layout = exact::kv_layer_of(kv_layer);
  const int64_t T = qkv.size(0), D = layout.head_dim;
  TORCH_CHECK(qkv.size(1) == (H + 2 * layout.kv_heads) * D, "qkv width does not match heads");
  TORCH_CHECK(D % 16 == 0, "rope_write_kv: head_dim must be a multiple of 16");
  exact::check_rope_tables(cos, sin, T, D);
  const int64_t* slots = exact::checked_slots(slot_mapping, T, layout);
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  const auto* x = reinterpret_cast<const bf16_t*>(qkv.data_ptr());
  const auto* c = reinterpret_cast<const bf16_t*>(cos.data_ptr());
  const auto* s = reinterpret_cast<const bf16_t*>(sin.data_ptr());
  auto* kv = reinterpret_cast<bf16_t*>(kv_layer.data_ptr());
  auto* qs = reinterpret_cast<bf16_t*>(q.data_ptr());
  exact::parallel_rows(T, [&](int64_t r0, int64_t r1) {
    exact::rope_write_kv_into(x + r0 * qkv.size(1), c + r0 * D, s + r0 * D, r1 - r0, H, kv,
                              layout, slots + r0, qs + r0 * H * D);
  });
  return q;
}
