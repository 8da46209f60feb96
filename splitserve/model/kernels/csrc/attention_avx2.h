// Paged attention's AVX2 + FMA path (attention.cpp has the contract it computes).
#pragma once

#include "attention_paged.h"

namespace exact::attn {

// ---- AVX2 + FMA: the same FMAs, 8 lanes at a time --------------------------------------
// A pair's two halves as fp32: the odd element (high word) and the even one (low word).
inline float odd_of(uint32_t pair) {
  const uint32_t bits = pair & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float even_of(uint32_t pair) {
  const uint32_t bits = pair << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// r[i] dword j = r[j] dword i (an 8 x 8 dword transpose).
AVX2_TARGET inline void transpose_8x8_epi32(__m256i* r) {
  __m256i a[8], b[8];
  for (int i = 0; i < 8; i += 2) {
    a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // b[i + m], 128-bit lane k: column 4k + m of rows i..i+3
    b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x20);
    r[4 + m] = _mm256_permute2x128_si256(b[m], b[4 + m], 0x31);
  }
}

// kf[i][g]: pair i of keys l0 + 8g .. l0 + 8g + 7 (g < 4) as fp32, their odd halves then
// their even halves: 8 x 8 dword transposes (a key past L is zero; a group of 8 keys all
// past L keeps what it held, and the scores it gives are never used).
AVX2_TARGET void widen_keys(const Args& a, const int64_t* off, int64_t l0, int64_t L, float* kf) {
  const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t g = 0; g < 4 && l0 + 8 * g < L; ++g) {
    const bf16_t* rows[8];
    for (int64_t j = 0; j < 8; ++j) {
      const int64_t l = l0 + 8 * g + j;
      rows[j] = l < L ? a.k + off[l] : nullptr;
      if (l < L) prefetch_ahead(a, off, l, L);
    }
    for (int64_t c0 = 0; c0 < a.D / 2; c0 += 8) {
      __m256i r[8];
      for (int64_t j = 0; j < 8; ++j)
        r[j] = rows[j] ? _mm256_loadu_si256((const __m256i*)(rows[j] + 2 * c0))
                       : _mm256_setzero_si256();
      transpose_8x8_epi32(r);
      for (int64_t i = 0; i < 8; ++i) {
        float* dst = kf + ((c0 + i) * 4 + g) * 16;
        _mm256_storeu_si256((__m256i*)dst, _mm256_and_si256(r[i], hi));
        _mm256_storeu_si256((__m256i*)(dst + 8), _mm256_slli_epi32(r[i], 16));
      }
    }
  }
}

// Scores of NR rows over the tile's 32 keys (4 chains a row, 4 NR in flight).
template <int NR>
AVX2_TARGET void score_keys_avx2(const float* kf, int64_t DW, const float* qf, float scale,
                                 float* s, int64_t Ls) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < DW; ++i) {
    const float* k = kf + i * 64;
    for (int r = 0; r < NR; ++r) {
      const __m256 qo = _mm256_broadcast_ss(qf + (r * DW + i) * 2);
      const __m256 qe = _mm256_broadcast_ss(qf + (r * DW + i) * 2 + 1);
      for (int g = 0; g < 4; ++g)
        acc[r][g] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k + 16 * g + 8),
                                    _mm256_fmadd_ps(qo, _mm256_loadu_ps(k + 16 * g), acc[r][g]));
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int r = 0; r < NR; ++r)
    for (int g = 0; g < 4; ++g) _mm256_storeu_ps(s + r * Ls + 8 * g, _mm256_mul_ps(acc[r][g], sc));
}

template <int NR>
AVX2_TARGET void score_rows_avx2(const float* kf, int64_t DW, const float* qf, float scale,
                                 float* s, int64_t Ls, int64_t R) {
  int64_t r = 0;
  for (; r + NR <= R; r += NR) score_keys_avx2<NR>(kf, DW, qf + r * DW * 2, scale, s + r * Ls, Ls);
  if constexpr (NR > 1)
    if (r < R) score_rows_avx2<NR - 1>(kf, DW, qf + r * DW * 2, scale, s + r * Ls, Ls, R - r);
}

// The row's scores become p = bf16(exp(s - max)) as fp32 in place, zero on to Ls; returns Z.
AVX2_TARGET float softmax_row_avx2(float* s, int64_t L, int64_t Ls) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; l += 8) {
    const __m256 sv = _mm256_loadu_ps(s + l);
    const __m256 keep = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(8, L - l)), lane));
    // max(s, m) keeps m when s is NaN; a max is exact in any order
    mx = _mm256_max_ps(_mm256_blendv_ps(mx, sv, keep), mx);
  }
  const __m256 m = _mm256_set1_ps(max8(mx));
  V16 sum{_mm256_setzero_ps(), _mm256_setzero_ps()};  // lanes of 8 alternate lo / hi
  for (int64_t l = 0; l < Ls; l += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), m));
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(8, L - l));
    e = round_bf16(_mm256_and_ps(
        e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane))));
    _mm256_storeu_ps(s + l, e);
    __m256& acc = (l / 8) % 2 ? sum.hi : sum.lo;
    acc = _mm256_add_ps(acc, e);
  }
  return tree16(sum);
}

// NR rows' output chains over the tile's key pairs j0 .. j0+nj-1, 16 of head_dim at a time,
// the values widened straight from the cache: two unpacks turn a 16-value piece into dims
// [0-3, 8-11] and [4-7, 12-15], the order acc keeps until attend_avx2 stores the output.
// p: the numerators as fp32. As weigh_tile: a row's chain stops at its own last pair, and
// an odd context's last pair weighs a zero value.
template <int NR>
AVX2_TARGET void weigh_tile_avx2(const Args& a, const int64_t* off, int64_t j0, int64_t nj,
                                 const float* p, int64_t Ls, const int64_t* Lr,
                                 float* acc_mem, bool first) {
  const int64_t D = a.D;
  int64_t np[NR], whole = nj;
  for (int r = 0; r < NR; ++r) {
    np[r] = (Lr[r] + 1) / 2;
    whole = std::min(whole, Lr[r] / 2 - j0);
  }
  for (int64_t d = 0; d < D; d += 16) {
    auto widen = [&](int64_t l, __m256& lo, __m256& hi) AVX2_TARGET {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(a.v + off[l] + d));
      lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
      hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
    };
    __m256 lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      lo[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * D + d);
      hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_mem + r * D + d + 8);
    }
    int64_t j = 0;
    for (; j < whole; ++j) {  // whole pairs of every row's context: no checks
      const int64_t l = 2 * (j0 + j);
      __m256 ol, oh, el, eh;
      widen(l + 1, ol, oh), widen(l, el, eh);
      for (int r = 0; r < NR; ++r) {
        const __m256 po = _mm256_broadcast_ss(p + r * Ls + l + 1);
        const __m256 pe = _mm256_broadcast_ss(p + r * Ls + l);
        lo[r] = _mm256_fmadd_ps(pe, el, _mm256_fmadd_ps(po, ol, lo[r]));
        hi[r] = _mm256_fmadd_ps(pe, eh, _mm256_fmadd_ps(po, oh, hi[r]));
      }
    }
    for (; j < nj; ++j) {
      const int64_t l = 2 * (j0 + j);
      __m256 el, eh;
      widen(l, el, eh);
      for (int r = 0; r < NR; ++r) {
        if (j0 + j >= np[r]) continue;
        const bool odd_end = j0 + j == np[r] - 1 && Lr[r] % 2;  // v_L = 0
        __m256 vl = _mm256_setzero_ps(), vh = vl;
        if (!odd_end) widen(l + 1, vl, vh);
        const __m256 po = _mm256_broadcast_ss(p + r * Ls + l + 1);
        const __m256 pe = _mm256_broadcast_ss(p + r * Ls + l);
        lo[r] = _mm256_fmadd_ps(pe, el, _mm256_fmadd_ps(po, vl, lo[r]));
        hi[r] = _mm256_fmadd_ps(pe, eh, _mm256_fmadd_ps(po, vh, hi[r]));
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(acc_mem + r * D + d, lo[r]);
      _mm256_storeu_ps(acc_mem + r * D + d + 8, hi[r]);
    }
  }
}

template <int NR>
AVX2_TARGET void weigh_rows_avx2(const Args& a, const int64_t* off, int64_t j0, int64_t nj,
                                 const float* p, int64_t Ls, const int64_t* Lr,
                                 float* acc, bool first, int64_t R) {
  int64_t r = 0;
  for (; r + NR <= R; r += NR)
    weigh_tile_avx2<NR>(a, off, j0, nj, p + r * Ls, Ls, Lr + r, acc + r * a.D, first);
  if constexpr (NR > 1)
    if (r < R) weigh_rows_avx2<NR - 1>(a, off, j0, nj, p + r * Ls, Ls, Lr + r,
                                       acc + r * a.D, first, R - r);
}

template <int DC>  // head_dim / 16
AVX2_TARGET void attend_avx2(const Args& a, const Run& run, int64_t h, Scratch& sc) {
  constexpr int64_t D = DC * 16, DW = D / 2;
  const int64_t R = prepare_rows(a, run, h, sc), L = run.L, Ls = tiled(L);
  const int64_t* off = sc.offsets.data();
  sc.qf.resize(R * DW * 2), sc.kf.resize(DW * 64);
  for (int64_t r = 0; r < R * DW; ++r)
    sc.qf[2 * r] = odd_of(sc.q[r]), sc.qf[2 * r + 1] = even_of(sc.q[r]);
  prefetch_start(a, off, L);
  for (int64_t l0 = 0; l0 < L; l0 += kTile) {
    widen_keys(a, off, l0, L, sc.kf.data());
    score_rows_avx2<3>(sc.kf.data(), DW, sc.qf.data(), a.scale, sc.s.data() + l0, Ls, R);
  }
  for (int64_t r = 0; r < R; ++r)
    sc.z[r] = softmax_row_avx2(sc.s.data() + r * Ls, sc.rows_L[r], Ls);
  prefetch_tile<kL1>(a.v, off, 0, L, D);
  for (int64_t l0 = 0; l0 < L; l0 += kTile) {
    prefetch_tile<kL1>(a.v, off, l0 + kTile, L, D);
    const int64_t nj = std::min<int64_t>(kTile / 2, (L - l0 + 1) / 2);
    weigh_rows_avx2<4>(a, off, l0 / 2, nj, sc.s.data(), Ls, sc.rows_L.data(), sc.acc.data(),
                       l0 == 0, R);
  }
  for (int64_t r = 0; r < R; ++r) {  // acc: per 16 of head_dim, dims [0-3, 8-11] [4-7, 12-15]
    const __m256 z = _mm256_set1_ps(sc.z[r]);
    for (int64_t d = 0; d < D; d += 16) {
      const __m256 x = _mm256_div_ps(_mm256_loadu_ps(sc.acc.data() + r * D + d), z);
      const __m256 y = _mm256_div_ps(_mm256_loadu_ps(sc.acc.data() + r * D + d + 8), z);
      _mm_storeu_si128((__m128i*)(sc.rows_out[r] + d),
                       f32x8_to_bf16(_mm256_permute2f128_ps(x, y, 0x20)));
      _mm_storeu_si128((__m128i*)(sc.rows_out[r] + d + 8),
                       f32x8_to_bf16(_mm256_permute2f128_ps(x, y, 0x31)));
    }
  }
}

}  // namespace exact::attn
