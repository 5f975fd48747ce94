// Quantized-weight helpers for the CPU GEMM path (baton.common.model.quant): the passes around
// an int8 or fp8 product that torch would run as several elementwise ops, each one pass here.
//
// int8_quantize_rows: dynamic per-token symmetric int8 of activations (the W8A8 input), codes in
//   [-qmax, qmax], as int8 or as uint8 codes + qmax + 1 (zero point 128 for qmax 127: the form
//   oneDNN's VNNI int8 GEMM takes; with int8 activations it falls back to its scalar reference
//   kernel, ~1000x slower). qmax 63 keeps uint8 codes under 128, where a CPU without VNNI
//   multiplies them with vpmaddubsw, whose int16 pair sums saturate above 127 x 127 x 2.
// int8_scale_output: the int32 product times the token's and the channel's scale (its output).
// int8_scale_rows: oneDNN's fp32 product (channel scales applied) times the token's scale, cast to
//   the output dtype: one pass where torch would run a multiply and a copy.
// fp8_widen: e4m3 codes to bf16/fp32 through a 256-entry table (torch converts element by element).
// int8_gemm: the whole W8A8 product for the row counts of decode steps, on AVX512-VNNI: the rows
//   quantized (uint8 + 128), vpdpbusd over a weight packed 16 output channels x 4 k per 64 bytes,
//   the zero point taken out with the weight's column sums, both scales applied on the way out.
//   oneDNN's qlinear_pointwise spends more on set-up, the separate quantize and scale passes than
//   on the product itself at these sizes (a decode step's projections, 1-128 rows).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "ops.h"

namespace {

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// Codes in [-qmax, qmax]; offset is added to each (wrapping): 0 stores the int8 code, qmax + 1
// the uint8 one (code + 128 for qmax 127: the sign bit flipped).
template <typename T>
void quantize_row_avx512(const T* row, int8_t* out, float* scale_out, int64_t k, int qmax, int8_t offset) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 vmax = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, load16(row + j)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(row[j])));
  const float fmax = static_cast<float>(qmax);
  const float scale = std::max(amax / fmax, 1e-12f);
  const float inv = 1.f / scale;
  *scale_out = scale;
  const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(fmax), lo = _mm512_set1_ps(-fmax);
  const __m128i voff = _mm_set1_epi8(offset);
  for (j = 0; j + 16 <= k; j += 16) {
    __m512 q = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(load16(row + j), vinv)));
    // cvtps rounds half to even (the default MXCSR mode), as torch.round does.
    __m128i c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm_add_epi8(c, voff));
  }
  for (; j < k; ++j) {
    float q = std::min(fmax, std::max(-fmax, static_cast<float>(row[j]) * inv));
    out[j] = static_cast<int8_t>(static_cast<uint8_t>(static_cast<int>(std::nearbyint(q)) + offset));
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int8_t* codes, float* scales, int64_t m, int64_t k, int qmax, int8_t offset) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x + i * k;
      int8_t* out = codes + i * k;
#ifdef __AVX512F__
      quantize_row_avx512(row, out, scales + i, k, qmax, offset);
#else
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(row[j])));
      // As the torch reference: scale = max(amax / qmax, 1e-12), codes = round_half_even(x * (1 / scale)).
      const float fmax = static_cast<float>(qmax);
      const float scale = std::max(amax / fmax, 1e-12f);
      const float inv = 1.f / scale;
      scales[i] = scale;
      for (int64_t j = 0; j < k; ++j) {
        float q = std::min(fmax, std::max(-fmax, static_cast<float>(row[j]) * inv));
        out[j] = static_cast<int8_t>(static_cast<uint8_t>(static_cast<int>(std::nearbyint(q)) + offset));
      }
#endif
    }
  });
}

template <typename T>
void scale_output(const int32_t* acc, const float* rs, const float* cs, T* out, int64_t m, int64_t n) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float r = rs[i];
      for (int64_t j = 0; j < n; ++j) {
        // (acc * r) * c, in that order, as the torch reference rounds.
        out[i * n + j] = static_cast<T>(static_cast<float>(acc[i * n + j]) * r * cs[j]);
      }
    }
  });
}

template <typename T>
void scale_rows(const float* acc, const float* rs, T* out, int64_t m, int64_t n) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float r = rs[i];
      const float* a = acc + i * n;
      T* o = out + i * n;
      for (int64_t j = 0; j < n; ++j) o[j] = static_cast<T>(a[j] * r);
    }
  });
}

template <typename T>
void widen(const uint8_t* codes, T* out, int64_t numel) {
  T table[256];
  for (int c = 0; c < 256; ++c) {
    table[c] = static_cast<T>(static_cast<float>(c10::bit_cast<c10::Float8_e4m3fn>(static_cast<uint8_t>(c))));
  }
  at::parallel_for(0, numel, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = table[codes[i]];
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kMaxRowTile = 4;  // rows x column blocks of 16 accumulators: 16 of 32 zmm registers
constexpr int kMaxColTile = 4;

inline void store_row(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_row(at::BFloat16* p, __m512 v, __mmask16 m) {
#if defined(__AVX512BF16__)
  // vcvtneps2bf16 rounds to nearest even as c10 does, but flushes denormals and keeps NaN
  // payloads: a vector holding one of those (rare) takes c10's scalar conversion.
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, kNanOrDenormal) == 0, 1)) {
    _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    return;
  }
#endif
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int l = 0; l < 16; ++l)
    if (m >> l & 1) p[l] = static_cast<at::BFloat16>(tmp[l]);
}

// One tile: MT rows x NT blocks of 16 output channels over the whole K. codes: the tile's first
// row (uint8, row stride k); w: the first block's packed panel ([k / 4][16][4] int8 per block).
template <int MT, int NT, typename T>
void gemm_tile(const uint8_t* codes, const float* row_scales, int64_t k, const int8_t* w,
               const int32_t* col_sums, const float* col_scales, T* out, int64_t ldo, int64_t cols) {
  const int64_t k4 = k / 4;
  __m512i acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_si512();
  const int32_t* x[MT];
  for (int i = 0; i < MT; ++i) x[i] = reinterpret_cast<const int32_t*>(codes + i * k);
  for (int64_t s = 0; s < k4; ++s) {
    __m512i wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = _mm512_loadu_si512(w + (j * k4 + s) * 64);
    for (int i = 0; i < MT; ++i) {
      const __m512i a = _mm512_set1_epi32(x[i][s]);  // 4 codes of row i, k = 4s .. 4s + 3
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], a, wv[j]);
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int64_t left = cols - j * 16;
    const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
    // sum (q + 128) w = sum q w + 128 sum w: the column sums take the zero point back out.
    const __m512i zp = _mm512_slli_epi32(_mm512_loadu_si512(col_sums + j * 16), 7);
    const __m512 cs = _mm512_maskz_loadu_ps(mask, col_scales + j * 16);
    for (int i = 0; i < MT; ++i) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], zp));
      // (acc * row) * column, in that order, as int8_scale_output and the torch reference round.
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(row_scales[i])), cs);
      store_row(out + i * ldo + j * 16, y, mask);
    }
  }
}

template <int MT, typename T>
void gemm_row_tile(int nt, const uint8_t* codes, const float* rs, int64_t k, const int8_t* w,
                   const int32_t* sums, const float* cs, T* out, int64_t ldo, int64_t cols) {
  switch (nt) {
    case 1: return gemm_tile<MT, 1>(codes, rs, k, w, sums, cs, out, ldo, cols);
    case 2: return gemm_tile<MT, 2>(codes, rs, k, w, sums, cs, out, ldo, cols);
    case 3: return gemm_tile<MT, 3>(codes, rs, k, w, sums, cs, out, ldo, cols);
    default: return gemm_tile<MT, 4>(codes, rs, k, w, sums, cs, out, ldo, cols);
  }
}

template <typename T>
void gemm(const T* x, const int8_t* packed, const int32_t* sums, const float* cs, T* out, int64_t m,
          int64_t k, int64_t n) {
  std::vector<uint8_t> codes(static_cast<size_t>(m * k));
  std::vector<float> rs(static_cast<size_t>(m));
  quantize_rows(x, reinterpret_cast<int8_t*>(codes.data()), rs.data(), m, k, 127, static_cast<int8_t>(0x80));
  const int64_t blocks = (n + 15) / 16;
  const int64_t tiles = (blocks + kMaxColTile - 1) / kMaxColTile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b0 = t * kMaxColTile;
      const int nt = static_cast<int>(std::min<int64_t>(kMaxColTile, blocks - b0));
      const int8_t* w = packed + b0 * k * 16;
      const int64_t col = b0 * 16;
      // Every row tile reads the same panel (at most 4 x 16 x k bytes): from L2 after the first.
      for (int64_t r = 0; r < m; r += kMaxRowTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kMaxRowTile, m - r));
        const uint8_t* c = codes.data() + r * k;
        T* o = out + r * n + col;
        switch (mt) {
          case 1: gemm_row_tile<1>(nt, c, rs.data() + r, k, w, sums + col, cs + col, o, n, n - col); break;
          case 2: gemm_row_tile<2>(nt, c, rs.data() + r, k, w, sums + col, cs + col, o, n, n - col); break;
          case 3: gemm_row_tile<3>(nt, c, rs.data() + r, k, w, sums + col, cs + col, o, n, n - col); break;
          default: gemm_row_tile<4>(nt, c, rs.data() + r, k, w, sums + col, cs + col, o, n, n - col);
        }
      }
    }
  });
}
#endif

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name,
                    " must be a contiguous 2-d CPU tensor");
}

}  // namespace

void int8_quantize_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t qmax) {
  check_2d(x, "x");
  check_2d(codes, "codes");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE((codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte) &&
                        codes.size(0) == m && codes.size(1) == k,
                    "codes must be int8 or uint8 of x's shape");
  TORCH_CHECK_VALUE(qmax >= 1 && qmax <= 127, "qmax must be in [1, 127], got ", qmax);
  // uint8 codes are the int8 ones + qmax + 1 (zero point qmax + 1): all in [1, 2 qmax + 1].
  const int8_t offset = codes.scalar_type() == at::kByte ? static_cast<int8_t>(static_cast<uint8_t>(qmax + 1)) : 0;
  auto* out = static_cast<int8_t*>(codes.data_ptr());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == m,
                    "scales must be fp32 with one per row");
  const int q = static_cast<int>(qmax);
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), out, scales.data_ptr<float>(), m, k, q, offset);
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
    quantize_rows(x.data_ptr<float>(), out, scales.data_ptr<float>(), m, k, q, offset);
  }
}

void int8_scale_output(const at::Tensor& acc, const at::Tensor& row_scales,
                       const at::Tensor& col_scales, const at::Tensor& out) {
  check_2d(acc, "acc");
  check_2d(out, "out");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kInt, "acc must be int32");
  TORCH_CHECK_VALUE(out.size(0) == m && out.size(1) == n, "out must have acc's shape");
  TORCH_CHECK_VALUE(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
                        row_scales.numel() == m,
                    "row_scales must be fp32 with one per row");
  TORCH_CHECK_VALUE(col_scales.scalar_type() == at::kFloat && col_scales.is_contiguous() &&
                        col_scales.numel() == n,
                    "col_scales must be fp32 with one per column");
  const int32_t* a = acc.data_ptr<int32_t>();
  const float* rs = row_scales.data_ptr<float>();
  const float* cs = col_scales.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16) {
    scale_output(a, rs, cs, out.data_ptr<at::BFloat16>(), m, n);
  } else {
    TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat, "out must be bf16 or fp32");
    scale_output(a, rs, cs, out.data_ptr<float>(), m, n);
  }
}

void int8_scale_rows(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& out) {
  check_2d(acc, "acc");
  check_2d(out, "out");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kFloat, "acc must be fp32");
  TORCH_CHECK_VALUE(out.size(0) == m && out.size(1) == n, "out must have acc's shape");
  TORCH_CHECK_VALUE(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
                        row_scales.numel() == m,
                    "row_scales must be fp32 with one per row");
  const float* a = acc.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  if (out.scalar_type() == at::kBFloat16) {
    scale_rows(a, rs, out.data_ptr<at::BFloat16>(), m, n);
  } else {
    // fp32 out may be acc itself (in place): each element is read once, then written.
    TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat, "out must be bf16 or fp32");
    scale_rows(a, rs, out.data_ptr<float>(), m, n);
  }
}

void fp8_widen(const at::Tensor& codes, const at::Tensor& out) {
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kFloat8_e4m3fn && codes.is_contiguous() &&
                        codes.device().is_cpu(),
                    "codes must be contiguous float8_e4m3fn on the CPU");
  TORCH_CHECK_VALUE(out.is_contiguous() && out.sizes() == codes.sizes(), "out must have codes' shape");
  const auto* c = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  if (out.scalar_type() == at::kBFloat16) {
    widen(c, out.data_ptr<at::BFloat16>(), codes.numel());
  } else {
    TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat, "out must be bf16 or fp32");
    widen(c, out.data_ptr<float>(), codes.numel());
  }
}

bool int8_gemm_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

void int8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& col_sums,
               const at::Tensor& col_scales, const at::Tensor& out) {
  check_2d(x, "x");
  check_2d(out, "out");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t blocks = (n + 15) / 16;
  TORCH_CHECK_VALUE(k % 4 == 0, "int8_gemm needs K a multiple of 4, got ", k);
  TORCH_CHECK_VALUE(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 3 &&
                        packed.size(0) == blocks && packed.size(1) == k / 4 && packed.size(2) == 64,
                    "packed must be int8 [ceil(N / 16), K / 4, 64] (int8_gemm_pack)");
  TORCH_CHECK_VALUE(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() &&
                        col_sums.numel() == blocks * 16,
                    "col_sums must be int32 [ceil(N / 16) * 16]");
  TORCH_CHECK_VALUE(col_scales.scalar_type() == at::kFloat && col_scales.is_contiguous() &&
                        col_scales.numel() == n,
                    "col_scales must be fp32 with one per output column");
  TORCH_CHECK_VALUE(out.size(0) == m && out.scalar_type() == x.scalar_type(),
                    "out must be [M, N] in x's dtype");
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const auto* w = packed.data_ptr<int8_t>();
  const auto* sums = col_sums.data_ptr<int32_t>();
  const auto* cs = col_scales.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    gemm(x.data_ptr<at::BFloat16>(), w, sums, cs, out.data_ptr<at::BFloat16>(), m, k, n);
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
    gemm(x.data_ptr<float>(), w, sums, cs, out.data_ptr<float>(), m, k, n);
  }
#else
  TORCH_CHECK_VALUE(false, "int8_gemm needs AVX512-VNNI (int8_gemm_available() is false here)");
#endif
}
