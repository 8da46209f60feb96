// Shared by the exact kernels: types, ISA targets, bf16 rounding, MXCSR flushing.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "tasks.h"

namespace exact {

using bf16_t = uint16_t;

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))

// MXCSR FTZ | DAZ for this thread while in scope: the AVX2 path's FMAs then flush
// denormals as VDPBF16PS does; the AVX-512 path's adds and multiplies alike.
struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// fp32 -> bf16, round to nearest even (VCVTNEPS2BF16).
AVX512_TARGET inline __m256i f32x16_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// The same on AVX2: round to nearest even, NaN kept quiet (the inputs are never denormal
// here: MXCSR flushed them, as VCVTNEPS2BF16's DAZ would).
AVX2_TARGET inline __m128i f32x8_to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// exp(x) for x in [-87, 88] (clamped): one polynomial, its FMAs in one order on both
// paths (cephes expf).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kExpMin = -87.0f;  // e^-87 is still a normal float
constexpr float kExpMax = 88.0f;  // e^88 is still finite


// A 16-lane fp32 value as the AVX2 path holds it: lanes 0-7 and 8-15.
struct V16 {
  __m256 lo, hi;
};

AVX512_TARGET inline float tree16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// out[r] dword i = in[i] dword r (a 16 x 16 dword transpose, three interleave stages).
AVX512_TARGET inline void transpose_16x16_epi32(const __m512i* in, __m512i* out) {
  __m512i a[16], w[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // w[i + m], 128-bit lane j: column 4j + m of rows i..i+3
    w[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    w[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    w[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    w[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    const __m512i c0 = _mm512_shuffle_i32x4(w[m], w[4 + m], 0x44);
    const __m512i c1 = _mm512_shuffle_i32x4(w[m], w[4 + m], 0xEE);
    const __m512i c2 = _mm512_shuffle_i32x4(w[8 + m], w[12 + m], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(w[8 + m], w[12 + m], 0xEE);
    out[m] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    out[4 + m] = _mm512_shuffle_i32x4(c0, c2, 0xDD);
    out[8 + m] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    out[12 + m] = _mm512_shuffle_i32x4(c1, c3, 0xDD);
  }
}

AVX2_TARGET inline float tree16(V16 v) {
  const __m256 a = _mm256_add_ps(v.lo, v.hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// The largest of 8 lanes (exact in any order).
AVX2_TARGET inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

AVX512_TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  // y * 2^n in one instruction where exp8 builds 2^n's bits and multiplies: the same bits,
  // as both are exact while y * 2^n is a normal float, which the clamp makes it (n in
  // [-126, 127]; at n = -126, r > 0.33 so y > 1; at n = 127, y < 1).
  return _mm512_scalef_ps(y, n);
}

AVX2_TARGET inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX512_TARGET inline __m512 bf16x16_to_f32(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
AVX2_TARGET inline __m256 bf16x8_to_f32(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// fp32 -> bf16 -> fp32 (round to nearest even)
AVX512_TARGET inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(v)), 16));
}
AVX2_TARGET inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(f32x8_to_bf16(v)), 16));
}

}  // namespace exact
