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
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using bf16_t = uint16_t;

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
constexpr float kExpMin = -87.0f;  // e^-87 is still a normal float

struct FlushDenormals {
  unsigned saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// A 16-lane fp32 value as the AVX2 path holds it: lanes 0-7 and 8-15.
struct V16 {
  __m256 lo, hi;
};

// ---- the operations both paths share, lane for lane ------------------------------------
AVX512_TARGET inline float tree16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

AVX2_TARGET inline float tree16(V16 v) {
  const __m256 a = _mm256_add_ps(v.lo, v.hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

AVX512_TARGET inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

AVX2_TARGET inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpMin));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

AVX512_TARGET inline __m512 bf16x16_to_f32(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
AVX2_TARGET inline __m256 bf16x8_to_f32(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

AVX512_TARGET inline __m256i f32x16_to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

AVX2_TARGET inline __m128i f32x8_to_bf16(__m256 v) {  // as exact.cpp's to_bf16_avx2
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  r = _mm256_blendv_epi8(r, qnan, nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

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

inline int64_t key_offset(const Args& a, const int32_t* table, int64_t l) {
  return table[l / a.block_size] * a.blk_stride + (l % a.block_size) * a.tok_stride;
}

// ---- one (token, kv head): G query heads over the token's context ----------------------
AVX512_TARGET void attend_avx512(const Args& a, int64_t t, int64_t h, std::vector<float>& buf) {
  const int64_t G = a.H / a.HKV, D = a.D, L = a.ctx[t], Lp = (L + 15) / 16 * 16;
  const int32_t* table = a.tables + a.token_seq[t] * a.table_stride;
  buf.assign(G * Lp, 0.f);
  const bf16_t* q0 = a.q + t * a.q_tok + h * G * a.q_head;
  for (int64_t l = 0; l < L; ++l) {
    const bf16_t* k = a.k + key_offset(a, table, l) + h * D;
    for (int64_t g = 0; g < G; ++g) {
      const bf16_t* q = q0 + g * a.q_head;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 32) {  // a 16-wide tail reads as zero pairs
        const __mmask32 m = D - c >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xFFFFu;
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(m, q + c),
                               (__m512bh)_mm512_maskz_loadu_epi16(m, k + c));
      }
      buf[g * Lp + l] = tree16(acc) * a.scale;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* s = buf.data() + g * Lp;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t l = 0; l < L; ++l) m = s[l] > m ? s[l] : m;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < Lp; l += 16) {
      const __mmask16 valid = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + l),
                                                                       _mm512_set1_ps(m))));
      _mm512_storeu_ps(s + l, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 z = _mm512_set1_ps(tree16(sum));
    bf16_t* o = a.out + (t * a.H + h * G + g) * D;
    for (int64_t c = 0; c < D; c += 16) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t l = 0; l < L; ++l)
        acc = _mm512_fmadd_ps(_mm512_set1_ps(s[l]),
                              bf16x16_to_f32(a.v + key_offset(a, table, l) + h * D + c), acc);
      _mm256_storeu_si256((__m256i*)(o + c), f32x16_to_bf16(_mm512_div_ps(acc, z)));
    }
  }
}

AVX2_TARGET void attend_avx2(const Args& a, int64_t t, int64_t h, std::vector<float>& buf) {
  const int64_t G = a.H / a.HKV, D = a.D, L = a.ctx[t], Lp = (L + 15) / 16 * 16;
  const int32_t* table = a.tables + a.token_seq[t] * a.table_stride;
  buf.assign(G * Lp, 0.f);
  const bf16_t* q0 = a.q + t * a.q_tok + h * G * a.q_head;
  const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
  for (int64_t l = 0; l < L; ++l) {
    const bf16_t* k = a.k + key_offset(a, table, l) + h * D;
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
                              bf16x8_to_f32(a.v + key_offset(a, table, l) + h * D + c), acc);
      _mm_storeu_si128((__m128i*)(o + c), f32x8_to_bf16(_mm256_div_ps(acc, z)));
    }
  }
}

}  // namespace

int64_t get_isa();

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
  TORCH_CHECK(kv_layer.size(4) == D && D % 16 == 0 && H % HKV == 0,
              "head_dim must be a multiple of 16 and heads a multiple of kv heads");
  TORCH_CHECK(token_seq.numel() == T && context_lens.numel() == T, "one entry per token");
  at::Tensor out = at::empty({T, H, D}, q.options());
  const auto* kv = reinterpret_cast<const bf16_t*>(kv_layer.data_ptr());
  const int64_t NBLK = kv_layer.size(1), BS = kv_layer.size(2);
  Args a{reinterpret_cast<const bf16_t*>(q.data_ptr()), q.stride(0), q.stride(1),
         kv, kv + NBLK * BS * HKV * D, BS * HKV * D, HKV * D, BS,
         block_tables.data_ptr<int32_t>(), block_tables.dim() == 2 ? block_tables.size(1) : 0,
         token_seq.data_ptr<int32_t>(), context_lens.data_ptr<int32_t>(),
         H, HKV, D, (float)scale, reinterpret_cast<bf16_t*>(out.data_ptr())};
  const bool avx512 = get_isa() == 2;
  at::parallel_for(0, T * HKV, 1, [&](int64_t begin, int64_t end) {
    FlushDenormals guard;
    thread_local std::vector<float> buf;
    for (int64_t task = begin; task < end; ++task) {
      if (avx512) attend_avx512(a, task / HKV, task % HKV, buf);
      else attend_avx2(a, task / HKV, task % HKV, buf);
    }
  });
  return out;
}
