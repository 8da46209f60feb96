// The parts of paged attention's AVX-512 and AVX2 paths (attention_avx512.h,
// attention_avx2.h) that both share: a call's arguments, a task's run of tokens, its
// scratch buffers, and the prefetches of the cache rows it reads. attention.cpp has the
// contract and dispatches; only it includes these headers.
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"
#include "ops.h"

namespace exact::attn {

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

}  // namespace exact::attn
