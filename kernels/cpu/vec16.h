// 16 fp32 lanes of a row of float or bf16, for the elementwise kernels (fused_ops.cpp, kv_quant.cpp,
// row_topk.cpp): masked loads (bf16 widened exactly) and stores (bf16 rounded to nearest even with
// c10's bits: NaN -> 0x7fc0, denormals kept); a tail's lanes are attention_common.h's prefix_mask.
//
// In an anonymous namespace, as attention_common.h: each translation unit gets its own copy.

#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "attention_common.h"  // prefix_mask: the first n lanes

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BATON_VEC16 1

namespace {

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 -> bf16 bits in the low half of each lane, round to nearest even, NaN -> 0x7fc0 (c10's).
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

// fp32 -> 16 packed bf16. vcvtneps2bf16 rounds to nearest even too, but flushes denormals to zero
// and keeps NaN payloads: lanes of those classes (rare) take the integer path, c10's bits.
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // QNaN | denormal | SNaN
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, kNanOrDenormal) == 0, 1))
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
  return _mm512_cvtepi32_epi16(bf16_bits(v));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16(v)); }

}  // namespace
#endif
