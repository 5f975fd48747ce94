// Quantized-weight helpers for the CPU GEMM path (baton.common.model.quant): the passes around
// an int8 or fp8 product that torch would run as several elementwise ops, each one pass here.
//
// int8_quantize_rows: dynamic per-token symmetric int8 of activations (the W8A8 input), as int8
//   codes or as uint8 codes + 128 (zero point 128: the form oneDNN's VNNI int8 GEMM takes; with
//   int8 activations it falls back to its scalar reference kernel, ~1000x slower).
// int8_scale_output: the int32 product times the token's and the channel's scale (its output).
// int8_scale_rows: oneDNN's fp32 product (channel scales applied) times the token's scale, cast to
//   the output dtype: one pass where torch would run a multiply and a copy.
// fp8_widen: e4m3 codes to bf16/fp32 through a 256-entry table (torch converts element by element).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  // bf16 is the top half of an fp32: widen and shift.
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// flip = 0x80 stores code + 128 as uint8 (the sign bit flipped), flip = 0 the int8 code.
template <typename T>
void quantize_row_avx512(const T* row, int8_t* out, float* scale_out, int64_t k, int8_t flip) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  __m512 vmax = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) vmax = _mm512_max_ps(vmax, _mm512_andnot_ps(sign, load16(row + j)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(row[j])));
  const float scale = std::max(amax / 127.f, 1e-12f);
  const float inv = 1.f / scale;
  *scale_out = scale;
  const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  const __m128i vflip = _mm_set1_epi8(flip);
  for (j = 0; j + 16 <= k; j += 16) {
    __m512 q = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_mul_ps(load16(row + j), vinv)));
    // cvtps rounds half to even (the default MXCSR mode), as torch.round does.
    __m128i c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm_xor_si128(c, vflip));
  }
  for (; j < k; ++j) {
    float q = std::min(127.f, std::max(-127.f, static_cast<float>(row[j]) * inv));
    out[j] = static_cast<int8_t>(static_cast<int8_t>(std::nearbyint(q)) ^ flip);
  }
}
#endif

template <typename T>
void quantize_rows(const T* x, int8_t* codes, float* scales, int64_t m, int64_t k, int8_t flip) {
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = x + i * k;
      int8_t* out = codes + i * k;
#ifdef __AVX512F__
      quantize_row_avx512(row, out, scales + i, k, flip);
#else
      float amax = 0.f;
      for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(static_cast<float>(row[j])));
      // As the torch reference: scale = max(amax / 127, 1e-12), codes = round_half_even(x * (1 / scale)).
      const float scale = std::max(amax / 127.f, 1e-12f);
      const float inv = 1.f / scale;
      scales[i] = scale;
      for (int64_t j = 0; j < k; ++j) {
        float q = std::min(127.f, std::max(-127.f, static_cast<float>(row[j]) * inv));
        out[j] = static_cast<int8_t>(static_cast<int8_t>(std::nearbyint(q)) ^ flip);
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

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name,
                    " must be a contiguous 2-d CPU tensor");
}

}  // namespace

void int8_quantize_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_2d(x, "x");
  check_2d(codes, "codes");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE((codes.scalar_type() == at::kChar || codes.scalar_type() == at::kByte) &&
                        codes.size(0) == m && codes.size(1) == k,
                    "codes must be int8 or uint8 of x's shape");
  // uint8 codes are the int8 ones + 128: flipping the sign bit of a two's-complement byte adds 128.
  const int8_t flip = codes.scalar_type() == at::kByte ? static_cast<int8_t>(0x80) : 0;
  auto* out = static_cast<int8_t*>(codes.data_ptr());
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == m,
                    "scales must be fp32 with one per row");
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows(x.data_ptr<at::BFloat16>(), out, scales.data_ptr<float>(), m, k, flip);
  } else {
    TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat, "x must be bf16 or fp32");
    quantize_rows(x.data_ptr<float>(), out, scales.data_ptr<float>(), m, k, flip);
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
