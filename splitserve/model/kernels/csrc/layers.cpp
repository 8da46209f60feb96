// Row-wise layers of the exact path, each one call instead of ~10 aten ops (the dispatch a
// decode step of one token pays for), with the same bits on the AVX-512 and AVX2 paths:
//
//   rms_norm:  h = bf16(x + residual)                      (when a residual is given)
//              ss = tree16(16 lanes, lane i summing h[j]^2 for j = i, i+16, ... in order)
//              r = 1 / sqrt(ss / H + eps)                  (correctly rounded)
//              y = bf16(w * bf16(h * r))                   (HF's LlamaRMSNorm order)
//   silu_mul:  y = bf16(bf16(g / (1 + exp(-g))) * u)       for gate_up = [g | u]
//
// g is a bf16, so bf16(g / (1 + exp(-g))) takes one of 65,536 values: the AVX-512 path
// computes them once, with the formula's own code under the step's MXCSR, into a table
// (256 KB of fp32, L2-resident) and gathers from it, the same bits without an exp and a
// division per element (those were 6% of a one-thread 512-token prefill step).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "common.h"
#include "ops.h"

namespace {

using namespace exact;

// One row: h (with a residual) and y.
AVX512_TARGET void norm_row_avx512(const bf16_t* x, const bf16_t* res, const bf16_t* w,
                                   int64_t H, float eps, bf16_t* h_out, bf16_t* y) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t c = 0; c < H; c += 16) {
    __m512 h = bf16x16_to_f32(x + c);
    if (res) {
      h = round_bf16(_mm512_add_ps(h, bf16x16_to_f32(res + c)));
      _mm256_storeu_si256((__m256i*)(h_out + c), f32x16_to_bf16(h));
    }
    ss = _mm512_fmadd_ps(h, h, ss);
  }
  const float r = 1.0f / std::sqrt(tree16(ss) / (float)H + eps);
  const __m512 rv = _mm512_set1_ps(r);
  const bf16_t* src = res ? h_out : x;
  for (int64_t c = 0; c < H; c += 16) {
    const __m512 n = round_bf16(_mm512_mul_ps(bf16x16_to_f32(src + c), rv));
    _mm256_storeu_si256((__m256i*)(y + c),
                        f32x16_to_bf16(_mm512_mul_ps(bf16x16_to_f32(w + c), n)));
  }
}

AVX2_TARGET void norm_row_avx2(const bf16_t* x, const bf16_t* res, const bf16_t* w,
                               int64_t H, float eps, bf16_t* h_out, bf16_t* y) {
  V16 ss{_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < H; c += 8) {
    __m256 h = bf16x8_to_f32(x + c);
    if (res) {
      h = round_bf16(_mm256_add_ps(h, bf16x8_to_f32(res + c)));
      _mm_storeu_si128((__m128i*)(h_out + c), f32x8_to_bf16(h));
    }
    __m256& lane = (c / 8) % 2 ? ss.hi : ss.lo;
    lane = _mm256_fmadd_ps(h, h, lane);
  }
  const float r = 1.0f / std::sqrt(tree16(ss) / (float)H + eps);
  const __m256 rv = _mm256_set1_ps(r);
  const bf16_t* src = res ? h_out : x;
  for (int64_t c = 0; c < H; c += 8) {
    const __m256 n = round_bf16(_mm256_mul_ps(bf16x8_to_f32(src + c), rv));
    _mm_storeu_si128((__m128i*)(y + c), f32x8_to_bf16(_mm256_mul_ps(bf16x8_to_f32(w + c), n)));
  }
}

// bf16(g / (1 + exp(-g))) for 16 gates.
AVX512_TARGET inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
}

// silu16 of every bf16 bit pattern, as fp32 (NaN payloads kept), indexed by the pattern.
AVX512_TARGET void fill_silu_table(float* t) {
  FlushDenormals guard;  // as in silu_mul_into's rows
  for (int32_t i = 0; i < 65536; i += 16) {
    const __m512i bits = _mm512_add_epi32(_mm512_set1_epi32(i),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    _mm512_storeu_ps(t + i, silu16(_mm512_castsi512_ps(_mm512_slli_epi32(bits, 16))));
  }
}

const float* silu_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(65536);
    fill_silu_table(t.data());
    return t;
  }();
  return table.data();
}

// g, u: n gates and their ups; y: n outputs.
AVX512_TARGET void silu_mul_row_avx512(const bf16_t* g, const bf16_t* u, int64_t n, bf16_t* y) {
  const float* table = silu_table();
  for (int64_t c = 0; c < n; c += 16) {
    const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(g + c)));
    const __m512 s = _mm512_i32gather_ps(bits, table, 4);
    _mm256_storeu_si256((__m256i*)(y + c),
                        f32x16_to_bf16(_mm512_mul_ps(s, bf16x16_to_f32(u + c))));
  }
}

// The same by the formula: a decode step's few rows would gather from a table the step's
// weight stream has pushed out of the caches (a miss per gather), so they compute it.
AVX512_TARGET void silu_mul_row_formula_avx512(const bf16_t* g, const bf16_t* u, int64_t n,
                                               bf16_t* y) {
  for (int64_t c = 0; c < n; c += 16)
    _mm256_storeu_si256((__m256i*)(y + c), f32x16_to_bf16(_mm512_mul_ps(
        silu16(bf16x16_to_f32(g + c)), bf16x16_to_f32(u + c))));
}

AVX2_TARGET void silu_mul_row_avx2(const bf16_t* gp, const bf16_t* u, int64_t n, bf16_t* y) {
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t c = 0; c < n; c += 8) {
    const __m256 g = bf16x8_to_f32(gp + c);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = round_bf16(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    _mm_storeu_si128((__m128i*)(y + c), f32x8_to_bf16(_mm256_mul_ps(s, bf16x8_to_f32(u + c))));
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t multiple) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous() &&
              t.dim() == 2 && t.size(1) % multiple == 0,
              name, " must be a contiguous CPU bfloat16 [rows, n] with n % ", multiple, " == 0");
}

}  // namespace


namespace exact {

void rms_norm_into(const bf16_t* x, const bf16_t* residual, const bf16_t* weight, int64_t M,
                   int64_t H, float eps, bf16_t* h, bf16_t* y) {
  const auto row = get_isa() >= 2 ? norm_row_avx512 : norm_row_avx2;
  FlushDenormals guard;
  for (int64_t i = 0; i < M; ++i)
    row(x + i * H, residual ? residual + i * H : nullptr, weight, H, eps,
        residual ? h + i * H : nullptr, y + i * H);
}

void silu_mul_into(const bf16_t* gate_up, int64_t M, int64_t I, bf16_t* y, int64_t op_rows) {
  constexpr int64_t kTableRows = 5;  // from this many rows on, the table pays for itself
  const bool table = get_isa() >= 2 && (op_rows < 0 ? M : op_rows) >= kTableRows;
  if (table) silu_table();  // built on first use (a static: once, whichever thread)
  const auto row = get_isa() < 2 ? silu_mul_row_avx2
                   : table       ? silu_mul_row_avx512
                                 : silu_mul_row_formula_avx512;
  FlushDenormals guard;
  for (int64_t i = 0; i < M; ++i) row(gate_up + i * 2 * I, gate_up + i * 2 * I + I, I, y + i * I);
}

// Blocks of the row scanned for their maximum (and any NaN) 32 lanes at a time, then the
// first block holding the row's maximum for its first index: one pass at the load rate,
// and a short one. (A scalar loop does not vectorize: ~6x slower.)
AVX2_TARGET int64_t first_max(const float* v, int64_t n) {
  constexpr int64_t kBlock = 1024;
  float best = -INFINITY;
  int64_t best_block = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    __m256 m[4], bad[4];
    for (int k = 0; k < 4; ++k) m[k] = _mm256_set1_ps(-INFINITY), bad[k] = _mm256_setzero_ps();
    int64_t i = b;
    for (; i + 32 <= e; i += 32)
      for (int k = 0; k < 4; ++k) {
        const __m256 x = _mm256_loadu_ps(v + i + 8 * k);
        m[k] = _mm256_max_ps(x, m[k]);  // a NaN x gives m[k]: NaNs are `bad`'s
        bad[k] = _mm256_or_ps(bad[k], _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    float top = -INFINITY;
    for (float l : lanes) top = l > top ? l : top;
    bool nan = _mm256_movemask_ps(
        _mm256_or_ps(_mm256_or_ps(bad[0], bad[1]), _mm256_or_ps(bad[2], bad[3])));
    for (; i < e; ++i) {
      top = v[i] > top ? v[i] : top;
      nan |= v[i] != v[i];
    }
    if (nan)  // the first NaN of the row: no earlier block had one
      for (int64_t j = b;; ++j)
        if (v[j] != v[j]) return j;
    if (top > best) best = top, best_block = b;
  }
  for (int64_t i = best_block; i < n; ++i)
    if (v[i] == best) return i;
  return 0;  // not reached: `best` is an entry of that block
}

}  // namespace exact

// x [M, V] fp32 -> each row's first maximum [M] int64 (a NaN above everything).
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 &&
              x.size(1) > 0, "x must be contiguous float32 [M, V], V > 0");
  at::Tensor top = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  for (int64_t i = 0; i < x.size(0); ++i)
    top.data_ptr<int64_t>()[i] = exact::first_max(x.data_ptr<float>() + i * x.size(1), x.size(1));
  return top;
}

// x [M, H] bf16; weight [H] bf16; residual [M, H] bf16 or none. Returns (y, h): h is
// x + residual (x itself when there is none), y its norm.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight,
                                            double eps, const c10::optional<at::Tensor>& residual) {
  check_rows(x, "x", 16);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
              weight.numel() == x.size(1), "weight must be contiguous bfloat16 [H]");
  const bool has_res = residual && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == at::kBFloat16, "residual must match x");
  at::Tensor y = at::empty_like(x);
  at::Tensor h = has_res ? at::empty_like(x) : x;
  const int64_t H = x.size(1);
  const auto* xs = reinterpret_cast<const bf16_t*>(x.data_ptr());
  const auto* rs = has_res ? reinterpret_cast<const bf16_t*>(residual->data_ptr()) : nullptr;
  const auto* w = reinterpret_cast<const bf16_t*>(weight.data_ptr());
  auto *hs = reinterpret_cast<bf16_t*>(h.data_ptr()), *ys = reinterpret_cast<bf16_t*>(y.data_ptr());
  exact::parallel_rows(x.size(0), [&](int64_t r0, int64_t r1) {
    exact::rms_norm_into(xs + r0 * H, rs ? rs + r0 * H : nullptr, w, r1 - r0, H, (float)eps,
                         hs + r0 * H, ys + r0 * H);
  });
  return {y, h};
}

// gate_up [M, 2I] bf16 -> silu(gate) * up [M, I] bf16
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up", 32);
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor y = at::empty({M, I}, gate_up.options());
  const auto* g = reinterpret_cast<const bf16_t*>(gate_up.data_ptr());
  auto* ys = reinterpret_cast<bf16_t*>(y.data_ptr());
  exact::parallel_rows(M, [&](int64_t r0, int64_t r1) {
    exact::silu_mul_into(g + r0 * 2 * I, r1 - r0, I, ys + r0 * I, M);
  });
  return y;
}
