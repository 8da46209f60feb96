// Shared by the exact kernels: types, ISA targets, bf16 rounding, MXCSR flushing.
#pragma once

#include <immintrin.h>

#include <cstdint>

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

}  // namespace exact
