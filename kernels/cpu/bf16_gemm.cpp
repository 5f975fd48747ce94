// bf16_gemm: out [M, N] bf16 = x [M, K] bf16 @ W.T on AVX512-BF16 (vdpbf16ps), fp32 accumulation,
// for a weight packed 16 output channels x 2 k per 64 bytes ([ceil(N / 16)][K / 2][16][2]:
// bf16_gemm_pack in cpu_ops.py). Each weight vector is loaded once per tile of up to 6 rows and
// multiplied with every row's broadcast k pair, so a decode step's projections stream the weights
// at close to the memory's speed: on a 2-core Zen 4 EPYC, SmolLM2's 30 layers of projections at
// 1 row 7 ms against oneDNN's 16 (~30 GB/s against 13), at 16 rows 14 against 20, equal from 64.
// Column tiles are split between threads; rows are not (a decode step has few).
// Where the build targets AMX-BF16 and K is a multiple of 32, the same layout feeds AMX tiles
// instead, at every M: on a 2-core Xeon with AMX (family 6 model 167) the 30 layers' projections
// took 7.1-7.7 ms from 1 to 16 rows (~29 GB/s) against oneDNN's 10.3-10.8 (~20 GB/s), and tied
// with oneDNN from 256 rows (at 2,048 since its outputs are streamed); vdpbf16ps rows there: 7.2 ms
// at 1 row, 12.0 at 8.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>  // not ATen/ATen.h: every operator's header, 12 s of each compile
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BATON_BF16_GEMM 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx_common.h"
#include "dynamic_for.h"
#define BATON_BF16_GEMM_AMX 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "dynamic_for.h"
#define BATON_BF16_GEMM_AVX2 1
#endif

#include "ops.h"
#include "sleef_exp.h"

namespace {

#ifdef BATON_BF16_GEMM
constexpr int kMaxRowTile = 6;  // 6 rows x 4 column blocks: 24 accumulators of 32 zmm registers

inline void store_bf16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// v rounded as store_bf16 rounds it, widened back to fp32.
inline __m512 rounded_bf16(__m512 v) {
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// MT rows x NT blocks of 16 output channels over the whole K. x: the tile's first row (row stride
// k); w: the first block's panel ([k / 2][16][2] bf16 per block, blocks k / 2 x 32 apart).
template <int MT, int NT>
void tile(const at::BFloat16* x, int64_t k, const at::BFloat16* w, at::BFloat16* out, int64_t ldo,
          int64_t cols) {
  const int64_t k2 = k / 2;
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  const int32_t* xr[MT];
  for (int i = 0; i < MT; ++i) xr[i] = reinterpret_cast<const int32_t*>(x + i * k);
  for (int64_t s = 0; s < k2; ++s) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + (j * k2 + s) * 32);
    for (int i = 0; i < MT; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(xr[i][s]);  // x[i, 2s], x[i, 2s + 1]
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a, wv[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t left = cols - j * 16;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    for (int i = 0; i < MT; ++i) store_bf16(out + i * ldo + j * 16, acc[i][j], mask);
  }
}

template <int MT>
void row_tile(int nt, const at::BFloat16* x, int64_t k, const at::BFloat16* w, at::BFloat16* out,
              int64_t ldo, int64_t cols) {
  switch (nt) {
    case 1: return tile<MT, 1>(x, k, w, out, ldo, cols);
    case 2: return tile<MT, 2>(x, k, w, out, ldo, cols);
    case 3: return tile<MT, 3>(x, k, w, out, ldo, cols);
    default: return tile<MT, 4>(x, k, w, out, ldo, cols);
  }
}

// Column blocks per tile (2 to 4): the fewest tiles whose rounds over the threads leave none idle
// for long (576 outputs = 36 blocks on 2 threads: 12 tiles of 3, not 9 of 4).
int col_tile(int64_t blocks, int threads) {
  int best = 4;
  int64_t best_cost = INT64_MAX;
  for (int nt = 4; nt >= 2; --nt) {
    const int64_t tiles = (blocks + nt - 1) / nt;
    const int64_t cost = (tiles + threads - 1) / threads * nt;  // blocks the busiest thread runs
    if (cost < best_cost) best = nt, best_cost = cost;
  }
  return best;
}

void gemm(const at::BFloat16* x, const at::BFloat16* packed, at::BFloat16* out, int64_t m, int64_t k,
          int64_t n) {
  const int64_t blocks = (n + 15) / 16;
  const int nt_max = col_tile(blocks, at::get_num_threads());
  const int64_t tiles = (blocks + nt_max - 1) / nt_max;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * nt_max;
      const int nt = static_cast<int>(std::min<int64_t>(nt_max, blocks - b0));
      const at::BFloat16* w = packed + b0 * k * 16;
      const int64_t col = b0 * 16;
      for (int64_t r = 0; r < m; r += kMaxRowTile) {  // the panel stays in L2 between row tiles
        const int mt = static_cast<int>(std::min<int64_t>(kMaxRowTile, m - r));
        const at::BFloat16* xr = x + r * k;
        at::BFloat16* o = out + r * n + col;
        switch (mt) {
          case 1: row_tile<1>(nt, xr, k, w, o, n, n - col); break;
          case 2: row_tile<2>(nt, xr, k, w, o, n, n - col); break;
          case 3: row_tile<3>(nt, xr, k, w, o, n, n - col); break;
          case 4: row_tile<4>(nt, xr, k, w, o, n, n - col); break;
          case 5: row_tile<5>(nt, xr, k, w, o, n, n - col); break;
          default: row_tile<6>(nt, xr, k, w, o, n, n - col);
        }
      }
    }
  });
}

#ifdef BATON_BF16_GEMM_AMX
// The packed layout is already AMX's B operand: a block's [K / 2][16][2] panel is, 16 k-pairs at
// a time, a 16 x 64-byte tile (row p: the 16 channels' pair p). A tiles are 16 rows x 32 k of x.
// Tiles: 0-3 the fp32 sums (row tile i, column block j: 2i + j), 4-5 x, 6-7 the weights.
// MB row tiles x NB column blocks over the whole K; a[i]: row tile i's first row (stride k).
// panel: bf16 elements between the two column blocks' panels (k * 16 for neighbours).
template <int MB, int NB>
void amx_tile(const at::BFloat16* const* a, int64_t k, const at::BFloat16* w, int64_t panel,
              float (*sums)[16][16]) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (MB > 1 && NB > 1) _tile_zero(3);
  for (int64_t kk = 0; kk < k; kk += 32) {
    // Each load just before the first product that needs it, so that loads overlap the products
    // already issued (at 2,048 rows ~8% faster than all four loads first).
    _tile_loadd(4, a[0] + kk, k * 2);
    _tile_loadd(6, w + kk * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, w + panel + kk * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (MB > 1) {
      _tile_loadd(5, a[1] + kk, k * 2);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums[0], 64);
  if constexpr (NB > 1) _tile_stored(1, sums[1], 64);
  if constexpr (MB > 1) _tile_stored(2, sums[2], 64);
  if constexpr (MB > 1 && NB > 1) _tile_stored(3, sums[3], 64);
}

// Column pairs of blocks run in turn against a block of rows that stays in the thread's L2 (512 KiB
// of x, beside the pairs' panels): rows are not re-read from L3 for every pair (at 2,048 rows that
// halved oneDNN's speed; 512 KiB ~5% faster than 1 MiB there).
// The last row tile, if ragged, reads a zero-padded copy.
constexpr int64_t kAmxRowBlockBytes = 512 << 10;

// An output at least this large cannot stay in the cores' caches until it is read: it is written
// with streaming stores, which skip reading each line before writing it (a 2,048-token prefill
// chunk's gate/up output is 12 MiB; its layer's products took 20% less time with the next kernel
// reading them, and oneDNN's speed where they had been 1.4x slower).
constexpr int64_t kStreamOutputBytes = 2 << 20;

// Column blocks b0 (and b0 + 1 where nb = 2) against row tiles [t0, t1) (pairs of 16 rows).
void amx_columns(const at::BFloat16* const* row_tile, int64_t t0, int64_t t1, int64_t b0, int nb,
                 const at::BFloat16* packed, at::BFloat16* out, int64_t m, int64_t k, int64_t n, bool stream) {
  alignas(64) float sums[4][16][16];
  const at::BFloat16* w = packed + b0 * k * 16;
  for (int64_t t = t0; t < t1; t += 2) {
    const int mb = static_cast<int>(std::min<int64_t>(2, t1 - t));
    const at::BFloat16* a[2] = {row_tile[t], mb > 1 ? row_tile[t + 1] : nullptr};
    if (mb > 1 && nb > 1) amx_tile<2, 2>(a, k, w, k * 16, sums);
    else if (mb > 1) amx_tile<2, 1>(a, k, w, k * 16, sums);
    else if (nb > 1) amx_tile<1, 2>(a, k, w, k * 16, sums);
    else amx_tile<1, 1>(a, k, w, k * 16, sums);
    if (nb == 2 && n - b0 * 16 >= 32) {  // a whole pair: one 64-byte store a row
      for (int i = 0; i < mb; ++i) {
        const int64_t r0 = (t + i) * 16, rows = std::min<int64_t>(16, m - r0);
        at::BFloat16* o = out + r0 * n + b0 * 16;
        for (int64_t r = 0; r < rows; ++r) {
          const __m512i v = reinterpret_cast<__m512i>(
              _mm512_cvtne2ps_pbh(_mm512_load_ps(sums[2 * i + 1][r]), _mm512_load_ps(sums[2 * i][r])));
          if (stream) _mm512_stream_si512(reinterpret_cast<__m512i*>(o + r * n), v);
          else _mm512_storeu_si512(o + r * n, v);
        }
      }
      continue;
    }
    for (int i = 0; i < mb; ++i) {
      const int64_t r0 = (t + i) * 16, rows = std::min<int64_t>(16, m - r0);
      for (int j = 0; j < nb; ++j) {
        const int64_t col = (b0 + j) * 16, left = n - col;
        const __mmask16 mask =
            left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
        for (int64_t r = 0; r < rows; ++r)
          store_bf16(out + (r0 + r) * n + col, _mm512_load_ps(sums[2 * i + j][r]), mask);
      }
    }
  }
}

// out [M, I] = silu(gate) * up where the product's column block j is gate's and block j + I / 16 the
// same channels' up: each tile pairs gate block j with up block j, and the epilogue rounds both
// sums to bf16 (as bf16_gemm stores them) and applies silu_mul's arithmetic (sleef_exp.h), so the
// result is the bits of bf16_gemm followed by silu_mul, without writing and re-reading the [M, 2I]
// product.
void amx_gated_columns(const at::BFloat16* const* row_tile, int64_t t0, int64_t t1, int64_t j,
                       const at::BFloat16* packed, at::BFloat16* out, int64_t m, int64_t k, int64_t inter) {
  alignas(64) float sums[4][16][16];
  const at::BFloat16* w = packed + j * k * 16;
  const int64_t up_panel = inter * k;  // (I / 16) blocks of k * 16
  for (int64_t t = t0; t < t1; t += 2) {
    const int mb = static_cast<int>(std::min<int64_t>(2, t1 - t));
    const at::BFloat16* a[2] = {row_tile[t], mb > 1 ? row_tile[t + 1] : nullptr};
    if (mb > 1) amx_tile<2, 2>(a, k, w, up_panel, sums);
    else amx_tile<1, 2>(a, k, w, up_panel, sums);
    for (int i = 0; i < mb; ++i) {
      const int64_t r0 = (t + i) * 16, rows = std::min<int64_t>(16, m - r0);
      at::BFloat16* o = out + r0 * inter + j * 16;
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 g = rounded_bf16(_mm512_load_ps(sums[2 * i][r]));
        const __m512 u = rounded_bf16(_mm512_load_ps(sums[2 * i + 1][r]));
        store16(o + r * inter, silu_mul16<at::BFloat16>(g, u), static_cast<__mmask16>(0xFFFF));
      }
    }
  }
}

// The rows of x as 16-row A tiles, read in place; a ragged last tile from a zero-padded copy.
struct RowTiles {
  std::vector<at::BFloat16> tail;
  std::vector<const at::BFloat16*> tile;
  RowTiles(const at::BFloat16* x, int64_t m, int64_t k) {
    const int64_t row_tiles = (m + 15) / 16, full = m / 16;
    if (full < row_tiles) {
      tail.assign(static_cast<size_t>(16 * k), at::BFloat16(0.f));
      std::copy(x + full * 16 * k, x + m * k, tail.begin());
    }
    tile.resize(static_cast<size_t>(row_tiles));
    for (int64_t t = 0; t < row_tiles; ++t) tile[t] = t < full ? x + t * 16 * k : tail.data();
  }
};

inline int64_t row_block_tiles(int64_t k) {  // an even number of row tiles in kAmxRowBlockBytes
  return std::max<int64_t>(2, kAmxRowBlockBytes / (32 * k) / 2 * 2);
}

// `units` column units (pairs of blocks), each against each block of rows (row_block_tiles), run as
// unit(row_tiles, t0, t1, u): the (row block, unit) pairs in row-block order, a contiguous share of
// them a thread, a thread that finishes early taking the rest of another's (dynamic_for.h). In W1
// (64-row decode steps) libgomp's barrier waits fell from ~8% of the samples to ~6% and W1 ran
// ~4% faster (7 alternated pairs, 2-core Xeon with AMX, 2026-12-06); single products run alone
// took the same time (there is nothing to even out).
template <typename Unit>
void amx_row_blocks(const at::BFloat16* x, int64_t m, int64_t k, int64_t units, bool stream, const Unit& unit) {
  const RowTiles rows(x, m, k);
  const int64_t row_tiles = static_cast<int64_t>(rows.tile.size()), block_tiles = row_block_tiles(k);
  const int64_t row_blocks = (row_tiles + block_tiles - 1) / block_tiles;
  dynamic_for(
      row_blocks * units, [] { amx_configure(); },
      [&](int64_t c) {
        const int64_t t0 = c / units * block_tiles, t1 = std::min(row_tiles, t0 + block_tiles);
        unit(rows.tile.data(), t0, t1, c % units);
      },
      [&] {
        _tile_release();
        if (stream) _mm_sfence();  // the streamed lines visible before the threads join
      });
}

void gemm_amx_silu_mul(const at::BFloat16* x, const at::BFloat16* packed, at::BFloat16* out, int64_t m,
                       int64_t k, int64_t inter) {
  amx_row_blocks(x, m, k, inter / 16, false, [&](const at::BFloat16* const* row_tile, int64_t t0, int64_t t1, int64_t j) {
    amx_gated_columns(row_tile, t0, t1, j, packed, out, m, k, inter);
  });
}

void gemm_amx(const at::BFloat16* x, const at::BFloat16* packed, at::BFloat16* out, int64_t m, int64_t k,
              int64_t n) {
  const int64_t blocks = (n + 15) / 16;
  // Streaming stores write whole aligned 64-byte lines: each row's pair of blocks is one.
  const bool stream = m * n * 2 >= kStreamOutputBytes && n % 32 == 0 && reinterpret_cast<uintptr_t>(out) % 64 == 0;
  amx_row_blocks(x, m, k, (blocks + 1) / 2, stream,
                 [&](const at::BFloat16* const* row_tile, int64_t t0, int64_t t1, int64_t cp) {
                   const int nb = static_cast<int>(std::min<int64_t>(2, blocks - cp * 2));
                   amx_columns(row_tile, t0, t1, cp * 2, nb, packed, out, m, k, n, stream);
                 });
}
#endif
#endif

#ifdef BATON_BF16_GEMM_AVX2
// AVX2 has no instruction that multiplies bf16, but a bf16 is the top half of an fp32: the packed
// layout's 32-bit word (a channel's k pair: low half k even, high half k odd) gives k even's eight
// channels as fp32 by a shift left and k odd's by masking off the low half. So the same packed
// weights stream at bf16's bytes into fp32 FMAs: products of bf16 values are exact in fp32, and
// each output is the fp32 sum of its K products rounded to bf16 once, as with vdpbf16ps (the sums
// are added in another order). x's rows are widened to fp32 once a call.
//
// Few rows (up to kAvx2FewRows: batch 1 and small decode batches) read the packed panel directly,
// widening each weight vector once for all the tile's rows: memory-bound, two blocks of channels at
// a time for two streams of weights a thread. More rows run the classic 6 x 16 fp32 tile (12
// accumulators) over a block's packed panel, widening each k pair's weights in registers: a shift
// and a mask for 24 FMAs, no copy. (Widening a block's panel into an fp32 copy first and running
// the tile over that was 10-40% slower on Zen 3 at 16-256 rows: the copy's pass and its stores.)
constexpr int64_t kAvx2FewRows = 4;

inline __m256 even_k(__m256i words) { return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)); }
inline __m256 odd_k(__m256i words, __m256i high) { return _mm256_castsi256_ps(_mm256_and_si256(words, high)); }

// 8 fp32 -> 8 bf16, rounded to nearest even as c10::BFloat16 rounds (a NaN stays a NaN).
inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Channels [0, 8) and [8, 16) of a row (lo, hi) rounded to bf16, the first `cols` stored.
inline void store_row16(at::BFloat16* out, __m256 lo, __m256 hi, int64_t cols) {
  if (cols >= 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), to_bf16x8(lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), to_bf16x8(hi));
    return;
  }
  alignas(16) at::BFloat16 row[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(row), to_bf16x8(lo));
  _mm_store_si128(reinterpret_cast<__m128i*>(row + 8), to_bf16x8(hi));
  std::copy(row, row + cols, out);
}

// MT (<= kAvx2FewRows) rows of fp32 x (row stride k) against NB blocks of 16 channels read from the
// packed panels (blocks k * 16 apart) over the whole K. One row keeps k even's and k odd's products
// apart (8 chains at NB = 2, 4 at NB = 1: with one chain for both, a k pair's two dependent FMAs set
// the pace, and one row of 3072 x 576 ran at 30 GB/s from L2 on one Zen 3 core, 48 apart).
template <int MT, int NB>
void avx2_few_rows(const float* x, int64_t k, const at::BFloat16* w, at::BFloat16* out, int64_t ldo, int64_t cols) {
  constexpr int P = MT == 1 ? 2 : 1;
  __m256 acc[MT][NB][2][P];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h)
        #pragma GCC unroll 8
        for (int p = 0; p < P; ++p) acc[i][j][h][p] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const int64_t k2 = k / 2;
  for (int64_t s = 0; s < k2; ++s) {
    __m256 e[NB][2], o[NB][2];
    #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j)
      #pragma GCC unroll 8
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * k * 16 + s * 32 + h * 16));
        e[j][h] = even_k(v), o[j][h] = odd_k(v, high);
      }
    #pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * k + 2 * s);
      const __m256 xo = _mm256_broadcast_ss(x + i * k + 2 * s + 1);
      #pragma GCC unroll 8
      for (int j = 0; j < NB; ++j)
        #pragma GCC unroll 8
        for (int h = 0; h < 2; ++h) {
          acc[i][j][h][0] = _mm256_fmadd_ps(xe, e[j][h], acc[i][j][h][0]);
          acc[i][j][h][P - 1] = _mm256_fmadd_ps(xo, o[j][h], acc[i][j][h][P - 1]);
        }
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MT; ++i)
    #pragma GCC unroll 8
    for (int j = 0; j < NB; ++j) {
      __m256 lo = acc[i][j][0][0], hi = acc[i][j][1][0];
      if constexpr (P == 2) lo = _mm256_add_ps(lo, acc[i][j][0][1]), hi = _mm256_add_ps(hi, acc[i][j][1][1]);
      if (cols - j * 16 > 0) store_row16(out + i * ldo + j * 16, lo, hi, cols - j * 16);
    }
}

// MT (<= 6) rows of fp32 x against one block's packed panel ([k / 2][16][2] bf16) over the whole K:
// the classic 6 x 16 fp32 tile (12 accumulators), each k pair's weights widened in registers (two
// 256-bit loads; k even's halves by a shift, then k odd's from the same lines by a mask).
template <int MT>
void avx2_packed_rows(const float* x, int64_t k, const at::BFloat16* w, at::BFloat16* out, int64_t ldo,
                      int64_t cols) {
  __m256 acc[MT][2];
  #pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t s = 0; s < k / 2; ++s) {
    const __m256i* words = reinterpret_cast<const __m256i*>(w + s * 32);
    const __m256 e0 = even_k(_mm256_loadu_si256(words)), e1 = even_k(_mm256_loadu_si256(words + 1));
    #pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * k + 2 * s);
      acc[i][0] = _mm256_fmadd_ps(xv, e0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, e1, acc[i][1]);
    }
    const __m256 o0 = odd_k(_mm256_loadu_si256(words), high), o1 = odd_k(_mm256_loadu_si256(words + 1), high);
    #pragma GCC unroll 8
    for (int i = 0; i < MT; ++i) {
      const __m256 xv = _mm256_broadcast_ss(x + i * k + 2 * s + 1);
      acc[i][0] = _mm256_fmadd_ps(xv, o0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xv, o1, acc[i][1]);
    }
  }
  #pragma GCC unroll 8
  for (int i = 0; i < MT; ++i) store_row16(out + i * ldo, acc[i][0], acc[i][1], cols);
}

// The full tile, as the loop above with its registers named: 12 accumulators, two weight vectors, a
// broadcast and the mask are AVX2's 16, and GCC 12 spilled an accumulator of the C++ loop to the
// stack (a store and a reload in two of its FMA chains every k pair: the tile at half speed).
template <>
void avx2_packed_rows<6>(const float* x, int64_t k, const at::BFloat16* w, at::BFloat16* out, int64_t ldo,
                         int64_t cols) {
  alignas(32) static const uint32_t kHigh[8] = {0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
                                                 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
  alignas(32) float acc[12][8];
  const float* x3 = x + 3 * k;
  const int64_t stride = k * 4;
  int64_t pairs = k / 2;
  asm volatile(
      "vxorps %%ymm0, %%ymm0, %%ymm0\n\t"
      "vxorps %%ymm1, %%ymm1, %%ymm1\n\t"
      "vxorps %%ymm2, %%ymm2, %%ymm2\n\t"
      "vxorps %%ymm3, %%ymm3, %%ymm3\n\t"
      "vxorps %%ymm4, %%ymm4, %%ymm4\n\t"
      "vxorps %%ymm5, %%ymm5, %%ymm5\n\t"
      "vxorps %%ymm6, %%ymm6, %%ymm6\n\t"
      "vxorps %%ymm7, %%ymm7, %%ymm7\n\t"
      "vxorps %%ymm8, %%ymm8, %%ymm8\n\t"
      "vxorps %%ymm9, %%ymm9, %%ymm9\n\t"
      "vxorps %%ymm10, %%ymm10, %%ymm10\n\t"
      "vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
      "vmovdqa %[high], %%ymm15\n\t"
      "test %[pairs], %[pairs]\n\t"
      "jle 2f\n\t"
      "1:\n\t"
      // k even: the words shifted up
      "vmovdqu (%[w]), %%ymm12\n\t"
      "vmovdqu 32(%[w]), %%ymm13\n\t"
      "vpslld $16, %%ymm12, %%ymm12\n\t"  // (AVX2's shift takes no memory operand: that form is EVEX)
      "vpslld $16, %%ymm13, %%ymm13\n\t"
      "vbroadcastss (%[x]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm0\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm1\n\t"
      "vbroadcastss (%[x], %[stride], 1), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm2\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm3\n\t"
      "vbroadcastss (%[x], %[stride], 2), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm4\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm5\n\t"
      "vbroadcastss (%[x3]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm6\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm7\n\t"
      "vbroadcastss (%[x3], %[stride], 1), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm8\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm9\n\t"
      "vbroadcastss (%[x3], %[stride], 2), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm10\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm11\n\t"
      // k odd: the words masked
      "vpand (%[w]), %%ymm15, %%ymm12\n\t"
      "vpand 32(%[w]), %%ymm15, %%ymm13\n\t"
      "vbroadcastss 4(%[x]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm0\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm1\n\t"
      "vbroadcastss 4(%[x], %[stride], 1), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm2\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm3\n\t"
      "vbroadcastss 4(%[x], %[stride], 2), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm4\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm5\n\t"
      "vbroadcastss 4(%[x3]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm6\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm7\n\t"
      "vbroadcastss 4(%[x3], %[stride], 1), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm8\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm9\n\t"
      "vbroadcastss 4(%[x3], %[stride], 2), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm10\n\t"
      "vfmadd231ps %%ymm13, %%ymm14, %%ymm11\n\t"
      "add $64, %[w]\n\t"
      "add $8, %[x]\n\t"
      "add $8, %[x3]\n\t"
      "dec %[pairs]\n\t"
      "jnz 1b\n\t"
      "2:\n\t"
      "vmovaps %%ymm0, (%[acc])\n\t"
      "vmovaps %%ymm1, 32(%[acc])\n\t"
      "vmovaps %%ymm2, 64(%[acc])\n\t"
      "vmovaps %%ymm3, 96(%[acc])\n\t"
      "vmovaps %%ymm4, 128(%[acc])\n\t"
      "vmovaps %%ymm5, 160(%[acc])\n\t"
      "vmovaps %%ymm6, 192(%[acc])\n\t"
      "vmovaps %%ymm7, 224(%[acc])\n\t"
      "vmovaps %%ymm8, 256(%[acc])\n\t"
      "vmovaps %%ymm9, 288(%[acc])\n\t"
      "vmovaps %%ymm10, 320(%[acc])\n\t"
      "vmovaps %%ymm11, 352(%[acc])\n\t"
      : [w] "+r"(w), [x] "+r"(x), [x3] "+r"(x3), [pairs] "+r"(pairs)
      : [stride] "r"(stride), [acc] "r"(acc), [high] "m"(kHigh)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
        "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory");
  #pragma GCC unroll 6
  for (int i = 0; i < 6; ++i)
    store_row16(out + i * ldo, _mm256_load_ps(acc[2 * i]), _mm256_load_ps(acc[2 * i + 1]), cols);
}

// Rows a chunk runs against one block: their fp32 x (~192 KiB) stays in the thread's L2 beside the
// block's packed panel.
inline int64_t avx2_row_block(int64_t k) { return std::max<int64_t>(6, (192 << 10) / (4 * k) / 6 * 6); }

// x widened to fp32 (threads take rows), then the chunks in row-block order, a contiguous share a
// thread (dynamic_for.h): (row block, block of 16 channels) for many rows, pairs of blocks for few.
void gemm_avx2(const at::BFloat16* x, const at::BFloat16* packed, at::BFloat16* out, int64_t m, int64_t k,
               int64_t n) {
  // Kept between calls (a fresh copy a call had the kernel zeroing new pages: ~5% of W1 on Zen 3).
  // The calling thread's buffer, reached through `xf` in every thread (a thread_local named inside
  // the lambdas would be each worker's own).
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(m * k)) buffer.resize(static_cast<size_t>(m * k));
  float* const xf = buffer.data();
  at::parallel_for(0, m, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo * k; i < hi * k; ++i) xf[i] = static_cast<float>(x[i]);
  });
  const int64_t blocks = (n + 15) / 16;
  if (m <= kAvx2FewRows) {
    // NB = 2 (two weight streams a thread) where the accumulators leave registers for it.
    const int64_t nb = m <= 2 ? 2 : 1, units = (blocks + nb - 1) / nb;
    dynamic_for(
        units, [] {},
        [&](int64_t c) {
          const int64_t b = nb * c, col = b * 16;
          const at::BFloat16* w = packed + b * k * 16;
          const bool two = nb == 2 && b + 1 < blocks;
          for (int64_t r = 0; r < m; r += 4) {
            const float* xr = xf + r * k;
            at::BFloat16* o = out + r * n + col;
            switch (std::min<int64_t>(4, m - r)) {
              case 1: two ? avx2_few_rows<1, 2>(xr, k, w, o, n, n - col) : avx2_few_rows<1, 1>(xr, k, w, o, n, n - col); break;
              case 2: two ? avx2_few_rows<2, 2>(xr, k, w, o, n, n - col) : avx2_few_rows<2, 1>(xr, k, w, o, n, n - col); break;
              case 3: avx2_few_rows<3, 1>(xr, k, w, o, n, n - col); break;
              default: avx2_few_rows<4, 1>(xr, k, w, o, n, n - col);
            }
          }
        },
        [] {});
    return;
  }
  const int64_t rows = avx2_row_block(k), row_blocks = (m + rows - 1) / rows;
  dynamic_for(
      row_blocks * blocks, [] {},
      [&](int64_t c) {
        const int64_t r0 = c / blocks * rows, r1 = std::min(m, r0 + rows), b = c % blocks, col = b * 16;
        const at::BFloat16* w = packed + b * k * 16;
        for (int64_t r = r0; r < r1; r += 6) {
          const float* xr = xf + r * k;
          at::BFloat16* o = out + r * n + col;
          switch (std::min<int64_t>(6, r1 - r)) {
            case 1: avx2_packed_rows<1>(xr, k, w, o, n, n - col); break;
            case 2: avx2_packed_rows<2>(xr, k, w, o, n, n - col); break;
            case 3: avx2_packed_rows<3>(xr, k, w, o, n, n - col); break;
            case 4: avx2_packed_rows<4>(xr, k, w, o, n, n - col); break;
            case 5: avx2_packed_rows<5>(xr, k, w, o, n, n - col); break;
            default: avx2_packed_rows<6>(xr, k, w, o, n, n - col);
          }
        }
      },
      [] {});
}
#endif

// x [M, K] and out [M, width] as both entry points take them.
void check_rows(const at::Tensor& x, const at::Tensor& out, const char* width) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
                    "x must be a contiguous 2-d bf16 CPU tensor");
  TORCH_CHECK_VALUE(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
                        out.size(0) == x.size(0),
                    "out must be a contiguous bf16 [M, ", width, "] tensor");
}

}  // namespace

bool bf16_gemm_available() {
#if defined(BATON_BF16_GEMM) || defined(BATON_BF16_GEMM_AVX2)
  return true;
#else
  return false;
#endif
}

bool has_avx512_bf16() {
#ifdef BATON_BF16_GEMM
  return true;
#else
  return false;
#endif
}

bool has_amx_bf16() {
#ifdef __AMX_BF16__
  return true;
#else
  return false;
#endif
}

// The machine's vdpbf16ps rate (the ceiling of every bf16 attention kernel here that does not use
// AMX): each thread runs `rounds` x 24 independent vdpbf16ps chains (24 hide the instruction's
// latency; 12 do not on Zen 4), 64 flops each. Returns GFLOP/s over all threads, 0 where the
// instruction was not compiled in.
double bf16_dot_peak_gflops(int64_t rounds) {
#ifdef BATON_BF16_GEMM
  constexpr int kChains = 24;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<float> sink(static_cast<size_t>(threads), 0.f);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      __m512 acc[kChains];
      for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
      const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
      const __m512bh b = a;  // each lane adds 2 a round: finite for any run here
      for (int64_t r = 0; r < rounds; ++r) {
#pragma GCC unroll 24
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      }
      float s = 0.f;
      for (int i = 0; i < kChains; ++i) s += _mm512_reduce_add_ps(acc[i]);
      sink[static_cast<size_t>(t)] = s;
    }
  });
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(rounds) * kChains * 64 * threads / sec / 1e9;
#else
  (void)rounds;
  return 0.0;
#endif
}

void bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& out) {
  check_rows(x, out, "N");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK_VALUE(k % 2 == 0, "bf16_gemm needs K even, got ", k);
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 3 &&
                        packed.size(0) == (n + 15) / 16 && packed.size(1) == k / 2 && packed.size(2) == 32,
                    "packed must be bf16 [ceil(N / 16), K / 2, 32] (bf16_gemm_pack)");
#ifdef BATON_BF16_GEMM
  if (m == 0) return;
#ifdef BATON_BF16_GEMM_AMX
  if (k % 32 == 0 && amx_ready()) {
    gemm_amx(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), m, k, n);
    return;
  }
#endif
  gemm(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), m, k, n);
#elif defined(BATON_BF16_GEMM_AVX2)
  if (m == 0) return;
  gemm_avx2(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), m, k, n);
#else
  TORCH_CHECK_VALUE(false, "bf16_gemm needs AVX512-BF16 or AVX2 (bf16_gemm_available() is false here)");
#endif
}

void bf16_gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& out,
                        const std::optional<at::Tensor>& scratch) {
  check_rows(x, out, "I");
  const int64_t m = x.size(0), k = x.size(1), inter = out.size(1);
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(0) == (2 * inter + 15) / 16,
                    "packed must be a [gate; up] product of 2 x ", inter, " outputs (bf16_gemm_pack)");
#ifdef BATON_BF16_GEMM_AMX
  if (m > 0 && k % 32 == 0 && inter % 16 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
      packed.size(1) == k / 2 && packed.size(2) == 32 && amx_ready()) {
    gemm_amx_silu_mul(x.data_ptr<at::BFloat16>(), packed.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), m,
                      k, inter);
    return;
  }
#endif
  // Elsewhere the two kernels in turn (the same bits), the product in `scratch` where it is given.
  const bool fits = scratch.has_value() && scratch->is_contiguous() && scratch->scalar_type() == at::kBFloat16 &&
                    scratch->numel() >= m * 2 * inter;
  const at::Tensor gate_up =
      fits ? scratch->view(-1).narrow(0, 0, m * 2 * inter).view({m, 2 * inter}) : at::empty({m, 2 * inter}, x.options());
  bf16_gemm(x, packed, gate_up);
  silu_mul(gate_up, out);
}
