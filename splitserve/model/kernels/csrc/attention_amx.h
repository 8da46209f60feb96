// Paged attention on AMX-BF16 tiles (attention.cpp dispatches it on the AMX level, for
// head_dim 32 or 64 and block sizes that are multiples of 16).
//
// A task is a tile of up to 16 query rows: up to 16 / G consecutive tokens of one sequence
// times the G query heads of one KV head. Per row, over keys 0 .. ctx-1 of its sequence:
//
//   s_l = (TDPBF16PS of k_l with q, head_dim in 32-wide steps from 0) * scale
//   m   = max_l s_l                                                        (exact)
//   p_l = bf16( exp(s_l - m) )                     (exact.cpp's polynomial; 0 past ctx)
//   Z   = sum of p_l (fp32), l = 0, 1, ... in order
//   o   = bf16( (TDPBF16PS over 32-key steps from key 0 of p with v) / Z )
//
// The scores are computed as S^T = K Q^T: 16 keys of a cache block are an A tile loaded
// straight from the cache (rows a token slot apart), the tile's queries, transposed into
// pairs once, the B tile. A score depends only on its key's and its query's rows (a tile
// row's result never depends on the other rows, nor a column's on the other columns), and
// p is zero past a row's context: zero products leave a tile sum as it is whatever the
// value they multiply, and all-zero key steps leave it too (measured on a Xeon of family 6
// model 207; tests/model/test_exact_amx.py checks tokens alone against batched). So a token's bits
// do not depend on which tokens share its tile, nor on the tile's length: batch-invariant
// as the fold is, with bits of its own (the "+amx" fingerprint).
#pragma once

#include <cstring>
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
};

// Fetches 16 rows of a cache half (one head's, `tok_stride` elements apart) into L1: a
// decode step reads the cache from DRAM, and TILELOADD streams it slower than prefetched
// lines.
template <int D>
inline void prefetch_16_rows(const bf16_t* rows, int64_t tok_stride) {
  for (int64_t r = 0; r < 16; ++r)
    for (int64_t c = 0; c < D * (int64_t)sizeof(bf16_t); c += 64)
      _mm_prefetch((const char*)(rows + r * tok_stride) + c, _MM_HINT_T0);
}

// One tile: rows r = (token t0 + r / G, query head h * G + r % G), nrows = ntok * G.
// k, v: the layer's cache halves at kv head 0; tok_stride = HKV * D; ctx per token.
template <int D>
AMX_TARGET void attend_tile_amx(const bf16_t* q, int64_t q_tok, int64_t q_head, const bf16_t* k,
                                const bf16_t* v, int64_t blk_stride, int64_t tok_stride,
                                int64_t block_size, const int32_t* table, const int32_t* ctx,
                                int64_t t0, int64_t ntok, int64_t h, int64_t G, int64_t H,
                                float scale, bf16_t* out, AmxTiles& tiles, AmxAttnScratch& sc) {
  static_assert(D == 32 || D == 64, "tiles for head_dim 32 or 64");
  constexpr int kDc = D / 32;  // 32-wide steps of head_dim (A tiles of K per block)
  constexpr int kVc = D / 16;  // 16-wide output chunks (C tiles of o)
  const int64_t nrows = ntok * G;
  int32_t row_ctx[16];
  int64_t L = 0;
  for (int64_t r = 0; r < 16; ++r) {
    row_ctx[r] = r < nrows ? ctx[t0 + r / G] : 0;
    L = std::max<int64_t>(L, row_ctx[r]);
  }
  const int64_t L16 = (L + 15) / 16 * 16, L32 = (L + 31) / 32 * 32;
  tiles.configure(16);

  // Q^T as B tiles: qt[p][r] = pair p of row r's query (zero for rows past nrows).
  sc.qt.assign(D / 2 * 16, 0u);
  for (int64_t r = 0; r < nrows; ++r) {
    const bf16_t* qr = q + (t0 + r / G) * q_tok + (h * G + r % G) * q_head;
    for (int64_t p = 0; p < D / 2; ++p) {
      uint32_t w;
      std::memcpy(&w, qr + 2 * p, sizeof(w));
      sc.qt[p * 16 + r] = w;
    }
  }

  // S^T, 16 keys (one tile of a cache block) at a time.
  // Head h's rows of the 16 keys from l (block_size is a multiple of 16: one block's).
  const auto group = [&](const bf16_t* half, int64_t l) {
    return half + table[l / block_size] * blk_stride + l % block_size * tok_stride + h * D;
  };
  sc.st.resize(L16 * 16);
  for (int64_t l0 = 0; l0 < L16; l0 += 16) {
    const bf16_t* kb = group(k, l0);
    if (l0 + 32 < L16) prefetch_16_rows<D>(group(k, l0 + 32), tok_stride);  // 2 tiles ahead
    _tile_zero(0);
    for (int c = 0; c < kDc; ++c) {
      _tile_loadd(4, kb + 32 * c, tok_stride * (int64_t)sizeof(bf16_t));
      _tile_loadd(5, sc.qt.data() + c * 16 * 16, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, sc.st.data() + l0 * 16, 64);
  }

  // Softmax numerators, 16 rows in the lanes.
  const __m512i ctx_v = _mm512_loadu_si512(row_ctx);
  const __m512 sc_v = _mm512_set1_ps(scale);
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l = 0; l < L; ++l) {
    const __mmask16 in = _mm512_cmpgt_epi32_mask(ctx_v, _mm512_set1_epi32((int)l));
    const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sc.st.data() + l * 16), sc_v);
    _mm512_storeu_ps(sc.st.data() + l * 16, s);
    mx = _mm512_mask_max_ps(mx, in, s, mx);  // keeps mx where s is NaN, as the fold does
  }
  sc.pt.assign(L32 * 16, 0);
  __m512 z = _mm512_setzero_ps();
  for (int64_t l = 0; l < L; ++l) {
    const __mmask16 in = _mm512_cmpgt_epi32_mask(ctx_v, _mm512_set1_epi32((int)l));
    const __m512 e = _mm512_maskz_mov_ps(
        in, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc.st.data() + l * 16), mx)));
    const __m256i pb = f32x16_to_bf16(e);
    _mm256_storeu_si256((__m256i*)(sc.pt.data() + l * 16), pb);
    z = _mm512_add_ps(z, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
  }

  // o = P V, 32 keys at a time: P as the A tile (rows x 32 keys), V packed in key pairs.
  alignas(64) bf16_t pa[16 * 32];
  sc.vp.resize(kVc * 16 * 32);
  const int64_t blocks = (L + block_size - 1) / block_size;
  _tile_zero(0);  // o's 16-wide chunks: C tiles 0 .. kVc-1
  _tile_zero(1);
  if constexpr (kVc > 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  std::memset(pa, 0, sizeof(pa));  // rows past nrows stay zero
  // (v[2p][16c + n], v[2p+1][16c + n]) for n < 16, from two 32-element halves of the rows
  alignas(64) uint16_t pairs[32];
  for (int n = 0; n < 16; ++n) pairs[2 * n] = n, pairs[2 * n + 1] = 32 + n;
  const __m512i lo_idx = _mm512_load_si512(pairs);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t l0 = 0; l0 < L32; l0 += 32) {
    const bf16_t* halves[2];  // the step's two 16-key groups; none past the last block
    for (int j = 0; j < 2; ++j) {
      const int64_t l = l0 + 16 * j;
      halves[j] = l / block_size < blocks ? group(v, l) : nullptr;
      if (l + 32 < L) prefetch_16_rows<D>(group(v, l + 32), tok_stride);  // the next step
    }
    for (int64_t r = 0; r < nrows; ++r)
      for (int64_t j = 0; j < 32; ++j) pa[r * 32 + j] = sc.pt[(l0 + j) * 16 + r];
    for (int64_t p = 0; p < 16; ++p) {
      const bf16_t* g = halves[p / 8];
      const bf16_t* row0 = g ? g + (2 * p % 16) * tok_stride : nullptr;
      for (int c = 0; c < kVc; c += 2) {
        const __m512i a = row0 ? _mm512_loadu_si512(row0 + 16 * c) : _mm512_setzero_si512();
        const __m512i b =
            row0 ? _mm512_loadu_si512(row0 + tok_stride + 16 * c) : _mm512_setzero_si512();
        _mm512_storeu_si512(sc.vp.data() + (c * 16 + p) * 32,
                            _mm512_permutex2var_epi16(a, lo_idx, b));
        _mm512_storeu_si512(sc.vp.data() + ((c + 1) * 16 + p) * 32,
                            _mm512_permutex2var_epi16(a, hi_idx, b));
      }
    }
    _tile_loadd(4, pa, 64);
    _tile_loadd(5, sc.vp.data(), 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, sc.vp.data() + 16 * 32, 64);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (kVc > 2) {
      _tile_loadd(5, sc.vp.data() + 2 * 16 * 32, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, sc.vp.data() + 3 * 16 * 32, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float o[4 * 16 * 16];
  _tile_stored(0, o, 64);
  _tile_stored(1, o + 256, 64);
  if constexpr (kVc > 2) {
    _tile_stored(2, o + 512, 64);
    _tile_stored(3, o + 768, 64);
  }
  alignas(64) float zs[16];
  _mm512_store_ps(zs, z);
  for (int64_t r = 0; r < nrows; ++r) {
    const __m512 zr = _mm512_set1_ps(zs[r]);
    bf16_t* dst = out + ((t0 + r / G) * H + h * G + r % G) * D;
    for (int c = 0; c < kVc; ++c)
      _mm256_storeu_si256((__m256i*)(dst + 16 * c),
                          f32x16_to_bf16(_mm512_div_ps(_mm512_loadu_ps(o + c * 256 + r * 16), zr)));
  }
}

// Whether the tiles take a layer of this shape (else the fold's kernels do).
inline bool amx_attention_fits(const KvLayer& layout, int64_t G) {
  return (layout.head_dim == 32 || layout.head_dim == 64) && layout.block_size % 16 == 0 &&
         G <= 16;
}

// paged_attention_into's AMX path: one task per tile of up to 16 / G consecutive tokens of
// one sequence and one KV head, the last tokens (the most keys) first.
inline void paged_attention_amx(const bf16_t* q, int64_t q_tok, int64_t q_head, int64_t H,
                                const bf16_t* kv, const KvLayer& layout,
                                const PagedIndex& index, float scale, bf16_t* out) {
  const int64_t HKV = layout.kv_heads, G = H / HKV, tok_stride = HKV * layout.head_dim;
  const bf16_t* v = kv + layout.slots() * tok_stride;
  std::vector<std::pair<int64_t, int64_t>> spans;  // (first token, tokens)
  for (int64_t t = 0, n; t < index.T; t += n) {
    for (n = 1; n < 16 / G && t + n < index.T && index.token_seq[t + n] == index.token_seq[t];)
      ++n;
    spans.emplace_back(t, n);
  }
  const int64_t n = (int64_t)spans.size() * HKV;
  const auto tile = layout.head_dim == 32 ? attend_tile_amx<32> : attend_tile_amx<64>;
  parallel_tasks(n, [&](Tasks& tasks) {
    FlushDenormals guard;
    AmxTiles tiles;
    thread_local AmxAttnScratch scratch;
    for (int64_t k; tasks.take(k);) {
      const int64_t task = n - 1 - k, h = task % HKV;
      const auto [t0, ntok] = spans[task / HKV];
      tile(q, q_tok, q_head, kv, v, layout.block_size * tok_stride, tok_stride,
           layout.block_size, index.tables + index.token_seq[t0] * index.table_stride,
           index.context_lens, t0, ntok, h, G, H, scale, out, tiles, scratch);
    }
  });
}

}  // namespace exact
