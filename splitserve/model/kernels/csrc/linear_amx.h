// The linear layer on AMX-BF16 tiles (Sapphire Rapids and later; exact.cpp dispatches it).
//
// TDPBF16PS does not compute the FMA fold of exact.cpp's header: measured on a Xeon of
// family 6 model 207, its 32-product sums match neither pair order of FMAs nor an exactly
// rounded sum (its internal rounding is not documented). It is still one fixed function
// of each output row's operands: a row's bits do not depend on the other rows of its
// tile, nor on its row count (checked on the machine; tests/model/test_exact_amx.py). So this
// path is batch-invariant by the same rule as the others (the reduction order is part of
// the code, never of the shape: 32 k at a time, k tiles in order, starting from +0.0),
// but its bits are its own: an engine on it has another fingerprint ("exact/v1+amx"), and
// its KV never mixes with an AVX2 / AVX-512 engine's. It runs every row count, one token
// of decode too, so no shape ever changes a token's path; only K decides (a multiple of
// 32, else the fold).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>

#include <algorithm>
#include <cstring>

#include "common.h"
#include "linear_micro.h"

#define AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

namespace exact {

// Whether this process may run AMX-BF16: the CPU has it (CPUID.7.0:EDX bits 22, 24) and
// Linux grants the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16+).
inline bool amx_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

constexpr int64_t kAmxK = 32;     // k per tile step: 16 pairs
constexpr int64_t kAmxRows = 16;  // rows of one A / C tile

// One thread's tile configuration: C tiles 0-3 (one per 16-column block), A tile 4, B tiles
// 5 and 6 (and 7, attention's second key tile), all 64 bytes wide; A and C hold `rows`
// rows. Released (tiles back to their init state, cheap to save at a context switch) when
// the thread's tasks are done.
class AmxTiles {
 public:
  ~AmxTiles() {
    if (rows_) release();
  }
  AMX_TARGET void configure(int rows) {
    if (rows == rows_) return;
    struct alignas(64) {
      uint8_t palette, start_row, reserved[14];
      uint16_t colsb[16];
      uint8_t rows[16];
    } cfg;
    std::memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = t < 5 ? rows : 16;
    }
    _tile_loadconfig(&cfg);
    rows_ = rows;
  }

 private:
  AMX_TARGET static void release() { _tile_release(); }
  int rows_ = 0;
};

// A pass's accumulators still to be stored as bf16 rows: unit i is row i % rows of
// block i / rows (y = bf16(acc * scale + bias), each step only where given, as the
// AVX-512 micro-kernel stores its accumulators). The next pass converts them a few units
// per k step while its tile products run, so the conversion overlaps the tiles instead
// of waiting between passes.
struct AmxPending {
  const float* acc = nullptr;  // [nb][16 rows][16]
  int rows = 0, nb = 0, next = 0;
  const float* scale = nullptr;
  const float* bias = nullptr;
  bf16_t* y = nullptr;
  int64_t ldy = 0, n_valid = 0;
  int left() const { return rows * nb - next; }
};

AMX_TARGET inline void amx_store_units(AmxPending& p, int count) {
  for (const int end = p.next + std::min(count, p.left()); p.next < end; ++p.next) {
    const int c = p.next / p.rows, r = p.next % p.rows;
    const int64_t n0 = c * kLanes, left = p.n_valid - n0;
    if (left <= 0) continue;
    const __mmask16 m = left >= kLanes ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    __m512 v = _mm512_loadu_ps(p.acc + (c * kAmxRows + r) * kLanes);
    if (p.scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, p.scale + n0));
    if (p.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, p.bias + n0));
    _mm256_mask_storeu_epi16(p.y + r * p.ldy + n0, m, f32x16_to_bf16(v));
  }
}

// acc [NB][16 rows][16] fp32 = the tile products of `rows` rows of x (leading dimension
// ldx) with NB blocks of a group ([KP][nb][16][2], `pair_stride` elements per k pair),
// over K (a multiple of 32). The tiles must be configured for `rows` rows. `pending` (the
// last pass's accumulators, not `acc`) is stored meanwhile, all of it before `acc` is.
template <int NB>
AMX_TARGET void amx_block_rows(const bf16_t* x, int64_t ldx, int64_t K, const bf16_t* w,
                               int64_t pair_stride, float* acc, bool stream,
                               AmxPending& pending) {
  const int64_t x_stride = ldx * (int64_t)sizeof(bf16_t);
  const int64_t w_stride = pair_stride * (int64_t)sizeof(bf16_t);
  const int per_step = (int)((pending.left() + K / kAmxK - 1) / (K / kAmxK));
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kAmxK) {
    const bf16_t* wk = w + (k / 2) * pair_stride;
    if (stream) {  // each weight comes from DRAM: fetch it 2 k steps ahead
      const char* ahead = (const char*)(wk + 2 * kAmxK / 2 * pair_stride);
      for (int64_t b = 0; b < kAmxK / 2 * w_stride; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    _tile_loadd(4, x + k, x_stride);
    _tile_loadd(5, wk, w_stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) {
      _tile_loadd(6, wk + 2 * kLanes, w_stride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NB > 2) {
      _tile_loadd(5, wk + 4 * kLanes, w_stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NB > 3) {
      _tile_loadd(6, wk + 6 * kLanes, w_stride);
      _tile_dpbf16ps(3, 4, 6);
    }
    amx_store_units(pending, per_step);
  }
  amx_store_units(pending, pending.left());
  constexpr int64_t kTile = kAmxRows * kLanes;  // floats of one C tile
  _tile_stored(0, acc, kLanes * sizeof(float));
  if constexpr (NB > 1) _tile_stored(1, acc + kTile, kLanes * sizeof(float));
  if constexpr (NB > 2) _tile_stored(2, acc + 2 * kTile, kLanes * sizeof(float));
  if constexpr (NB > 3) _tile_stored(3, acc + 3 * kTile, kLanes * sizeof(float));
}

// One thread's two accumulator buffers and the pass whose rows are still to be stored:
// a pass is stored while the thread's next one runs, in the same task or the next; call
// `finish` after the thread's last task.
struct AmxStage {
  alignas(64) float acc[2][4 * kAmxRows * kLanes];
  AmxPending pending;
  int64_t passes = 0;
  float* next_buffer() { return acc[passes++ % 2]; }
  AMX_TARGET void finish() { amx_store_units(pending, pending.left()); }
};

// Rows [0, rows) of y for one group of nb blocks: 16 rows per tile pass.
AMX_TARGET inline void amx_rows(AmxTiles& tiles, AmxStage& stage, const bf16_t* x, int64_t K,
                                const bf16_t* w, int nb, const float* scale, const float* bias,
                                bf16_t* y, int64_t ldy, int64_t n_valid, int64_t rows) {
  using Fn = void (*)(const bf16_t*, int64_t, int64_t, const bf16_t*, int64_t, float*, bool,
                      AmxPending&);
  static constexpr Fn kBlocks[4] = {amx_block_rows<1>, amx_block_rows<2>, amx_block_rows<3>,
                                    amx_block_rows<4>};
  for (int64_t r = 0; r < rows; r += kAmxRows) {
    const int m = (int)std::min<int64_t>(kAmxRows, rows - r);
    float* out = stage.next_buffer();
    tiles.configure(m);
    // The task's first pass reads the group from DRAM, its later passes from L2.
    kBlocks[nb - 1](x + r * K, K, K, w, nb * 2 * kLanes, out, r == 0, stage.pending);
    stage.pending = AmxPending{out, m, nb, 0, scale, bias, y + r * ldy, ldy, n_valid};
  }
}

}  // namespace exact
