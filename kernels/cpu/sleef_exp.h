// SLEEF's expf_u10 (the exp of torch's Vectorized<float>) in scalar, 8-lane (AVX2) and 16-lane forms, and silu
// as torch's vectorized kernel computes it, for the kernels that must give torch's bits:
// fused_ops.cpp (silu_mul) and bf16_gemm.cpp (the gate/up product with silu_mul in its epilogue).
//
// In an anonymous namespace, as vec16.h: each translation unit gets its own copy.

#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec16.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// SLEEF's xexpf (expf_u10), the exp of torch's Vectorized<float>, step by step. d*R_LN2 is rounded
// to the nearest integer (ties to even, as cvtps2dq), the fmas are fused.
constexpr float kR_LN2f = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float kL2Uf = 0.693145751953125f;
constexpr float kL2Lf = 1.428606765330187045e-06f;
constexpr float kExpC0 = 0.000198527617612853646278381f;
constexpr float kExpC1 = 0.00139304355252534151077271f;
constexpr float kExpC2 = 0.00833336077630519866943359f;
constexpr float kExpC3 = 0.0416664853692054748535156f;
constexpr float kExpC4 = 0.166666671633720397949219f;
constexpr float kExpC5 = 0.5f;

inline float pow2i(int32_t q) {
  const uint32_t u = static_cast<uint32_t>(q + 0x7f) << 23;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline float sleef_expf(float d) {
  if (std::isnan(d)) return d;
  if (d < -104.f) return 0.f;
  if (d > 100.f) return std::numeric_limits<float>::infinity();
  const int32_t q = static_cast<int32_t>(std::nearbyint(d * kR_LN2f));
  const float qf = static_cast<float>(q);
  float s = std::fma(qf, -kL2Uf, d);
  s = std::fma(qf, -kL2Lf, s);
  float u = kExpC0;
  u = std::fma(u, s, kExpC1);
  u = std::fma(u, s, kExpC2);
  u = std::fma(u, s, kExpC3);
  u = std::fma(u, s, kExpC4);
  u = std::fma(u, s, kExpC5);
  u = 1.f + std::fma(s * s, u, s);
  const int32_t q1 = q >> 1;
  return u * pow2i(q1) * pow2i(q - q1);
}

#if defined(__AVX2__) && defined(__FMA__)
// SLEEF expf_u10 (see sleef_expf), 8 lanes: 0 below -104 (-inf included), inf above 100.
inline __m256 sleef_expf8(__m256 d) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(kR_LN2f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-kL2Uf), d);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-kL2Lf), s);
  __m256 u = _mm256_set1_ps(kExpC0);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kExpC1));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kExpC2));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kExpC3));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kExpC4));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(kExpC5));
  u = _mm256_add_ps(_mm256_set1_ps(1.f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  // u * 2^(q>>1) * 2^(q - (q>>1)), as sleef_expf
  const __m256i q1 = _mm256_srai_epi32(q, 1), q2 = _mm256_sub_epi32(q, q1);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, _mm256_set1_epi32(0x7f)), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, _mm256_set1_epi32(0x7f)), 23));
  u = _mm256_mul_ps(_mm256_mul_ps(u, p1), p2);
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.f), _CMP_LT_OQ), u);
  return _mm256_blendv_ps(u, _mm256_set1_ps(std::numeric_limits<float>::infinity()),
                          _mm256_cmp_ps(d, _mm256_set1_ps(100.f), _CMP_GT_OQ));
}
#endif

#ifdef BATON_VEC16
// 16 lanes rounded to the model dtype and back (bf16: as to_bf16 rounds; fp32: unchanged).
template <typename T>
inline __m512 round_to16(__m512 v) { return v; }
template <>
inline __m512 round_to16<c10::BFloat16>(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// SLEEF expf_u10 (see sleef_expf), 16 lanes.
inline __m512 sleef_expf16(__m512 d) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(kR_LN2f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-kL2Uf), d);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-kL2Lf), s);
  __m512 u = _mm512_set1_ps(kExpC0);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC1));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC2));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC3));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC4));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(kExpC5));
  u = _mm512_add_ps(_mm512_set1_ps(1.f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  // SLEEF: u * 2^(q>>1) * 2^(q - (q>>1)). The first product is exact (|q>>1| <= 75 keeps it
  // normal), so this is u * 2^q rounded once, which vscalefps computes directly.
  u = _mm512_scalef_ps(u, qf);
  // Outside [-104, 100] (or NaN) SLEEF returns 0 / inf / NaN; rare, so checked with one compare.
  const __mmask16 wide = _mm512_cmp_ps_mask(_mm512_abs_ps(d), _mm512_set1_ps(100.f), _CMP_NLE_UQ);
  if (__builtin_expect(wide != 0, 0)) {
    const __mmask16 under = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ);
    u = _mm512_mask_mov_ps(u, under, _mm512_setzero_ps());
    const __mmask16 over = _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ);
    u = _mm512_mask_mov_ps(u, over, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  }
  return u;
}

// out = silu(gate) * up for 16 lanes, silu rounded to T first as the eager ops do (the caller
// rounds the product when it stores it).
template <typename T>
inline __m512 silu_mul16(__m512 g, __m512 up) {
  const __m512 e = sleef_expf16(_mm512_xor_ps(g, _mm512_set1_ps(-0.f)));
  return _mm512_mul_ps(round_to16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e))), up);
}
#endif  // BATON_VEC16

}  // namespace
