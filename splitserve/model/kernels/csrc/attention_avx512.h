// Paged attention's AVX-512 BF16 path (attention.cpp has the contract it computes).
#pragma once

#include "attention_paged.h"

namespace exact::attn {

// ---- AVX-512 BF16 ----------------------------------------------------------------------
// kt[i][j] = pair i of key l0 + j (zero past L): 16 x 16 dword transposes.
AVX512_TARGET void transpose_keys(const Args& a, const int64_t* off, int64_t l0, int64_t L,
                                  uint32_t* kt) {
  const int64_t DW = a.D / 2;
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t c0 = 0; c0 < DW; c0 += 16) {
      const int64_t n = std::min<int64_t>(16, DW - c0);
      const __mmask16 m = (__mmask16)((1u << n) - 1);
      __m512i in[16], out[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t l = l0 + 16 * half + j;
        if (l < L && c0 == 0) prefetch_ahead(a, off, l, L);
        in[j] = l < L ? _mm512_maskz_loadu_epi32(m, a.k + off[l] + 2 * c0)
                      : _mm512_setzero_si512();
      }
      transpose_16x16_epi32(in, out);
      for (int64_t i = 0; i < n; ++i)
        _mm512_storeu_si512(kt + (c0 + i) * kTile + 16 * half, out[i]);
    }
}

// Scores of NR rows over the tile's 32 keys: one chain a (row, key), 2 NR chains in flight.
template <int NR>
AVX512_TARGET void score_tile(const uint32_t* kt, int64_t DW, const uint32_t* q, float scale,
                              float* s, int64_t Ls) {
  __m512 acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < DW; ++i) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + i * kTile);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + i * kTile + 16);
    for (int r = 0; r < NR; ++r) {
      const __m512bh qi = (__m512bh)_mm512_set1_epi32((int)q[r * DW + i]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qi, k0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qi, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(s + r * Ls, _mm512_mul_ps(acc[r][0], sc));
    _mm512_storeu_ps(s + r * Ls + 16, _mm512_mul_ps(acc[r][1], sc));
  }
}

// p = bf16(exp(s - max)) over the row's L keys, zero on to Ls; returns Z.
AVX512_TARGET float softmax_row(const float* s, int64_t L, int64_t Ls, bf16_t* p) {
  // max(s, m) keeps m when s is NaN, as the AVX2 path's does; a max is exact in any order
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; l += 16) {
    const __mmask16 valid = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
    mx = _mm512_mask_max_ps(mx, valid, _mm512_loadu_ps(s + l), mx);
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t l = 0; l < Ls; l += 16) {
    const __mmask16 valid = L - l >= 16 ? (__mmask16)0xFFFF
                            : L > l ? (__mmask16)((1u << (L - l)) - 1) : (__mmask16)0;
    const __m256i pb = f32x16_to_bf16(
        _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l), m))));
    _mm256_storeu_si256((__m256i*)(p + l), pb);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
  }
  return tree16(sum);
}

// (v_l[d], v_{l+1}[d]) for d = 16c .. 16c+15, a key at or past L zero: one two-source word
// permute (idx: words 0, 32, 1, 33, ..., pair_index()).
AVX512_TARGET inline __m512i pair_index() {
  alignas(64) static const uint16_t kIdx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                12, 44, 13, 45, 14, 46, 15, 47};
  return _mm512_load_si512(kIdx);
}
AVX512_TARGET inline __m512i value_pair(const Args& a, const int64_t* off, int64_t l, int64_t L,
                                        int64_t c, __m512i idx) {
  const __m512i e = l < L ? _mm512_zextsi256_si512(
                                _mm256_loadu_si256((const __m256i*)(a.v + off[l] + 16 * c)))
                          : _mm512_setzero_si512();
  const __m512i o = l + 1 < L ? _mm512_zextsi256_si512(_mm256_loadu_si256(
                                    (const __m256i*)(a.v + off[l + 1] + 16 * c)))
                              : _mm512_setzero_si512();
  return _mm512_permutex2var_epi16(e, idx, o);
}

// A tile's value pairs: vt[j][c] (pair_values) for a run of several row groups, which all
// read them; none for a run of one group (a decode token's): it builds each pair as it
// weighs it (the store and reload of vt were a fifth of a decode token's attention).
struct ValuePairs {
  const Args& a;
  const int64_t* off;
  int64_t l0, L;
  const uint32_t* vt;  // or null
};

// vt[j][c]: the tile's value pairs, once for all of a run's row groups.
AVX512_TARGET void pair_values(const Args& a, const int64_t* off, int64_t l0, int64_t L,
                               uint32_t* vt) {
  const __m512i idx = pair_index();
  const int64_t DC = a.D / 16;
  for (int64_t j = 0; j < kTile / 2; ++j)
    for (int64_t c = 0; c < DC; ++c)
      _mm512_storeu_si512(vt + (j * DC + c) * 16, value_pair(a, off, l0 + 2 * j, L, c, idx));
}

// NR rows' output chains over the tile's key pairs j0 .. j0+nj-1 (a row's chain stops at
// its own last pair), continued from acc (started at +0 on the first tile).
template <int DC, int NR>
AVX512_TARGET void weigh_tile(const ValuePairs& vp, int64_t j0, int64_t nj, const bf16_t* p,
                              int64_t Ls, const int64_t* L, float* acc_mem, bool first) {
  constexpr int64_t D = DC * 16;
  const __m512i idx = pair_index();
  auto load = [&](__m512bh* v, int64_t j) AVX512_TARGET {
    for (int c = 0; c < DC; ++c)
      v[c] = (__m512bh)(vp.vt ? _mm512_loadu_si512(vp.vt + (j * DC + c) * 16)
                              : value_pair(vp.a, vp.off, vp.l0 + 2 * j, vp.L, c, idx));
  };
  __m512 acc[NR][DC];
  int64_t np[NR];
  for (int r = 0; r < NR; ++r) {
    np[r] = (L[r] + 1) / 2;
    for (int c = 0; c < DC; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_mem + r * D + 16 * c);
  }
  // Pairs below `whole` are whole pairs of every row's context: no checks.
  int64_t whole = nj;
  for (int r = 0; r < NR; ++r) whole = std::min(whole, L[r] / 2 - j0);
  int64_t j = 0;
  for (; j < whole; ++j) {
    __m512bh v[DC];
    load(v, j);
    for (int r = 0; r < NR; ++r) {
      uint32_t pair;
      std::memcpy(&pair, p + r * Ls + 2 * (j0 + j), sizeof(pair));
      const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int c = 0; c < DC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pj, v[c]);
    }
  }
  for (; j < nj; ++j) {
    __m512bh v[DC];
    load(v, j);
    for (int r = 0; r < NR; ++r) {
      // (not _mm512_mask_dpbf16_ps: gcc 12 loads its 16-bit mask with kmovb, 8 lanes)
      if (j0 + j >= np[r]) continue;
      uint32_t pair;
      std::memcpy(&pair, p + r * Ls + 2 * (j0 + j), sizeof(pair));
      const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pair);
      if (j0 + j == np[r] - 1 && L[r] % 2) {  // an odd context's last pair: v_L = 0
        for (int c = 0; c < DC; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pj, (__m512bh)_mm512_and_si512(
                                           (__m512i)v[c], _mm512_set1_epi32(0xFFFF)));
        continue;
      }
      for (int c = 0; c < DC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pj, v[c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc_mem + r * D + 16 * c, acc[r][c]);
}

// Rows a group: score chains 2 a row; output chains DC a row, with DC value registers.
constexpr int kScoreRows = 6;
template <int DC> constexpr int kWeighRows = std::min(6, (30 - DC) / DC);

template <int DC, int NR>
AVX512_TARGET void weigh_rows(const ValuePairs& vp, int64_t j0, int64_t nj, const bf16_t* p,
                              int64_t Ls, const int64_t* L, float* acc, bool first, int64_t R) {
  int64_t r = 0;
  for (; r + NR <= R; r += NR)
    weigh_tile<DC, NR>(vp, j0, nj, p + r * Ls, Ls, L + r, acc + r * DC * 16, first);
  if constexpr (NR > 1)
    if (r < R) weigh_rows<DC, NR - 1>(vp, j0, nj, p + r * Ls, Ls, L + r, acc + r * DC * 16,
                                      first, R - r);
}

template <int NR>
AVX512_TARGET void score_rows(const uint32_t* kt, int64_t DW, const uint32_t* q, float scale,
                              float* s, int64_t Ls, int64_t R) {
  int64_t r = 0;
  for (; r + NR <= R; r += NR) score_tile<NR>(kt, DW, q + r * DW, scale, s + r * Ls, Ls);
  if constexpr (NR > 1)
    if (r < R) score_rows<NR - 1>(kt, DW, q + r * DW, scale, s + r * Ls, Ls, R - r);
}

template <int DC>  // head_dim / 16
AVX512_TARGET void attend_avx512(const Args& a, const Run& run, int64_t h, Scratch& sc) {
  constexpr int64_t D = DC * 16, DW = D / 2;
  const int64_t R = prepare_rows(a, run, h, sc), L = run.L, Ls = tiled(L);
  const int64_t* off = sc.offsets.data();
  sc.kt.resize(DW * kTile), sc.vt.resize(kTile / 2 * D);
  prefetch_start(a, off, L);
  for (int64_t l0 = 0; l0 < L; l0 += kTile) {
    transpose_keys(a, off, l0, L, sc.kt.data());
    score_rows<kScoreRows>(sc.kt.data(), DW, sc.q.data(), a.scale, sc.s.data() + l0, Ls, R);
  }
  for (int64_t r = 0; r < R; ++r)
    sc.z[r] = softmax_row(sc.s.data() + r * Ls, sc.rows_L[r], Ls, sc.p.data() + r * Ls);
  prefetch_tile<kL1>(a.v, off, 0, L, D);
  for (int64_t l0 = 0; l0 < L; l0 += kTile) {
    prefetch_tile<kL1>(a.v, off, l0 + kTile, L, D);
    const bool packed = R > kWeighRows<DC>;
    if (packed) pair_values(a, off, l0, L, sc.vt.data());
    const ValuePairs vp{a, off, l0, L, packed ? sc.vt.data() : nullptr};
    const int64_t nj = std::min<int64_t>(kTile / 2, (L - l0 + 1) / 2);
    weigh_rows<DC, kWeighRows<DC>>(vp, l0 / 2, nj, sc.p.data(), Ls, sc.rows_L.data(),
                                   sc.acc.data(), l0 == 0, R);
  }
  for (int64_t r = 0; r < R; ++r) {
    const __m512 z = _mm512_set1_ps(sc.z[r]);
    for (int64_t c = 0; c < DC; ++c)
      _mm256_storeu_si256((__m256i*)(sc.rows_out[r] + 16 * c),
                          f32x16_to_bf16(_mm512_div_ps(
                              _mm512_loadu_ps(sc.acc.data() + r * D + 16 * c), z)));
  }
}

}  // namespace exact::attn
