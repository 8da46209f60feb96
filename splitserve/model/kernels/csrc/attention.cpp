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
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "attention_amx.h"
#include "attention_avx2.h"
#include "attention_avx512.h"
#include "common.h"
#include "ops.h"

namespace {

using namespace exact;
using namespace exact::attn;

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
