// Batch-invariant bf16 kernels for CPU: a linear layer and paged attention whose every
// output element is one fixed sequence of IEEE operations, whatever the batch around it.
//
// Why: oneDNN picks its kernel (AMX tiles, AVX-512 BF16 dot products, a GEMV path) and its
// blocking by row count and ISA, so the same token gets different bits in a batch of 1 and
// a batch of 300. Here the reduction order is part of the code, never of the shape:
//
//   linear:    y[i, j] = bf16( fold over k-pairs p = 0 .. ceil(K/2)-1 of
//                          acc = fma(x[2p+1], w[j, 2p+1], acc); acc = fma(x[2p], w[j, 2p], acc)
//                          (+ bias[j]) )                       acc starts at +0.0
//   attention: per query head, scores over keys 0..L-1 in position order (each the same
//              pairwise fold over head_dim), softmax with an exact max and bf16
//              numerators, their 16-lane sum folded by one fixed tree, and the output the
//              same fold over key pairs (attention.cpp).
//
// The AVX-512 BF16 path uses VDPBF16PS, whose definition is exactly the pair of FMAs above
// (odd element first, denormals in and out flushed to zero, round to nearest even); the
// AVX2 path runs those FMAs one by one under MXCSR FTZ|DAZ. The two are bit-identical
// (tests/model/test_exact_kernels.py checks it), so a token's bits do not depend on the
// machine's ISA either. Threads split rows and columns, never a reduction. On AMX-BF16
// CPUs the linear and attention run on tiles instead (linear_amx.h, attention_amx.h):
// batch-invariant as well, the linear ~7x the AVX-512 path's GEMM speed on a 2-core Xeon
// with AMX, but with bits of their own, so an engine there has its own fingerprint
// (kernels_version() in __init__.py); SPLITSERVE_CPU_ISA=avx512_bf16 keeps such a machine
// on the fold.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor

#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common.h"
#include "linear_amx.h"
#include "ops.h"

namespace {

using namespace exact;

enum Isa : int { kAvx2 = 1, kAvx512Bf16 = 2, kAmxBf16 = 3 };

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return amx_usable() ? kAmxBf16 : kAvx512Bf16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
  return 0;
}

int g_isa = -1;  // set by set_isa() or detected on first use

int active_isa() {
  if (g_isa < 0) g_isa = detect_isa();
  return g_isa;
}

// ---- dispatch over (rows, blocks) --------------------------------------------------------
template <typename W>
using MicroFn = void (*)(const bf16_t*, int64_t, int64_t, const W*, int64_t, const float*,
                         const float*, bf16_t*, int64_t, int64_t, bool);

template <typename W>
struct Table {
  MicroFn<W> fn[kMaxRows][kMaxBlocks];
};

template <typename W> struct Avx512 {
  template <int MR, int NB> static constexpr MicroFn<W> f = micro_avx512<MR, NB, W>;
};
template <typename W> struct Avx2 {
  template <int MR, int NB> static constexpr MicroFn<W> f = micro_avx2<MR, NB, W>;
};

template <typename W, typename P>
constexpr Table<W> make_table() {
  return {{{P::template f<1, 1>, P::template f<1, 2>, P::template f<1, 3>, P::template f<1, 4>},
           {P::template f<2, 1>, P::template f<2, 2>, P::template f<2, 3>, P::template f<2, 4>},
           {P::template f<3, 1>, P::template f<3, 2>, P::template f<3, 3>, P::template f<3, 4>},
           {P::template f<4, 1>, P::template f<4, 2>, P::template f<4, 3>, P::template f<4, 4>},
           {P::template f<5, 1>, P::template f<5, 2>, P::template f<5, 3>, P::template f<5, 4>},
           {P::template f<6, 1>, P::template f<6, 2>, P::template f<6, 3>, P::template f<6, 4>}}};
}

template <typename W>
const Table<W>& table_for(int isa) {
  static constexpr Table<W> avx512 = make_table<W, Avx512<W>>();
  static constexpr Table<W> avx2 = make_table<W, Avx2<W>>();
  return isa >= kAvx512Bf16 ? avx512 : avx2;
}

// int8 -> bf16, exact (|q| <= 127): a group's weights widened once for all its rows.
AVX512_TARGET void widen_int8_avx512(const int8_t* q, bf16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) _mm512_storeu_si512(out + i, (__m512i)load_w512(q + i));
  for (; i < n; ++i) out[i] = (bf16_t)(__builtin_bit_cast(uint32_t, (float)q[i]) >> 16);
}

// y [M, N] = the fold of x [M, K] with one packed weight (bf16 or int8), threads taking
// (column group, row chunk) tasks (parallel_tasks): never a reduction. A task of at most
// one micro-kernel's rows (decode) reads its weights once, so it prefetches them past the
// caches (linear_micro.h's kPrefetchBytes). A task of more rows first widens its group
// once, into a per-thread buffer: to fp32 for the AVX2 panels (linear_micro.h; up to 30
// rows a k chunk at a time, in L1), and an int8 group to bf16 for the AVX-512
// micro-kernels. The same values, so the same bits, with the widening paid once per 60
// rows instead of once per 6.
// On AMX (K a multiple of 32, every row count) the tiles (linear_amx.h) take the group
// instead, an int8 group always widened to bf16 first.
template <typename W>
void run_linear(const bf16_t* xp, const W* wp, const float* scale, const float* b, bf16_t* yp,
                int64_t M, int64_t K, int64_t N, int64_t nblk, int64_t KP, int isa) {
  const Table<W>& table = table_for<W>(isa);
  const Table<bf16_t>& widened_table = table_for<bf16_t>(isa);
  const bool amx = isa == kAmxBf16 && K % kAmxK == 0;
  const int64_t w_block = KP * 2 * kLanes;  // one 16-column block (BlockGroups: its groups)
  // rows per task: the group's weights stay in L2 (a multiple of the tile's 16 on AMX)
  const int64_t row_chunk = amx ? 64 : 60;
  const int64_t row_chunks = (M + row_chunk - 1) / row_chunk;
  const BlockGroups grouping(nblk);
  const int64_t groups = grouping.count();
  constexpr bool kWiden = std::is_same<W, int8_t>::value;
  parallel_tasks(groups * row_chunks, [&](Tasks& tasks) {
    FlushDenormals guard;  // the AVX2 path's FTZ|DAZ; harmless for AVX-512 BF16
    AmxTiles tiles;  // configured on first use, released at the end
    AmxStage stage;  // AMX: the last tile pass's rows are stored during the next one
    std::vector<float> panel, rows, acc;  // AVX2: a k chunk of the group, rows, sums (fp32)
    std::vector<bf16_t> widened;  // AVX-512, AMX: an int8 group widened to bf16
    for (int64_t task; tasks.take(task);) {
      const int64_t g = task / row_chunks, rc = task % row_chunks;
      const int64_t blk0 = grouping.begin(g);
      const int nb = grouping.blocks(g);
      const int64_t n0 = blk0 * kLanes, n_valid = std::min<int64_t>(N - n0, nb * kLanes);
      const int64_t r0 = rc * row_chunk, r_end = std::min(M, r0 + row_chunk);
      const W* w = wp + blk0 * w_block;
      const float* sc = scale ? scale + n0 : nullptr;
      const float* bi = b ? b + n0 : nullptr;
      const bool one_pass = r_end - r0 <= kMaxRows;  // decode: each weight is read once
      if (!one_pass && isa == kAvx2) {
        panel.resize(panel_floats(r_end - r0, KP, nb));
        rows.resize((r_end - r0) * KP * 2);
        acc.resize(nb * (r_end - r0) * kLanes);
        run_panels(xp + r0 * K, K, K, w, nb, sc, bi, yp + r0 * N + n0, N, n_valid,
                   r_end - r0, rows.data(), panel.data(), acc.data());
        continue;
      }
      const bf16_t* w16 = nullptr;
      if (kWiden && (amx || !one_pass)) {
        widened.resize(nb * w_block);
        widen_int8_avx512(reinterpret_cast<const int8_t*>(w), widened.data(), nb * w_block);
        w16 = widened.data();
      }
      if (amx) {
        amx_rows(tiles, stage, xp + r0 * K, K, w16 ? w16 : reinterpret_cast<const bf16_t*>(w),
                 nb, sc, bi, yp + r0 * N + n0, N, n_valid, r_end - r0);
        continue;
      }
      for (int64_t r = r0; r < r_end; r += kMaxRows) {
        const int mr = (int)std::min<int64_t>(kMaxRows, r_end - r);
        if (w16) {
          widened_table.fn[mr - 1][nb - 1](xp + r * K, K, K, w16, nb * 2 * kLanes, sc, bi,
                                           yp + r * N + n0, N, n_valid, false);
        } else {
          table.fn[mr - 1][nb - 1](xp + r * K, K, K, w, nb * 2 * kLanes, sc, bi,
                                   yp + r * N + n0, N, n_valid, one_pass);
        }
      }
    }
    if (amx) stage.finish();
  });
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(),
              name, " must be a contiguous CPU bfloat16 tensor");
}

const float* fp32_vector(const c10::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t || !t->defined()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N,
              name, " must be contiguous fp32 [N]");
  return t->data_ptr<float>();
}

}  // namespace

namespace exact {

PackedLinear packed_linear(const at::Tensor& w_packed, int64_t K, int64_t N,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& scale) {
  const bool int8 = w_packed.scalar_type() == at::kChar;
  if (!int8) check_bf16(w_packed, "w_packed");
  TORCH_CHECK(w_packed.device().is_cpu() && w_packed.is_contiguous(),
              "w_packed must be a contiguous CPU tensor");
  TORCH_CHECK(w_packed.dim() == 4 && w_packed.size(2) == kLanes && w_packed.size(3) == 2,
              "linear: w_packed must be [NBLK, KP, 16, 2]");
  const int64_t nblk = w_packed.size(0), KP = w_packed.size(1);
  TORCH_CHECK(KP == (K + 1) / 2 && nblk * kLanes >= N && (nblk - 1) * kLanes < N,
              "linear: packed weight does not match x or N");
  const float* s = fp32_vector(scale, N, "scale");
  TORCH_CHECK(int8 == (s != nullptr), "int8 weights need a scale; bf16 weights take none");
  return PackedLinear{w_packed.data_ptr(), int8, s, fp32_vector(bias, N, "bias"), K, N, nblk,
                      KP};
}

void linear_into(const bf16_t* x, int64_t M, const PackedLinear& w, bf16_t* y) {
  if (M == 0) return;
  const int isa = active_isa();
  TORCH_CHECK(isa != 0, "exact kernels need AVX2+FMA or AVX-512 BF16");
  if (w.int8) {
    run_linear(x, static_cast<const int8_t*>(w.w), w.scale, w.bias, y, M, w.K, w.N, w.nblk,
               w.KP, isa);
  } else {
    run_linear(x, static_cast<const bf16_t*>(w.w), w.scale, w.bias, y, M, w.K, w.N, w.nblk,
               w.KP, isa);
  }
}

}  // namespace exact

// x [M, K] bf16; w_packed [NBLK, KP, 16, 2] bf16, or int8 with its per-column fp32 `scale`
// [N] (pack_weight in kernels/__init__.py); bias [N] fp32 or empty. Returns y [M, N] bf16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w_packed, int64_t N,
                  const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& scale) {
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2, "linear: x must be [M, K]");
  const exact::PackedLinear w = exact::packed_linear(w_packed, x.size(1), N, bias, scale);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  exact::linear_into(reinterpret_cast<const bf16_t*>(x.data_ptr()), x.size(0), w,
                     reinterpret_cast<bf16_t*>(y.data_ptr()));
  return y;
}

void set_isa(int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= kAmxBf16, "isa must be 0 (detect), 1, 2 or 3");
  const int have = detect_isa();
  const int want = isa == 0 ? have : (int)isa;
  TORCH_CHECK(want <= have, "this CPU cannot run ISA level ", want);
  g_isa = want;
}

int64_t get_isa() { return active_isa(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  register_decoder(m);
  register_helpers(m);
  m.def("linear", &linear, "batch-invariant linear over packed bf16 or int8 weights",
        py::arg("x"), py::arg("w_packed"), py::arg("N"), py::arg("bias") = py::none(),
        py::arg("scale") = py::none());
  m.def("paged_attention", &paged_attention, "batch-invariant paged attention");
  m.def("rms_norm", &rms_norm, "(y, h): h = x + residual, y = RMSNorm(h)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up]");
  m.def("argmax_rows", &argmax_rows, "each row's first maximum, a NaN above everything");
  m.def("rope_write_kv", &rope_write_kv, "rotary q and k, k and v into the cache; returns q");
  m.def("set_isa", &set_isa, "0 = detect, 1 = AVX2, 2 = AVX-512 BF16, 3 = AMX-BF16");
  m.def("get_isa", &get_isa);
}
