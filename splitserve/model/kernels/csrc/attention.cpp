// Batch-invariant paged attention (see exact.cpp for the contract and the two ISA paths;
// on AMX-BF16 CPUs, attention_amx.h's tiles, with bits of their own).
//
// Every query row (a token's head) attends to keys 0 .. L-1 of its own sequence (L its
// context), read in position order through its block table, so the bits depend on neither
// the physical blocks, the other tokens of the step, a prefill chunk's size nor a decode
// batch:
//
//   s_l = chain(q, k_l) * scale    chain: acc = +0, then for head_dim pairs i = 0, 1, ...
//                                  acc = fma(q[2i+1], k[2i+1], acc); acc = fma(q[2i], k[2i], acc)
//   m   = max_l s_l                                                        (exact)
//   p_l = bf16( exp(s_l - m) )                   (one polynomial, FMAs in order)
//   Z   = tree16( 16 lanes, lane i summing p_l for l = i, i+16, ... in order )
//   o   = bf16( chain over key pairs j = 0 .. ceil(L/2)-1 of
//               acc = fma(p_{2j+1}, v_{2j+1}, acc); acc = fma(p_{2j}, v_{2j}, acc) ) / Z )
//         with p_L = v_L = 0 (an odd L's last pair).
//
// Both chains are VDPBF16PS steps (its definition is that pair of FMAs, as the linear's
// fold), so the AVX-512 path runs two bf16 dot-product instructions per (row, key): the
// scores with 16 keys in the lanes (a tile's keys transposed into head_dim pairs once), the
// output with 16 of head_dim in the lanes (a tile's values interleaved into key pairs once).
// A task is a run of up to kRunRows / G consecutive tokens of one sequence and one KV head:
// every row of the run reads each transposed tile, so a prefill pays the transposes once
// for all of its run's rows (a decode token's run is itself). A row's output chain stops at
// its own last pair, whatever the run's longest context, and never reads a value past its
// context (a slot there may hold anything: a NaN times a zero p is NaN); a score past a
// row's context is never used. The AVX2 path computes the same FMAs one by one under MXCSR
// FTZ|DAZ (tests/model/test_exact_kernels.py checks the bits against a torch emulation
// of the formulas above, on every ISA level the CPU has).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <limits>
#include <vector>

#include "attention_amx.h"
#include "common.h"
#include "ops.h"

namespace {

using namespace exact;

struct Args {
  const bf16_t* q;
  int64_t q_tok, q_head;  // strides of q in elements (the last is 1)
  const bf16_t* k;
  const bf16_t* v;
  int64_t blk_stride, tok_stride;  // in the cache: per block, per token slot (= HKV * D)
  int64_t block_size;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* token_seq;
  const int32_t* ctx;
  int64_t H, HKV, D;
  float scale;
  bf16_t* out;  // [T, H, D] contiguous
};

// Tokens t0 .. t0+nt-1 of the step, all of one sequence; L: the most keys one of them sees.
struct Run {
  int64_t t0, nt, L;
};

constexpr int64_t kRunRows = 48;  // query rows (tokens x heads of a group) a run holds at most
constexpr int64_t kTile = 32;     // keys a tile: two groups of 16 lanes, 16 key pairs

// Cache offset of each of the run's keys 0 .. L-1 in head h, in position order.
inline void key_offsets(const Args& a, const Run& run, int64_t h, std::vector<int64_t>& off) {
  const int32_t* table = a.tables + a.token_seq[run.t0] * a.table_stride;
  off.resize(run.L);
  for (int64_t l0 = 0, b = 0; l0 < run.L; l0 += a.block_size, ++b) {
    const int64_t base = table[b] * a.blk_stride + h * a.D;
    const int64_t n = std::min(a.block_size, run.L - l0);
    for (int64_t o = 0; o < n; ++o) off[l0 + o] = base + o * a.tok_stride;
  }
}

struct Scratch {
  std::vector<int64_t> offsets;  // [L]
  std::vector<uint32_t> q;       // [R][D/2]: each row's query as head_dim pairs
  std::vector<float> qf;         // AVX2: [R][D/2][2] the pairs as fp32 (odd, even)
  std::vector<float> s;          // [R][Ls]: scores (Ls: L rounded up to the tile); AVX2:
                                 // then the numerators as fp32
  std::vector<bf16_t> p;         // [R][Ls]: softmax numerators, zero past the row's keys
  std::vector<float> z;          // [R]
  std::vector<float> acc;        // [R][D]: output chains between tiles
  std::vector<uint32_t> kt;      // [D/2][kTile]: a tile's keys by head_dim pair
  std::vector<uint32_t> vt;      // [kTile/2][D]: a tile's values by key pair (AVX-512)
  std::vector<float> kf;         // AVX2: [D/2][4][2][8] a tile's keys' pairs as fp32
  std::vector<int64_t> rows_L;   // [R]: each row's context
  std::vector<bf16_t*> rows_out;  // [R]
};

// Keys a row of the score and numerator buffers holds: L rounded up to the tile.
inline int64_t tiled(int64_t L) { return (L + kTile - 1) / kTile * kTile; }

// The run's rows, row r = (token t0 + r / G, head h * G + r % G), and the task's buffers.
inline int64_t prepare_rows(const Args& a, const Run& run, int64_t h, Scratch& sc) {
  const int64_t G = a.H / a.HKV, R = run.nt * G, DW = a.D / 2, Ls = tiled(run.L);
  sc.rows_L.resize(R), sc.rows_out.resize(R), sc.q.resize(R * DW);
  sc.s.resize(R * Ls), sc.p.resize(R * Ls), sc.z.resize(R), sc.acc.resize(R * a.D);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = run.t0 + r / G, head = h * G + r % G;
    sc.rows_L[r] = a.ctx[t];
    sc.rows_out[r] = a.out + (t * a.H + head) * a.D;
    std::memcpy(sc.q.data() + r * DW, a.q + t * a.q_tok + head * a.q_head, a.D * sizeof(bf16_t));
  }
  key_offsets(a, run, h, sc.offsets);
  return R;
}

// Cache rows (K or V, one head) prefetched toward the core. A decode token reads each row
// once, gathered through its block table, where the hardware prefetcher loses the stride at
// every block, and scores a tile in well under a DRAM latency: as both paths load a key's
// K row for a tile's scores, they fetch the K row kTilesAhead tiles on into L2 and one tile
// on into L1, and the key's V row into L2 (values are weighed after every score); before
// weighing a tile, its successor's V rows into L1. Cache cold (30 layers in turn), one
// thread, a Zen 4: a token over 2,000 keys 0.26 -> 0.12 ms a layer, 32 tokens over 255
// keys each 1.1 -> 0.62 ms (docs/benchmarks.md, 2026-11-29 18:0x).
template <int Locality>
inline void prefetch_row(const bf16_t* row, int64_t D) {  // D <= 128: at most 4 lines
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < 2 * D; b += 64) prefetch_line<Locality>(p + b);
}
constexpr int kL1 = 3, kL2 = 2;
template <int Locality>
inline void prefetch_tile(const bf16_t* base, const int64_t* off, int64_t l0, int64_t L,
                          int64_t D) {
  for (int64_t l = l0; l < std::min(L, l0 + kTile); ++l) prefetch_row<Locality>(base + off[l], D);
}
constexpr int64_t kTilesAhead = 4;
// Before a run's first tile: the K rows of its first kTilesAhead tiles.
inline void prefetch_start(const Args& a, const int64_t* off, int64_t L) {
  for (int64_t l = 0; l < std::min(L, kTilesAhead * kTile); ++l) {
    if (l < kTile) prefetch_row<kL1>(a.k + off[l], a.D);
    else prefetch_row<kL2>(a.k + off[l], a.D);
  }
}
// The K rows of a run's first kTilesAhead tiles in head h into L2: a thread's next task
// (likely the one after it in its share of the tasks) while it works on this one.
inline void prefetch_run(const Args& a, const Run& run, int64_t h) {
  const int32_t* table = a.tables + a.token_seq[run.t0] * a.table_stride;
  const int64_t n = std::min(run.L, kTilesAhead * kTile);
  for (int64_t l0 = 0, b = 0; l0 < n; l0 += a.block_size, ++b) {
    const bf16_t* block = a.k + table[b] * a.blk_stride + h * a.D;
    for (int64_t o = 0; o < std::min(a.block_size, n - l0); ++o)
      prefetch_row<kL2>(block + o * a.tok_stride, a.D);
  }
}
// As key l's K row is loaded: the K rows of l + kTilesAhead tiles (L2) and l + 1 tile
// (L1), and V of l into L2.
inline void prefetch_ahead(const Args& a, const int64_t* off, int64_t l, int64_t L) {
  if (l + kTilesAhead * kTile < L) prefetch_row<kL2>(a.k + off[l + kTilesAhead * kTile], a.D);
  if (l + kTile < L) prefetch_row<kL1>(a.k + off[l + kTile], a.D);
  prefetch_row<kL2>(a.v + off[l], a.D);
}

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

using AttendFn = void (*)(const Args&, const Run&, int64_t, Scratch&);
constexpr AttendFn kAttendAvx512[8] = {attend_avx512<1>, attend_avx512<2>, attend_avx512<3>,
                                       attend_avx512<4>, attend_avx512<5>, attend_avx512<6>,
                                       attend_avx512<7>, attend_avx512<8>};
constexpr AttendFn kAttendAvx2[8] = {attend_avx2<1>, attend_avx2<2>, attend_avx2<3>,
                                     attend_avx2<4>, attend_avx2<5>, attend_avx2<6>,
                                     attend_avx2<7>, attend_avx2<8>};

}  // namespace


namespace exact {

void paged_attention_into(const bf16_t* q, int64_t q_tok, int64_t q_head, int64_t H,
                          const bf16_t* kv, const KvLayer& layout, const PagedIndex& index,
                          float scale, bf16_t* out, const PackedLinear* next) {
  const int64_t HKV = layout.kv_heads, D = layout.head_dim;
  TORCH_CHECK(D % 16 == 0 && D <= 128 && H % HKV == 0,
              "head_dim must be a multiple of 16 up to 128, heads a multiple of kv heads");
  const int64_t tok_stride = HKV * D;
  Args a{q, q_tok, q_head, kv, kv + layout.slots() * tok_stride,
         layout.block_size * tok_stride, tok_stride, layout.block_size,
         index.tables, index.table_stride, index.token_seq, index.context_lens,
         H, HKV, D, scale, out};
  const int64_t G = H / HKV;
  if (get_isa() >= 3 && amx_attention_fits(layout, G)) {
    paged_attention_amx(q, q_tok, q_head, H, kv, layout, index, scale, out);
    return;
  }
  const AttendFn attend = (get_isa() >= 2 ? kAttendAvx512 : kAttendAvx2)[D / 16 - 1];
  std::vector<Run> runs;
  const int64_t run_tokens = std::max<int64_t>(1, kRunRows / G);
  for (int64_t t = 0, n; t < index.T; t += n) {
    int64_t L = index.context_lens[t];
    for (n = 1; n < run_tokens && t + n < index.T &&
                index.token_seq[t + n] == index.token_seq[t]; ++n)
      L = std::max<int64_t>(L, index.context_lens[t + n]);
    runs.push_back({t, n, L});
  }
  // Threads take tasks as they go (parallel_tasks), the last run first: in a causal
  // prefill later tokens see more keys, and the longest tasks first share out best.
  const int64_t n = (int64_t)runs.size() * HKV;
  parallel_tasks(n, [&](Tasks& tasks) {
    FlushDenormals guard;
    thread_local Scratch scratch;
    for (int64_t k; tasks.take(k);) {
      const int64_t task = n - 1 - k;
      if (task > 0) prefetch_run(a, runs[(task - 1) / HKV], (task - 1) % HKV);
      attend(a, runs[task / HKV], task % HKV, scratch);
    }
  }, [&](int64_t me) { return weights_share(next, index.T, me); });
}

}  // namespace exact

// q [T, H, D] bf16 (last dim contiguous); kv_layer [2, NBLK, BS, HKV, D] bf16 contiguous;
// block_tables [S, MB] int32; token_seq [T] int32 (row of block_tables); context_lens [T]
// int32 (keys each token sees, itself included). Returns [T, H, D] bf16.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 &&
              q.stride(2) == 1, "q must be CPU bfloat16 [T, H, D] with a contiguous last dim");
  const exact::KvLayer layout = exact::kv_layer_of(kv_layer);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(layout.head_dim == D, "q and the cache disagree on head_dim");
  const exact::PagedIndex index =
      exact::paged_index(block_tables, token_seq, context_lens, T, layout);
  at::Tensor out = at::empty({T, H, D}, q.options());
  exact::paged_attention_into(reinterpret_cast<const bf16_t*>(q.data_ptr()), q.stride(0),
                              q.stride(1), H, reinterpret_cast<const bf16_t*>(kv_layer.data_ptr()),
                              layout, index, (float)scale,
                              reinterpret_cast<bf16_t*>(out.data_ptr()));
  return out;
}
