// The linear layer's micro-kernels (exact.cpp dispatches them): each computes a tile of
// y = fold(x, w) for rows of x and 16-column blocks of a packed weight, every output
// element the same sequence of FMAs (exact.cpp's header) on every path.
#pragma once

#include <cstring>

#include "common.h"

namespace exact {

constexpr int kLanes = 16;      // fp32 lanes of one accumulator (one zmm, two ymm)
constexpr int kMaxRows = 6;     // rows of x per micro-kernel
constexpr int kMaxBlocks = 4;   // 16-column blocks of w per micro-kernel
// How far ahead a decode task (each weight read once) fetches its weights, past the caches
// (PREFETCHNTA: the 0.3 GB of a step's weights then no longer evict the Python and the
// activations the next step starts with). Measured per path: 1,024 bytes on the AVX2 Zen 1;
// 4,096 on a Zen 4's AVX-512 path (1,024 there was slower than the hardware prefetcher alone
// at fast DRAM moments, 8,192 and more slower still).
constexpr int64_t kPrefetchBytes = 1024;      // AVX2
constexpr int64_t kPrefetchBytes512 = 4096;   // AVX-512 BF16

// How a packed weight's 16-column blocks are grouped (pack_weight in kernels/__init__.py):
// two halves, [0, nblk / 2) and [nblk / 2, nblk), each stored by groups of kMaxBlocks from
// its start (a half's last group smaller), every group [KP][its blocks][16][2], one after
// the other. A decode linear's tasks are its groups, and two threads' shares (half the
// groups each) then hold the same bytes and end together: with groups of 4 from block 0,
// a linear of 9 or 15 groups (the model's O and down, its QKV) left one thread streaming
// the last group alone, at about half the DRAM rate two reach.
struct BlockGroups {
  int64_t nblk, half, first;  // first: the groups of the first half
  explicit BlockGroups(int64_t nblk_)
      : nblk(nblk_), half(nblk_ / 2), first((nblk_ / 2 + kMaxBlocks - 1) / kMaxBlocks) {}
  int64_t count() const { return first + (nblk - half + kMaxBlocks - 1) / kMaxBlocks; }
  int64_t begin(int64_t g) const {  // the group's first block
    return g < first ? g * kMaxBlocks : half + (g - first) * kMaxBlocks;
  }
  int blocks(int64_t g) const {
    return (int)std::min<int64_t>(kMaxBlocks, (g < first ? half : nblk) - begin(g));
  }
};

inline uint32_t load_pair(const bf16_t* p, bool full) {
  // Two consecutive bf16 as one 32-bit word (element 2p low, 2p+1 high); the second is
  // zero past an odd K, as the packed weights are.
  uint32_t v = p[0];
  if (full) std::memcpy(&v, p, sizeof(v));
  return v;
}

// ---- weight operands ---------------------------------------------------------------------
// Weights are bf16, or int8 (weight-only quantization: y = bf16(fold(x, q) * scale[j] (+ bias)),
// the fold over the int8 values exactly as over bf16 ones: every int8 is a bf16, and each
// product of a bf16 and an int8 is exact in fp32). One k pair of one 16-column block is 32
// elements, [16][2] (element 2p low).

// AVX-512: the 32 weights as bf16 pairs, VDPBF16PS's operand.
AVX512_TARGET inline __m512bh load_w512(const bf16_t* w) {
  return (__m512bh)_mm512_loadu_si512(w);
}
AVX512_TARGET inline __m512bh load_w512(const int8_t* w) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(w + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // exact: |q| <= 127 has 7 significant bits
}

// AVX2: 8 columns of one k pair (16 elements) as fp32, element 2p+1 and element 2p.
AVX2_TARGET inline void load_w256(const bf16_t* w, __m256& odd, __m256& even) {
  const __m256i words = _mm256_loadu_si256((const __m256i*)w);
  odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xFFFF0000u)));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}
AVX2_TARGET inline void load_w256(const int8_t* w, __m256& odd, __m256& even) {
  const __m256i words = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w));
  odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(words, 16));
  even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(words, 16), 16));
}

// ---- AVX-512 BF16 -----------------------------------------------------------------------
// C[r, block c] for MR rows x NB 16-column blocks; w points at block 0 of the group,
// the group is [KP][NB][16][2] (one contiguous stream: `pair_stride` = NB * 32 elements per
// k pair). scale: int8 weights' per-column scales (nullptr for bf16 weights).
template <int MR, int NB, typename W>
AVX512_TARGET void micro_avx512(const bf16_t* x, int64_t ldx, int64_t K, const W* w,
                                int64_t pair_stride, const float* scale, const float* bias,
                                bf16_t* y, int64_t ldy, int64_t n_valid, bool stream) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t KP = (K + 1) / 2, full_pairs = K / 2;
  constexpr int64_t kRunBytes = NB * 2 * kLanes * (int64_t)sizeof(W);  // read per k pair
  auto step = [&](int64_t p, bool full) AVX512_TARGET {
    __m512bh b[NB];
    for (int c = 0; c < NB; ++c) b[c] = load_w512(w + p * pair_stride + c * 2 * kLanes);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32((int)load_pair(x + r * ldx + 2 * p, full));
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
    }
  };
  if (stream) {  // each weight is read once, from DRAM (decode); a loop of its own: the
                 // branch inside the one loop cost the 6-row kernel 2.6x (spilled registers)
    for (int64_t p = 0; p < full_pairs; ++p) {
      const char* ahead = (const char*)(w + p * pair_stride) + kPrefetchBytes512;
      for (int64_t b = 0; b < kRunBytes; b += 64) prefetch_line<0>(ahead + b);
      step(p, true);
    }
  } else {
    for (int64_t p = 0; p < full_pairs; ++p) step(p, true);
  }
  if (KP > full_pairs) step(full_pairs, false);
  for (int c = 0; c < NB; ++c) {
    const int64_t n0 = c * kLanes;
    const int64_t left = n_valid - n0;
    if (left <= 0) break;
    const __mmask16 m = left >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(m, scale + n0) : _mm512_setzero_ps();
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      __m512 v = scale ? _mm512_mul_ps(acc[r][c], sv) : acc[r][c];
      if (bias) v = _mm512_add_ps(v, bv);
      _mm256_mask_storeu_epi16(y + r * ldy + n0, m, f32x16_to_bf16(v));
    }
  }
}

// ---- AVX2 + FMA: the same arithmetic, one FMA at a time ---------------------------------
// The columns [n0, n0 + 8) of one row, the first n of them stored (fewer at the right
// edge): y = bf16(acc * scale + bias), each step only where given (int8 scales, a bias).
AVX2_TARGET inline void store_cols8(__m256 acc, const float* scale, const float* bias,
                                    int64_t n0, int64_t n, bf16_t* y) {
  alignas(32) float operand[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  __m256 v = acc;
  if (scale) {
    std::memcpy(operand, scale + n0, sizeof(float) * n);
    v = _mm256_mul_ps(v, _mm256_load_ps(operand));
  }
  if (bias) {
    std::memcpy(operand, bias + n0, sizeof(float) * n);
    v = _mm256_add_ps(v, _mm256_load_ps(operand));
  }
  alignas(16) bf16_t out[8];
  _mm_store_si128((__m128i*)out, f32x8_to_bf16(v));
  std::memcpy(y + n0, out, sizeof(bf16_t) * n);
}

template <int MR, int NB, typename W>
AVX2_TARGET void micro_avx2(const bf16_t* x, int64_t ldx, int64_t K, const W* w,
                            int64_t pair_stride, const float* scale, const float* bias,
                            bf16_t* y, int64_t ldy, int64_t n_valid, bool stream) {
  __m256 acc[MR][NB][2];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NB; ++c) acc[r][c][0] = acc[r][c][1] = _mm256_setzero_ps();
  const int64_t KP = (K + 1) / 2, full_pairs = K / 2;
  constexpr int64_t kRunBytes = NB * 2 * kLanes * (int64_t)sizeof(W);  // read per k pair
  for (int64_t p = 0; p < KP; ++p) {
    if (stream) {  // each weight is read once, from DRAM: fetch it ahead, past the caches
      const char* ahead = (const char*)(w + p * pair_stride) + kPrefetchBytes;
      for (int64_t b = 0; b < kRunBytes; b += 64) prefetch_line<0>(ahead + b);
    }
    if constexpr (MR == 1) {
      // No row reuses a weight: widen and multiply one block at a time, so the 8
      // accumulators stay in registers (loading all 16 widened halves first spilled them).
      const __m256i pair = _mm256_set1_epi32((int)load_pair(x + 2 * p, p < full_pairs));
      const __m256 ao = _mm256_castsi256_ps(
          _mm256_and_si256(pair, _mm256_set1_epi32((int)0xFFFF0000u)));
      const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
#pragma GCC unroll 8
      for (int c = 0; c < NB; ++c)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256 odd, even;
          load_w256(w + p * pair_stride + c * 2 * kLanes + h * kLanes, odd, even);
          acc[0][c][h] = _mm256_fmadd_ps(ao, odd, acc[0][c][h]);
          acc[0][c][h] = _mm256_fmadd_ps(ae, even, acc[0][c][h]);
        }
      continue;
    }
    __m256 bo[NB][2], be[NB][2];
    for (int c = 0; c < NB; ++c)
      for (int h = 0; h < 2; ++h)
        load_w256(w + p * pair_stride + c * 2 * kLanes + h * kLanes, bo[c][h], be[c][h]);
    for (int r = 0; r < MR; ++r) {
      const __m256i pair = _mm256_set1_epi32((int)load_pair(x + r * ldx + 2 * p, p < full_pairs));
      const __m256 ao = _mm256_castsi256_ps(
          _mm256_and_si256(pair, _mm256_set1_epi32((int)0xFFFF0000u)));
      const __m256 ae = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
      for (int c = 0; c < NB; ++c)
        for (int h = 0; h < 2; ++h) {
          acc[r][c][h] = _mm256_fmadd_ps(ao, bo[c][h], acc[r][c][h]);
          acc[r][c][h] = _mm256_fmadd_ps(ae, be[c][h], acc[r][c][h]);
        }
    }
  }
  for (int c = 0; c < NB; ++c)
    for (int h = 0; h < 2; ++h) {
      const int64_t n0 = c * kLanes + h * 8, left = n_valid - n0;
      if (left <= 0) break;
      for (int r = 0; r < MR; ++r)
        store_cols8(acc[r][c][h], scale, bias, n0, left < 8 ? left : 8, y + r * ldy);
    }
}

// ---- AVX2 + FMA over a widened group: the same FMAs, each operand widened once --------
// A task of many rows (prefill, large batches) widens its 4-block group once into fp32
// [KP][2 nb halves][odd 8 | even 8] (`widen_group`) and its rows into fp32 pairs
// [rows][KP][odd, even] (`widen_rows`: the two halves of load_pair's word, as the FMAs
// take them). panel_avx2 then runs R rows x 2 halves (one 16-column block) over kPanelPairs
// k pairs: x broadcast from memory, each weight a memory operand of its FMA, the 2R
// accumulators in registers and parked in an fp32 buffer between chunks. Each element's
// FMAs stay the same, in the same order: the same bits. The chunk's weights (4 KiB) and
// rows stay in L1; over all of K at once the widened group streamed from L2, and widening
// x in registers took the FP pipes from the FMAs. Measured on the AVX2 Zen 3 (one thread,
// 60 rows x 64 columns, K 576 / 1536; FMA peak 101 GFLOP/s): 2 rows x 4 halves over all
// of K 40-46 GFLOP/s; over 32-pair chunks 52-54; with x widened once: 4 x 2 66-71,
// 5 x 2 77-83, 6 x 2 (12 accumulators) 56-62, 3 x 4 50-55.
constexpr int kPanelRows = 5;
constexpr int64_t kPanelPairs = 32;

// k pairs [p0, p1) of a group, widened: out [p1 - p0][2 nb halves][odd 8 | even 8].
template <typename W>
AVX2_TARGET void widen_group(const W* w, int64_t p0, int64_t p1, int nb, float* out) {
  for (int64_t p = p0; p < p1; ++p)
    for (int c = 0; c < 2 * nb; ++c) {  // half c: block c / 2, columns 8 (c % 2) ..
      __m256 odd, even;
      load_w256(w + (p * nb * 2 + c) * kLanes, odd, even);
      float* o = out + ((p - p0) * nb * 2 + c) * 16;
      _mm256_storeu_ps(o, odd);
      _mm256_storeu_ps(o + 8, even);
    }
}

// 8 pairs a step: their words' high and low halves, interleaved (odd, even) per pair.
AVX2_TARGET inline void widen_rows(const bf16_t* x, int64_t ldx, int64_t K, int64_t rows,
                                   float* out) {
  const int64_t KP = (K + 1) / 2, full_pairs = K / 2;
  const __m256i hi = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t r = 0; r < rows; ++r) {
    const bf16_t* row = x + r * ldx;
    float* o = out + r * KP * 2;
    int64_t p = 0;
    for (; p + 8 <= full_pairs; p += 8) {
      const __m256i words = _mm256_loadu_si256((const __m256i*)(row + 2 * p));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words, hi));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      const __m256 a = _mm256_unpacklo_ps(odd, even);  // pairs 0, 1 | 4, 5
      const __m256 b = _mm256_unpackhi_ps(odd, even);  // pairs 2, 3 | 6, 7
      _mm256_storeu_ps(o + 2 * p, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(o + 2 * p + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
    for (; p < KP; ++p) {
      const uint32_t pair = load_pair(row + 2 * p, p < full_pairs);
      const uint32_t odd = pair & 0xFFFF0000u, even = pair << 16;
      std::memcpy(o + 2 * p, &odd, sizeof(float));
      std::memcpy(o + 2 * p + 1, &even, sizeof(float));
    }
  }
}

// R rows of xf (widened, [R][KP][2]) over k pairs [p0, p1) of one block of the widened
// chunk (wf: pair p0 of the block's first half); acc [R][16]: zero when p0 == 0, else the
// chunk before's.
template <int R>
AVX2_TARGET void panel_avx2(const float* xf, int64_t KP, int64_t p0, int64_t p1,
                            const float* wf, int64_t pair_stride, float* acc_out) {
  __m256 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h)
      acc[r][h] = p0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_out + r * 16 + h * 8);
  for (int64_t p = p0; p < p1; ++p) {
    const float* wp = wf + (p - p0) * pair_stride;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 ao = _mm256_broadcast_ss(xf + (r * KP + p) * 2);
      const __m256 ae = _mm256_broadcast_ss(xf + (r * KP + p) * 2 + 1);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_fmadd_ps(ao, _mm256_loadu_ps(wp + h * 16), acc[r][h]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        acc[r][h] = _mm256_fmadd_ps(ae, _mm256_loadu_ps(wp + h * 16 + 8), acc[r][h]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(acc_out + r * 16 + h * 8, acc[r][h]);
}

// `rows` rows of x over a group of `nb` packed blocks (n_valid columns of y), a block at a
// time, kPanelRows rows at a time (the last fewer), k in chunks of kPanelPairs. Many rows
// (a prefill's task) widen the whole group first, into L2, each block's chunk then read
// by all their panels. Up to kChunkRows rows (a decode step's) widen the group a chunk at
// a time instead, all its blocks (16 KiB at 4: it stays in L1), and run every block's
// panels on it: the whole group widened (147 KiB at K 576, 393 at K 1,536) cost ~3 us a
// task, before any FMA, and went past L2 at K 1,536 (the down projection's 8 rows ran at
// ~35 GFLOP/s a thread there, ~60 now; a batch-8 decode step ~5% faster on a Zen 3; 32
// rows chunked were slower at the engine: the sums of 32 rows, 4 blocks each, crowd L1).
// `xf`: rows * KP * 2 floats, `wf`: panel_floats, `acc`: nb * rows * 16 (per-thread).
constexpr int64_t kChunkRows = 30;
inline int64_t panel_floats(int64_t rows, int64_t KP, int nb) {
  return (rows <= kChunkRows ? std::min(KP, kPanelPairs) : KP) * nb * 2 * kLanes;
}
template <typename W>
AVX2_TARGET inline void run_panels(const bf16_t* x, int64_t ldx, int64_t K, const W* w,
                                   int nb, const float* scale, const float* bias, bf16_t* y,
                                   int64_t ldy, int64_t n_valid, int64_t rows, float* xf,
                                   float* wf, float* acc) {
  using Panel = void (*)(const float*, int64_t, int64_t, int64_t, const float*, int64_t,
                         float*);
  static constexpr Panel kPanels[kPanelRows] = {panel_avx2<1>, panel_avx2<2>, panel_avx2<3>,
                                                panel_avx2<4>, panel_avx2<5>};
  const int64_t KP = (K + 1) / 2, pair_stride = nb * 2 * kLanes;  // floats per k pair
  const int blocks = (int)std::min<int64_t>(nb, (n_valid + kLanes - 1) / kLanes);
  const bool chunked = rows <= kChunkRows;
  auto panels = [&](int b, int64_t p0, int64_t p1, const float* chunk) AVX2_TARGET {
    for (int64_t r = 0; r < rows; r += kPanelRows) {
      const int n = (int)std::min<int64_t>(kPanelRows, rows - r);
      kPanels[n - 1](xf + r * KP * 2, KP, p0, p1, chunk + b * 32, pair_stride,
                     acc + (b * rows + r) * 16);
    }
  };
  widen_rows(x, ldx, K, rows, xf);
  if (chunked) {
    for (int64_t p0 = 0; p0 < KP; p0 += kPanelPairs) {
      const int64_t p1 = std::min(KP, p0 + kPanelPairs);
      widen_group(w, p0, p1, nb, wf);
      for (int b = 0; b < blocks; ++b) panels(b, p0, p1, wf);
    }
  } else {
    widen_group(w, 0, KP, nb, wf);
    for (int b = 0; b < blocks; ++b)
      for (int64_t p0 = 0; p0 < KP; p0 += kPanelPairs)
        panels(b, p0, std::min(KP, p0 + kPanelPairs), wf + p0 * pair_stride);
  }
  for (int b = 0; b < blocks; ++b)
    for (int h = 0; h < 2; ++h) {
      const int64_t n0 = b * kLanes + h * 8, left = n_valid - n0;
      if (left <= 0) break;
      for (int64_t r = 0; r < rows; ++r)
        store_cols8(_mm256_loadu_ps(acc + (b * rows + r) * 16 + h * 8), scale, bias, n0,
                    left < 8 ? left : 8, y + r * ldy);
    }
}

}  // namespace exact

