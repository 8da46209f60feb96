// Batch-invariant paged attention (see exact.cpp for the contract and the two ISA paths).
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
  std::vector<float> z;  // [G] softmax denominators
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

using AttendFn = void (*)(const Args&, int64_t, int64_t, Scratch&);
constexpr AttendFn kAttendAvx512[8] = {attend_avx512<1>, attend_avx512<2>, attend_avx512<3>,
                                       attend_avx512<4>, attend_avx512<5>, attend_avx512<6>,
                                       attend_avx512<7>, attend_avx512<8>};

AVX2_TARGET void attend_avx2(const Args& a, int64_t t, int64_t h, Scratch& sc) {
  const int64_t G = a.H / a.HKV, D = a.D, L = a.ctx[t], Lp = (L + 15) / 16 * 16;
  key_offsets(a, t, h, sc.offsets);
  const int64_t* off = sc.offsets.data();
  sc.scores.assign(G * Lp, 0.f);
  std::vector<float>& buf = sc.scores;
  const bf16_t* q0 = a.q + t * a.q_tok + h * G * a.q_head;
  const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t l = 0; l < L; ++l) {
    const bf16_t* k = a.k + off[l];
    for (int64_t g = 0; g < G; ++g) {
      const bf16_t* q = q0 + g * a.q_head;
      V16 acc{_mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t c = 0; c < D; c += 32)
        for (int half = 0; half < 2 && c + 16 * half < D; ++half) {
          const __m256i qw = _mm256_loadu_si256((const __m256i*)(q + c + 16 * half));
          const __m256i kw = _mm256_loadu_si256((const __m256i*)(k + c + 16 * half));
          __m256& lane = half ? acc.hi : acc.lo;
          lane = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(qw, odd_mask)),
                                 _mm256_castsi256_ps(_mm256_and_si256(kw, odd_mask)), lane);
          lane = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(qw, 16)),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(kw, 16)), lane);
        }
      buf[g * Lp + l] = tree16(acc) * a.scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = buf.data() + g * Lp;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < L; ++l) m = s[l] > m ? s[l] : m;
    V16 sum{_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t l = 0; l < Lp; l += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), _mm256_set1_ps(m)));
      if (L - l < 8) {
        alignas(32) float keep[8];
        for (int i = 0; i < 8; ++i) keep[i] = l + i < L ? 1.f : 0.f;
        e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_load_ps(keep), _mm256_set1_ps(0.f),
                                           _CMP_NEQ_OQ));
      }
      _mm256_storeu_ps(s + l, e);
      __m256& lane = (l / 8) % 2 ? sum.hi : sum.lo;
      lane = _mm256_add_ps(lane, e);
    }
    const __m256 z = _mm256_set1_ps(tree16(sum));
    bf16_t* o = a.out + (t * a.H + h * G + g) * D;
    for (int64_t c = 0; c < D; c += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t l = 0; l < L; ++l)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(s[l]),
                              bf16x8_to_f32(a.v + off[l] + c), acc);
      _mm_storeu_si128((__m128i*)(o + c), f32x8_to_bf16(_mm256_div_ps(acc, z)));
    }
  }
}

}  // namespace


// q [T, H, D] bf16 (last dim contiguous); kv_layer [2, NBLK, BS, HKV, D] bf16 contiguous;
// block_tables [S, MB] int32; token_seq [T] int32 (row of block_tables); context_lens [T]
// int32 (keys each token sees, itself included). Returns [T, H, D] bf16.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_layer,
                           const at::Tensor& block_tables, const at::Tensor& token_seq,
                           const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 &&
              q.stride(2) == 1, "q must be CPU bfloat16 [T, H, D] with a contiguous last dim");
  TORCH_CHECK(kv_layer.scalar_type() == at::kBFloat16 && kv_layer.is_contiguous() &&
              kv_layer.dim() == 5 && kv_layer.size(0) == 2, "kv_layer must be [2, NBLK, BS, HKV, D]");
  for (const at::Tensor* t : {&block_tables, &token_seq, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "index tensors must be int32");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t HKV = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(4) == D && D % 16 == 0 && D <= 128 && H % HKV == 0,
              "head_dim must be a multiple of 16 up to 128, heads a multiple of kv heads");
  TORCH_CHECK(token_seq.numel() == T && context_lens.numel() == T, "one entry per token");
  const int64_t S = block_tables.dim() == 2 ? block_tables.size(0) : 0;
  const int64_t max_keys = S ? block_tables.size(1) * kv_layer.size(2) : 0;
  const int32_t* seq = token_seq.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(seq[t] >= 0 && seq[t] < S && lens[t] >= 1 && lens[t] <= max_keys,
                "token ", t, ": sequence ", seq[t], " of ", S, ", ", lens[t],
                " keys (its block table holds ", max_keys, ")");
  const int32_t* tbl = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(tbl[i] >= 0 && tbl[i] < kv_layer.size(1), "block id ", tbl[i], " out of range");
  at::Tensor out = at::empty({T, H, D}, q.options());
  const auto* kv = reinterpret_cast<const bf16_t*>(kv_layer.data_ptr());
  const int64_t NBLK = kv_layer.size(1), BS = kv_layer.size(2);
  Args a{reinterpret_cast<const bf16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
         kv, kv + NBLK * BS * HKV * D, BS * HKV * D, HKV * D, BS,
         block_tables.data_ptr<int32_t>(), block_tables.dim() == 2 ? block_tables.size(1) : 0,
         token_seq.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
         H, HKV, D, (float)scale, reinterpret_cast<bf16_t*>(out.data_ptr())};
  const AttendFn attend = get_isa() == 2 ? kAttendAvx512[D / 16 - 1] : attend_avx2;
  // Threads take contiguous ranges; tasks alternate from both ends so that a causal
  // prefill's short and long contexts are spread over them (0, n-1, 1, n-2, ...).
  const int64_t n = T * HKV;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals guard;
    thread_local Scratch scratch;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t task = k % 2 == 0 ? k / 2 : n - 1 - k / 2;
      attend(a, task / HKV, task % HKV, scratch);
    }
  });
  return out;
}
