// Batch-invariant paged attention (see exact.cpp for the contract and the two ISA paths;
// on AMX-BF16 CPUs, attention_amx.h's tiles, with bits of their own).
//
// Every query token attends to keys 0 .. context_len-1 of its own sequence, read in
// position order through its block table, so the bits depend on neither the physical
// blocks, the other tokens of the step, a prefill chunk's size nor a decode batch:
//
//   s_l  = tree16( pairwise-FMA dot(q, k_l) over head_dim ) * scale     (exact.cpp's order)
//   m    = max_l s_l                                                     (exact)
//   e_l  = exp(s_l - m)                                   (one polynomial, FMAs in order)
//   Z    = tree16( 16 lanes, lane i summing e_l for l = i, i+16, ... in order )
//   o    = ( sum over l = 0, 1, ... of e_l * v_l, one FMA per key ) / Z  -> bf16
#include <torch/extension.h>
#include <ATen/Parallel.h>

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

// Cache offset of each of the token's keys, in position order (no division per key).
inline void key_offsets(const Args& a, int64_t t, int64_t h, std::vector<int64_t>& off) {
  const int32_t* table = a.tables + a.token_seq[t] * a.table_stride;
  const int64_t L = a.ctx[t];
  off.resize(L);
  for (int64_t l0 = 0, b = 0; l0 < L; l0 += a.block_size, ++b) {
    const int64_t base = table[b] * a.blk_stride + h * a.D;
    const int64_t n = std::min(a.block_size, L - l0);
    for (int64_t o = 0; o < n; ++o) off[l0 + o] = base + o * a.tok_stride;
  }
}

struct Scratch {
  std::vector<float> scores;  // [G][Lp]
  std::vector<int64_t> offsets;  // [L]
  std::vector<float> z;  // [2G]: softmax denominators, then row maxima
  std::vector<float> q;  // [G][head_dim]: the AVX2 path's query pairs as fp32
};

// Heads g0 .. g0+NQ-1 of one (token, kv head): o = (sum over l in order of e_l * v_l) / Z.
template <int DC, int NQ>
AVX512_TARGET void weigh_values(const Args& a, int64_t t, int64_t h, int64_t g0,
                                const float* e, int64_t Lp, const int64_t* off, int64_t L,
                                const float* z) {
  const int64_t G = a.H / a.HKV;
  __m512 acc[NQ][DC];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < DC; ++c) acc[q][c] = _mm512_setzero_ps();
  const float* e0 = e + g0 * Lp;
  for (int64_t l = 0; l < L; ++l) {
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = bf16x16_to_f32(a.v + off[l] + 16 * c);
    for (int q = 0; q < NQ; ++q) {
      const __m512 p = _mm512_set1_ps(e0[q * Lp + l]);
      for (int c = 0; c < DC; ++c) acc[q][c] = _mm512_fmadd_ps(p, v[c], acc[q][c]);
    }
  }
  for (int q = 0; q < NQ; ++q) {
    const __m512 zq = _mm512_set1_ps(z[g0 + q]);
    bf16_t* o = a.out + (t * a.H + h * G + g0 + q) * DC * 16;
    for (int c = 0; c < DC; ++c)
      _mm256_storeu_si256((__m256i*)(o + 16 * c), f32x16_to_bf16(_mm512_div_ps(acc[q][c], zq)));
  }
}

// ---- one (token, kv head): G query heads over the token's context ----------------------
template <int DC>  // head_dim / 16
AVX512_TARGET void attend_avx512(const Args& a, int64_t t, int64_t h, Scratch& sc) {
  constexpr int64_t D = DC * 16;
  const int64_t G = a.H / a.HKV, L = a.ctx[t], Lp = (L + 15) / 16 * 16;
  key_offsets(a, t, h, sc.offsets);
  const int64_t* off = sc.offsets.data();
  sc.scores.assign(G * Lp, 0.f);
  float* buf = sc.scores.data();
  const bf16_t* q0 = a.q + t * a.q_tok + h * G * a.q_head;
  constexpr int QC = (DC + 1) / 2;  // 32-wide chunks of head_dim; a 16-wide tail reads zeros
  auto mask = [](int c) { return 32 * (c + 1) <= D ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xFFFFu; };
  const __m512 scale = _mm512_set1_ps(a.scale);
  sc.z.resize(2 * G);
  float* z = sc.z.data();
  float* row_max = z + G;
  for (int64_t g = 0; g < G; ++g) {
    const bf16_t* q = q0 + g * a.q_head;
    // Running max of the head's scores: max(s, m) keeps m when s is NaN, as the AVX2
    // path's scalar `s > m ? s : m` does; a max is exact in any order.
    __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512bh qc[QC];
    for (int c = 0; c < QC; ++c) qc[c] = (__m512bh)_mm512_maskz_loadu_epi16(mask(c), q + 32 * c);
    for (int64_t l0 = 0; l0 < L; l0 += 16) {
      const int64_t n = std::min<int64_t>(16, L - l0);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        acc[j] = _mm512_setzero_ps();
        if (j >= n) continue;
        const bf16_t* k = a.k + off[l0 + j];
        for (int c = 0; c < QC; ++c)
          acc[j] = _mm512_dpbf16_ps(acc[j], qc[c],
                                    (__m512bh)_mm512_maskz_loadu_epi16(mask(c), k + 32 * c));
      }
      const __mmask16 valid = (__mmask16)((1u << n) - 1);
      const __m512 sv = _mm512_mul_ps(tree16x16(acc), scale);
      _mm512_mask_storeu_ps(buf + g * Lp + l0, valid, sv);
      mx = _mm512_mask_max_ps(mx, valid, sv, mx);
    }
    row_max[g] = _mm512_reduce_max_ps(mx);
  }
  // softmax numerators in place, one Z per head
  for (int64_t g = 0; g < G; ++g) {
    float* s = buf + g * Lp;
    const float m = row_max[g];
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < Lp; l += 16) {
      const __mmask16 valid = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l),
                                                                       _mm512_set1_ps(m))));
      _mm512_storeu_ps(s + l, e);
      sum = _mm512_add_ps(sum, e);
    }
    z[g] = tree16(sum);
  }
  // o = sum_l e_l v_l / Z: up to 4 heads at once, so each V row is converted once and the
  // heads' FMA chains overlap (every head still adds its keys in position order).
  constexpr int64_t kHeads = DC <= 4 ? 4 : 2;
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const int64_t nq = std::min<int64_t>(kHeads, G - g0);
    if (nq == kHeads) weigh_values<DC, kHeads>(a, t, h, g0, buf, Lp, off, L, z);
    else if (nq == 3) weigh_values<DC, 3>(a, t, h, g0, buf, Lp, off, L, z);
    else if (nq == 2) weigh_values<DC, 2>(a, t, h, g0, buf, Lp, off, L, z);
    else weigh_values<DC, 1>(a, t, h, g0, buf, Lp, off, L, z);
  }
}

// ---- AVX2 + FMA: the same arithmetic as attend_avx512, 8 lanes at a time ---------------
// Scores of heads g0 .. g0+NQ-1 (their query pairs as fp32 in qf: per head and 16-element
// chunk s, [odd elements (8)][even elements (8)]) over all L keys; each key's K row is
// converted once for the NQ heads. Fills buf (row stride Lp) and row_max.
// The AVX2 path prefetches each key's K row (to L1) and V row (to L2, for weigh_values)
// this many keys ahead: the rows are gathered through the block table, one head's 2-4 lines
// every HKV * D elements, and a decode step reads them once from DRAM. Measured on a Zen 1
// (one token, 192 keys, each layer's cache cold): 34 -> 25 us a call; 4-16 keys ahead alike.
constexpr int64_t kKeysAhead = 8;

inline void prefetch_row(const bf16_t* row, int64_t D, int hint) {
  for (int64_t b = 0; b < D * 2; b += 64) {
    if (hint == 0) _mm_prefetch((const char*)row + b, _MM_HINT_T0);
    else _mm_prefetch((const char*)row + b, _MM_HINT_T1);
  }
}

template <int S, int NQ>
AVX2_TARGET void score_keys_avx2(const Args& a, const float* qf, const int64_t* off, int64_t L,
                                 float* buf, int64_t Lp, float* row_max) {
  const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  const __m256 scale = _mm256_set1_ps(a.scale);
  __m256 mx[NQ];
  for (int q = 0; q < NQ; ++q) mx[q] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t l0 = 0; l0 < L; l0 += 8) {
    const int n = (int)std::min<int64_t>(8, L - l0);
    __m256 sums[NQ][8];  // per head and key: lanes lo + hi, tree16's first level
    for (int j = 0; j < n; ++j) {
      const bf16_t* k = a.k + off[l0 + j];
      if (l0 + j + kKeysAhead < L) {
        prefetch_row(a.k + off[l0 + j + kKeysAhead], a.D, 0);
        prefetch_row(a.v + off[l0 + j + kKeysAhead], a.D, 1);
      }
      __m256 lo[NQ], hi[NQ];
      for (int q = 0; q < NQ; ++q) lo[q] = hi[q] = _mm256_setzero_ps();
      for (int s = 0; s < S; ++s) {
        const __m256i kw = _mm256_loadu_si256((const __m256i*)(k + 16 * s));
        const __m256 ko = _mm256_castsi256_ps(_mm256_and_si256(kw, odd_mask));
        const __m256 ke = _mm256_castsi256_ps(_mm256_slli_epi32(kw, 16));
        for (int q = 0; q < NQ; ++q) {
          __m256& lane = s % 2 ? hi[q] : lo[q];
          const float* qs = qf + (q * S + s) * 16;
          lane = _mm256_fmadd_ps(_mm256_loadu_ps(qs), ko, lane);
          lane = _mm256_fmadd_ps(_mm256_loadu_ps(qs + 8), ke, lane);
        }
      }
      for (int q = 0; q < NQ; ++q) sums[q][j] = _mm256_add_ps(lo[q], hi[q]);
    }
    for (int q = 0; q < NQ; ++q)
      for (int j = n; j < 8; ++j) sums[q][j] = _mm256_setzero_ps();
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
        _mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    for (int q = 0; q < NQ; ++q) {
      const __m256 sv = _mm256_mul_ps(tree16x8(sums[q]), scale);
      float* row = buf + q * Lp + l0;
      if (n == 8) {
        _mm256_storeu_ps(row, sv);
      } else {
        alignas(32) float part[8];
        _mm256_store_ps(part, sv);
        for (int j = 0; j < n; ++j) row[j] = part[j];
      }
      // max(s, m) keeps m when s is NaN; a max is exact in any order
      mx[q] = _mm256_max_ps(_mm256_blendv_ps(mx[q], sv, keep), mx[q]);
    }
  }
  for (int q = 0; q < NQ; ++q) row_max[q] = max8(mx[q]);
}

// Heads g0 .. g0+NQ-1, head_dim elements 16*p0 .. 16*(p0+NP)-1: o = (sum over l in order of
// e_l * v_l) / Z. A 16-element V piece is widened by two unpacks, which leave its columns
// as [0-3, 8-11] and [4-7, 12-15]; the accumulators keep that order until the store.
template <int NQ, int NP>
AVX2_TARGET void weigh_values_avx2(const Args& a, int64_t t, int64_t h, int64_t g0, int64_t p0,
                                   const float* e, int64_t Lp, const int64_t* off, int64_t L,
                                   const float* z) {
  const int64_t G = a.H / a.HKV;
  __m256 acc[NQ][2 * NP];
  #pragma GCC unroll 16
  for (int q = 0; q < NQ; ++q)
    #pragma GCC unroll 16
    for (int c = 0; c < 2 * NP; ++c) acc[q][c] = _mm256_setzero_ps();
  const float* e0 = e + g0 * Lp;
  const bf16_t* v0 = a.v + 16 * p0;
  for (int64_t l = 0; l < L; ++l) {
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {  // one piece at a time: 12 accumulators + 3 registers
      const __m256i w = _mm256_loadu_si256((const __m256i*)(v0 + off[l] + 16 * p));
      const __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), w));
      const __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), w));
      #pragma GCC unroll 16
      for (int q = 0; q < NQ; ++q) {
        const __m256 pq = _mm256_broadcast_ss(e0 + q * Lp + l);
        acc[q][2 * p] = _mm256_fmadd_ps(pq, lo, acc[q][2 * p]);
        acc[q][2 * p + 1] = _mm256_fmadd_ps(pq, hi, acc[q][2 * p + 1]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int q = 0; q < NQ; ++q) {
    const __m256 zq = _mm256_set1_ps(z[g0 + q]);
    bf16_t* o = a.out + (t * a.H + h * G + g0 + q) * a.D + 16 * p0;
    #pragma GCC unroll 16
    for (int p = 0; p < NP; ++p) {
      const __m256 x = _mm256_div_ps(acc[q][2 * p], zq), y = _mm256_div_ps(acc[q][2 * p + 1], zq);
      _mm_storeu_si128((__m128i*)(o + 16 * p), f32x8_to_bf16(_mm256_permute2f128_ps(x, y, 0x20)));
      _mm_storeu_si128((__m128i*)(o + 16 * p + 8),
                       f32x8_to_bf16(_mm256_permute2f128_ps(x, y, 0x31)));
    }
  }
}

template <int S, int NQ>
AVX2_TARGET void weigh_pieces_avx2(const Args& a, int64_t t, int64_t h, int64_t g0,
                                   const float* e, int64_t Lp, const int64_t* off, int64_t L,
                                   const float* z) {
  constexpr int NP = NQ == 1 ? 4 : 2;  // 8 accumulators: 8 FMA chains, no spills
  int p0 = 0;
  for (; p0 + NP <= S; p0 += NP) weigh_values_avx2<NQ, NP>(a, t, h, g0, p0, e, Lp, off, L, z);
  for (; p0 < S; ++p0) weigh_values_avx2<NQ, 1>(a, t, h, g0, p0, e, Lp, off, L, z);
}

template <int S>  // head_dim / 16: 16-element chunks, summed into lanes lo (even) / hi (odd)
AVX2_TARGET void attend_avx2(const Args& a, int64_t t, int64_t h, Scratch& sc) {
  constexpr int kHeads = 3;  // heads scored together (each K row converted once for them)
  const int64_t G = a.H / a.HKV, L = a.ctx[t], Lp = (L + 15) / 16 * 16;
  key_offsets(a, t, h, sc.offsets);
  const int64_t* off = sc.offsets.data();
  sc.scores.assign(G * Lp, 0.f);
  float* buf = sc.scores.data();
  sc.z.resize(2 * G);
  float* z = sc.z.data();
  float* row_max = z + G;
  // the query pairs as fp32: per head and chunk s, [odd elements (8)][even elements (8)]
  sc.q.resize(G * S * 16);
  float* qf = sc.q.data();
  const bf16_t* q0 = a.q + t * a.q_tok + h * G * a.q_head;
  const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t g = 0; g < G; ++g)
    for (int s = 0; s < S; ++s) {
      const __m256i qw = _mm256_loadu_si256((const __m256i*)(q0 + g * a.q_head + 16 * s));
      float* dst = qf + (g * S + s) * 16;
      _mm256_storeu_ps(dst, _mm256_castsi256_ps(_mm256_and_si256(qw, odd_mask)));
      _mm256_storeu_ps(dst + 8, _mm256_castsi256_ps(_mm256_slli_epi32(qw, 16)));
    }
  for (int64_t g0 = 0; g0 < G; g0 += kHeads) {
    const int64_t nq = std::min<int64_t>(kHeads, G - g0);
    const float* qg = qf + g0 * S * 16;
    float* bg = buf + g0 * Lp;
    if (nq == 3) score_keys_avx2<S, 3>(a, qg, off, L, bg, Lp, row_max + g0);
    else if (nq == 2) score_keys_avx2<S, 2>(a, qg, off, L, bg, Lp, row_max + g0);
    else score_keys_avx2<S, 1>(a, qg, off, L, bg, Lp, row_max + g0);
  }
  // softmax numerators in place, one Z per head (lanes of 8 alternate lo / hi)
  for (int64_t g = 0; g < G; ++g) {
    float* s = buf + g * Lp;
    const __m256 m = _mm256_set1_ps(row_max[g]);
    V16 sum{_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t l = 0; l < Lp; l += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), m));
      if (L - l < 8) {
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_set1_epi32((int)(L - l)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        e = _mm256_and_ps(e, keep);
      }
      _mm256_storeu_ps(s + l, e);
      __m256& lane = (l / 8) % 2 ? sum.hi : sum.lo;
      lane = _mm256_add_ps(lane, e);
    }
    z[g] = tree16(sum);
  }
  for (int64_t g0 = 0; g0 < G; g0 += 2) {  // two heads at a time: 16 ymm registers hold no more
    if (G - g0 >= 2) weigh_pieces_avx2<S, 2>(a, t, h, g0, buf, Lp, off, L, z);
    else weigh_pieces_avx2<S, 1>(a, t, h, g0, buf, Lp, off, L, z);
  }
}

using AttendFn = void (*)(const Args&, int64_t, int64_t, Scratch&);
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
                          float scale, bf16_t* out) {
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
  // Threads take tasks as they go (parallel_tasks), the last token first: in a causal
  // prefill later tokens see more keys, and the longest tasks first share out best.
  const int64_t n = index.T * HKV;
  parallel_tasks(n, [&](Tasks& tasks) {
    FlushDenormals guard;
    thread_local Scratch scratch;
    for (int64_t k; tasks.take(k);) {
      const int64_t task = n - 1 - k;
      attend(a, task / HKV, task % HKV, scratch);
    }
  });
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
