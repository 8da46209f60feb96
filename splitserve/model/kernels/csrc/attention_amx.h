// Paged attention on AMX-BF16 tiles (attention.cpp dispatches it on the AMX level, for
// head_dim 32 or 64 and block sizes that are multiples of 16).
//
// A task is a tile of up to 16 query rows of one KV head: runs ("segments") of up to 16 / G
// consecutive tokens of one sequence times the G query heads, as many as fit (a decode
// step packs 16 / G sequences' tokens; a prefill 16 / G of its tokens). Per row, over keys
// 0 .. ctx-1 of its sequence:
//
//   s_l = (TDPBF16PS of k_l with q, head_dim in 32-wide steps from 0) * scale
//   m   = max_l s_l                                                        (exact)
//   p_l = bf16( exp(s_l - m) )                     (exact.cpp's polynomial; 0 past ctx)
//   Z   = sum of p_l (fp32), l = 0, 1, ... in order
//   o   = bf16( (TDPBF16PS over 32-key steps from key 0 of p with v) / Z )
//
// The scores are computed as S^T = K Q^T, per segment: 16 keys of a cache block are an A
// tile loaded straight from the cache (rows a token slot apart), the tile's queries,
// transposed into pairs once, the B tile; the segment's columns are kept. The softmax runs
// once for all 16 rows (lanes), then P V per segment (P as the A tile, its other rows'
// results discarded; V packed into key pairs, zero at and past the segment's context, so
// a slot past it, which may hold anything, is never multiplied). A sequence whose tokens
// fill several tiles (a prefill) has its V packed once, before the tiles, and each of its
// tiles reads the 32-key steps below its context from there (the step its context ends
// in, it packs itself): the same pairs, packed once instead of once a tile (prefill
// attention over 512 tokens, 30 layers: 28.7-30.3 -> 25.0-25.5 ms on a model-167 Xeon).
// A score depends only on its key's and its query's rows (a tile row's result never
// depends on the other rows, nor a column's on the other columns), and p is zero past a
// row's context: zero products leave a tile sum as it is, and all-zero key steps leave it
// too (measured on Xeons of family 6 models 207 and 167; tests/model/test_exact_amx.py
// checks tokens alone against batched). So a token's bits do not depend on which tokens
// share its tile, nor on the tile's length: batch-invariant as the fold is, with bits of
// its own (the "+amx" fingerprint).
#pragma once

#include <cstring>
#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "linear_amx.h"
#include "ops.h"

namespace exact {

struct AmxAttnScratch {
  std::vector<float> st;       // [Lp16][16]: scores, key-major (lane = tile row)
  std::vector<bf16_t> pt;      // [Lp32][16]: p, key-major
  std::vector<uint32_t> qt;    // [D/2][16]: the rows' query pairs, transposed
  std::vector<bf16_t> vp;      // [D/16][16 key pairs][16][2]: one 32-key step of V
  std::vector<bf16_t> pa;      // [Lp32 / 32][16][32]: p, row-major per 32-key step (A tiles)
};

// [32 keys][16 rows] -> [16 rows][32 keys] (bf16): key pairs into dwords (row r's pair i of
// p), then the dword transpose.
AMX_TARGET inline void rows_of_keys(const bf16_t* keys, bf16_t* rows) {
  alignas(64) uint16_t idx[32];
  for (int r = 0; r < 16; ++r) idx[2 * r] = r, idx[2 * r + 1] = 16 + r;
  const __m512i pair = _mm512_load_si512(idx);
  __m512i w[16], t[16];
  for (int i = 0; i < 16; ++i)
    w[i] = _mm512_permutexvar_epi16(pair, _mm512_loadu_si512(keys + 32 * i));
  transpose_16x16_epi32(w, t);
  for (int r = 0; r < 16; ++r) _mm512_storeu_si512(rows + 32 * r, t[r]);
}

// The rows' softmax numerators, 16 rows in the lanes, over keys 0 .. L-1 (key-major st,
// the raw scores): p[l] = bf16(exp(s_l - m)) with s_l = st[l] * scale, m the max over the
// lane's keys below its context (0 past it); zs = the sum of p in key order. Keys below
// `lo`, the shortest context of the tile's rows in use, are inside every such row's
// context and skip the masks (lanes of rows not in use get values nobody reads). Out of
// line: inside the tile kernel gcc kept m and the scale on the stack (a store and a load a
// key). The max runs in 4 chains (keys l = j mod 4), then their max: a max is exact in any
// order, and max(s, mx) keeps mx where s is NaN, so no chain ever holds a NaN (as the
// fold). A chain's latency bounded the pass (a VMAXPS a key); 4 fill the ports.
__attribute__((noinline)) AMX_TARGET inline void softmax_numerators(
    const float* st, int64_t L, int64_t lo, const int32_t* row_ctx, float scale, bf16_t* pt,
    float* zs) {
  const __m512i ctx_v = _mm512_loadu_si512(row_ctx);
  const __m512 sc_v = _mm512_set1_ps(scale);
  const auto score = [&](int64_t l) AMX_TARGET {
    return _mm512_mul_ps(_mm512_loadu_ps(st + l * 16), sc_v);
  };
  const auto keep = [&](__m512 mx, int64_t l) AMX_TARGET {  // the masked max at key l >= lo
    return _mm512_mask_max_ps(mx, _mm512_cmpgt_epi32_mask(ctx_v, _mm512_set1_epi32((int)l)),
                              score(l), mx);
  };
  __m512 m4[4];
  for (__m512& m : m4) m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 4 <= lo; i += 4)
    for (int j = 0; j < 4; ++j) m4[j] = _mm512_max_ps(score(i + j), m4[j]);
  for (; i < lo; ++i) m4[0] = _mm512_max_ps(score(i), m4[0]);
  for (; i + 4 <= L; i += 4)
    for (int j = 0; j < 4; ++j) m4[j] = keep(m4[j], i + j);
  for (; i < L; ++i) m4[0] = keep(m4[0], i);
  const __m512 mx = _mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3]));
  __m512 z = _mm512_setzero_ps();
  for (int64_t l = 0; l < lo; ++l) {
    const __m256i pb = f32x16_to_bf16(exp16(_mm512_sub_ps(score(l), mx)));
    _mm256_storeu_si256((__m256i*)(pt + l * 16), pb);
    z = _mm512_add_ps(z, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
  }
  for (int64_t l = lo; l < L; ++l) {
    const __mmask16 in = _mm512_cmpgt_epi32_mask(ctx_v, _mm512_set1_epi32((int)l));
    const __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(score(l), mx)));
    const __m256i pb = f32x16_to_bf16(e);
    _mm256_storeu_si256((__m256i*)(pt + l * 16), pb);
    z = _mm512_add_ps(z, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
  }
  _mm512_store_ps(zs, z);
}

// Fetches 16 rows of a cache half (one head's, `tok_stride` elements apart) into L1: a
// decode step reads the cache from DRAM, and TILELOADD streams it slower than prefetched
// lines.
template <int D>
inline void prefetch_16_rows(const bf16_t* rows, int64_t tok_stride) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t c = 0; c < D * (int64_t)sizeof(bf16_t); c += 64)
      _mm_prefetch((const char*)(rows + r * tok_stride) + c, _MM_HINT_T0);
}

// One P V step's B tiles: V's keys l0 .. l0 + 31 of one sequence and KV head (`half`: the
// cache's V half at the head) in key pairs, [D / 16 chunks][16 pairs][16][2]. A key at or
// past `ctx` is zero: p is zero there, and a slot past a context may hold anything, NaN too.
template <int D>
AMX_TARGET inline void pack_v_step(const bf16_t* half, const int32_t* table, int64_t blk_stride,
                                   int64_t tok_stride, int64_t block_size, int64_t l0,
                                   int64_t ctx, bf16_t* dst) {
  constexpr int kVc = D / 16;
  // (v[2p][16c + n], v[2p+1][16c + n]) for n < 16, from two 32-element halves of the rows
  alignas(64) uint16_t pairs[32];
  for (int n = 0; n < 16; ++n) pairs[2 * n] = n, pairs[2 * n + 1] = 32 + n;
  const __m512i lo_idx = _mm512_load_si512(pairs);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  const auto group = [&](int64_t l) {
    return half + table[l / block_size] * blk_stride + l % block_size * tok_stride;
  };
  const bf16_t* halves[2];  // the step's two 16-key groups; none past the context
  for (int j = 0; j < 2; ++j) {
    const int64_t l = l0 + 16 * j;
    halves[j] = l < ctx ? group(l) : nullptr;
    if (l + 32 < ctx) prefetch_16_rows<D>(group(l + 32), tok_stride);  // the next step
  }
  for (int64_t p = 0; p < 16; ++p) {  // key pair p = keys l0 + 2p, l0 + 2p + 1
    const int64_t key = l0 + 2 * p;
    const bf16_t* vr = key < ctx ? halves[p / 8] + (2 * p % 16) * tok_stride : nullptr;
    const bool second = key + 1 < ctx;
    for (int c = 0; c < kVc; c += 2) {
      const __m512i a = vr ? _mm512_loadu_si512(vr + 16 * c) : _mm512_setzero_si512();
      const __m512i b =
          second ? _mm512_loadu_si512(vr + tok_stride + 16 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + (c * 16 + p) * 32, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(dst + ((c + 1) * 16 + p) * 32,
                          _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// A tile's rows come from segments: runs of consecutive tokens of one sequence (decode
// packs up to 16 / G sequences of one token each, a prefill up to 16 / G of its tokens).
struct AmxSegment {
  int64_t t0, ntok;
};

// One tile: segment s holds rows r0_s .. r0_s + ntok_s * G - 1, row r0_s + i = (token t0_s
// + i / G, query head h * G + i % G). The scores and P V run per segment (each over its own
// sequence's keys, the other rows' results discarded), the softmax once over all 16 rows.
// k, v: the layer's cache halves at kv head 0; tok_stride = HKV * D.
template <int D>
AMX_TARGET void attend_tile_amx(const bf16_t* q, int64_t q_tok, int64_t q_head, const bf16_t* k,
                                const bf16_t* v, int64_t blk_stride, int64_t tok_stride,
                                int64_t block_size, const PagedIndex& index,
                                const AmxSegment* segs, const bf16_t* const* packs, int nsegs,
                                int64_t h, int64_t G,
                                int64_t H, float scale, bf16_t* out, AmxTiles& tiles,
                                AmxAttnScratch& sc) {
  static_assert(D == 32 || D == 64, "tiles for head_dim 32 or 64");
  constexpr int kDc = D / 32;  // 32-wide steps of head_dim (A tiles of K per block)
  constexpr int kVc = D / 16;  // 16-wide output chunks (C tiles of o)
  int32_t row_ctx[16] = {0};
  int64_t row0[17];  // segment s's rows: row0[s] .. row0[s + 1] - 1
  int64_t L = 0;
  row0[0] = 0;
  for (int s = 0; s < nsegs; ++s) {
    row0[s + 1] = row0[s] + segs[s].ntok * G;
    for (int64_t r = row0[s]; r < row0[s + 1]; ++r) {
      row_ctx[r] = index.context_lens[segs[s].t0 + (r - row0[s]) / G];
      L = std::max<int64_t>(L, row_ctx[r]);
    }
  }
  const int64_t nrows = row0[nsegs], L32 = (L + 31) / 32 * 32;
  tiles.configure(16);

  // Q^T as B tiles: qt[p][r] = pair p of row r's query (zero for rows past nrows).
  sc.qt.resize(D / 2 * 16);
  for (int c = 0; c < D / 32; ++c) {  // pairs 16c .. 16c + 15
    __m512i rows[16], cols[16];
    for (int r = 0; r < 16; ++r) rows[r] = _mm512_setzero_si512();
    for (int s = 0; s < nsegs; ++s)
      for (int64_t r = row0[s]; r < row0[s + 1]; ++r) {
        const int64_t i = r - row0[s];
        rows[r] = _mm512_loadu_si512(q + (segs[s].t0 + i / G) * q_tok + (h * G + i % G) * q_head +
                                     32 * c);
      }
    transpose_16x16_epi32(rows, cols);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(sc.qt.data() + (16 * c + p) * 16, cols[p]);
  }

  // Head h's rows of the 16 keys from l of a segment's sequence (block_size is a multiple
  // of 16: one block's).
  const auto group = [&](const int32_t* table, const bf16_t* half, int64_t l) {
    return half + table[l / block_size] * blk_stride + l % block_size * tok_stride + h * D;
  };
  const auto table_of = [&](const AmxSegment& seg) {
    return index.tables + index.token_seq[seg.t0] * index.table_stride;
  };
  // The segment's longest context (its last token's).
  const auto seg_len = [&](const AmxSegment& seg) {
    return (int64_t)index.context_lens[seg.t0 + seg.ntok - 1];
  };

  // S^T, 16 keys (one tile of a cache block) at a time, per segment; a segment's lanes of
  // the tile go to st (one segment: the whole tile, stored in place).
  sc.st.resize((L + 15) / 16 * 16 * 16);
  alignas(64) float tmp[16 * 16];
  for (int s = 0; s < nsegs; ++s) {
    const int32_t* table = table_of(segs[s]);
    const int64_t L16 = (seg_len(segs[s]) + 15) / 16 * 16;
    const __mmask16 lanes = (__mmask16)(((1u << row0[s + 1]) - 1) & ~((1u << row0[s]) - 1));
    _tile_loadd(5, sc.qt.data(), 64);  // Q^T stays in tiles 5 (and 6) for every key tile
    if constexpr (kDc > 1) _tile_loadd(6, sc.qt.data() + 16 * 16, 64);
    for (int64_t l0 = 0; l0 < L16; l0 += 16) {
      const bf16_t* kb = group(table, k, l0);
      if (l0 + 32 < L16)  // 2 tiles ahead
        prefetch_16_rows<D>(group(table, k, l0 + 32), tok_stride);
      _tile_zero(0);
      _tile_loadd(4, kb, tok_stride * (int64_t)sizeof(bf16_t));
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (kDc > 1) {
        _tile_loadd(7, kb + 32, tok_stride * (int64_t)sizeof(bf16_t));
        _tile_dpbf16ps(0, 7, 6);
      }
      if (nsegs == 1) {
        _tile_stored(0, sc.st.data() + l0 * 16, 64);
        continue;
      }
      _tile_stored(0, tmp, 64);
      for (int64_t i = 0; i < 16; ++i)
        _mm512_mask_storeu_ps(sc.st.data() + (l0 + i) * 16, lanes, _mm512_load_ps(tmp + i * 16));
    }
  }

  // Softmax numerators, 16 rows in the lanes (a lane's keys past its context, and scores
  // past its segment's, are masked).
  sc.pt.resize(L32 * 16);  // keys below L are all written; the last step's tail is zero
  std::fill(sc.pt.begin() + L * 16, sc.pt.end(), bf16_t(0));
  int64_t lo = L;
  for (int64_t r = 0; r < nrows; ++r) lo = std::min<int64_t>(lo, row_ctx[r]);
  alignas(64) float zs[16];
  softmax_numerators(sc.st.data(), L, lo, row_ctx, scale, sc.pt.data(), zs);
  sc.pa.resize(L32 * 16);
  for (int64_t l0 = 0; l0 < L32; l0 += 32)
    rows_of_keys(sc.pt.data() + l0 * 16, sc.pa.data() + l0 * 16);

  // o = P V per segment, 32 keys at a time: P as the A tile (rows x 32 keys; the segment's
  // rows, the others' products discarded), V packed in key pairs (pack_v_step), by the tile
  // or, for a step below the segment's context, read from its sequence's packs (a
  // prefill's: paged_attention_amx packs those once for all of its tiles).
  sc.vp.resize(kVc * 16 * 32);
  const int64_t step_elems = (int64_t)D * 32, HKV = tok_stride / D;
  alignas(64) float o[4 * 16 * 16];
  for (int s = 0; s < nsegs; ++s) {
    const int32_t* table = table_of(segs[s]);
    const int64_t Ls = seg_len(segs[s]);
    _tile_zero(0);  // o's 16-wide chunks: C tiles 0 .. kVc-1
    _tile_zero(1);
    if constexpr (kVc > 2) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t l0 = 0; l0 < Ls; l0 += 32) {
      const bf16_t* vb = sc.vp.data();
      if (packs[s] != nullptr && l0 + 32 <= Ls)
        vb = packs[s] + (l0 / 32 * HKV + h) * step_elems;
      else
        pack_v_step<D>(v + h * D, table, blk_stride, tok_stride, block_size, l0, Ls, sc.vp.data());
      _tile_loadd(4, sc.pa.data() + l0 * 16, 64);
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, vb + 16 * 32, 64);
      _tile_dpbf16ps(1, 4, 6);
      if constexpr (kVc > 2) {
        _tile_loadd(5, vb + 2 * 16 * 32, 64);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, vb + 3 * 16 * 32, 64);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, o, 64);
    _tile_stored(1, o + 256, 64);
    if constexpr (kVc > 2) {
      _tile_stored(2, o + 512, 64);
      _tile_stored(3, o + 768, 64);
    }
    for (int64_t r = row0[s]; r < row0[s + 1]; ++r) {
      const int64_t i = r - row0[s];
      const __m512 zr = _mm512_set1_ps(zs[r]);
      bf16_t* dst = out + ((segs[s].t0 + i / G) * H + h * G + i % G) * D;
      for (int c = 0; c < kVc; ++c)
        _mm256_storeu_si256(
            (__m256i*)(dst + 16 * c),
            f32x16_to_bf16(_mm512_div_ps(_mm512_loadu_ps(o + c * 256 + r * 16), zr)));
    }
  }
}

// Whether the tiles take a layer of this shape (else the fold's kernels do).
inline bool amx_attention_fits(const KvLayer& layout, int64_t G) {
  return (layout.head_dim == 32 || layout.head_dim == 64) && layout.block_size % 16 == 0 &&
         G <= 16;
}

// paged_attention_into's AMX path: one task per tile and KV head; a tile packs runs of up
// to 16 / G consecutive tokens of one sequence, as many as its 16 rows hold, the last tokens
// (the most keys) first.
inline void paged_attention_amx(const bf16_t* q, int64_t q_tok, int64_t q_head, int64_t H,
                                const bf16_t* kv, const KvLayer& layout,
                                const PagedIndex& index, float scale, bf16_t* out) {
  const int64_t HKV = layout.kv_heads, G = H / HKV, tok_stride = HKV * layout.head_dim;
  const bf16_t* v = kv + layout.slots() * tok_stride;
  std::vector<AmxSegment> segs;
  std::vector<std::pair<int64_t, int64_t>> tiles_of;  // (first segment, segments)
  for (int64_t t = 0, n, rows = 16; t < index.T; t += n) {
    for (n = 1; n < 16 / G && t + n < index.T && index.token_seq[t + n] == index.token_seq[t];)
      ++n;
    if (rows + n * G > 16) tiles_of.emplace_back((int64_t)segs.size(), 0), rows = 0;
    segs.push_back({t, n});
    ++tiles_of.back().second;
    rows += n * G;
  }
  // A sequence whose tokens fill more than one tile (a prefill) has V packed once per KV
  // head and 32-key step, up to its last token's context, for all of its tiles.
  const int64_t D = layout.head_dim, step_elems = D * 32;
  struct PackJob {
    const int32_t* table;
    int64_t ctx, first_task, offset;  // its tasks: one a step and head; its packs in buf
    size_t seg0, seg1;                // its sequence's segments
  };
  std::vector<PackJob> jobs;
  int64_t pack_tasks = 0, pack_elems = 0;
  for (size_t i = 0, j; i < segs.size(); i = j) {
    const int32_t seq = index.token_seq[segs[i].t0];
    int64_t ntok = 0;
    for (j = i; j < segs.size() && index.token_seq[segs[j].t0] == seq; ++j) ntok += segs[j].ntok;
    if (ntok <= 16 / G) continue;
    const int64_t ctx = index.context_lens[segs[j - 1].t0 + segs[j - 1].ntok - 1];
    jobs.push_back({index.tables + seq * index.table_stride, ctx, pack_tasks, pack_elems, i, j});
    pack_tasks += (ctx + 31) / 32 * HKV;
    pack_elems += (ctx + 31) / 32 * HKV * step_elems;  // [steps][HKV][step_elems]
  }
  thread_local std::vector<bf16_t> buf;  // this thread's (tasks run on others: use `base`)
  buf.resize(pack_elems);
  bf16_t* const base = buf.data();
  std::vector<const bf16_t*> packs(segs.size(), nullptr);
  for (const PackJob& job : jobs)
    for (size_t m = job.seg0; m < job.seg1; ++m) packs[m] = base + job.offset;
  const auto pack = D == 32 ? pack_v_step<32> : pack_v_step<64>;
  parallel_tasks(pack_tasks, [&](Tasks& tasks) {
    for (int64_t k; tasks.take(k);) {
      const PackJob& job = *(std::upper_bound(jobs.begin(), jobs.end(), k, [](int64_t t,
          const PackJob& b) { return t < b.first_task; }) - 1);
      const int64_t local = k - job.first_task, step = local / HKV, h = local % HKV;
      pack(v + h * D, job.table, layout.block_size * tok_stride, tok_stride, layout.block_size,
           32 * step, job.ctx, base + job.offset + local * step_elems);
    }
  });

  const int64_t n = (int64_t)tiles_of.size() * HKV;
  const auto tile = layout.head_dim == 32 ? attend_tile_amx<32> : attend_tile_amx<64>;
  parallel_tasks(n, [&](Tasks& tasks) {
    FlushDenormals guard;
    AmxTiles tiles;
    thread_local AmxAttnScratch scratch;
    for (int64_t k; tasks.take(k);) {
      const int64_t task = n - 1 - k, h = task % HKV;
      const auto [first, count] = tiles_of[task / HKV];
      tile(q, q_tok, q_head, kv, v, layout.block_size * tok_stride, tok_stride,
           layout.block_size, index, segs.data() + first, packs.data() + first, (int)count, h,
           G, H, scale, out, tiles, scratch);
    }
  });
}

}  // namespace exact
