// The portable attention loops' chunk on AVX2 (decode_loop.h's and prefill_loop.h's, for D 64
// and 128; where no AVX2 loop of its own serves: decode with G > 4, cascade's shared pass): up to
// 8 keys of one block widened to fp32 once for all the query rows that read them, each row's 8
// scores in one vector (vec8.h's reduction tree of hadds), their exps in one 8-lane SLEEF expf
// (sleef_exp.h), V accumulated 8 dims a vector. Without it, on a 2-core AVX2-only EPYC,
// W1 spent ~17% of its samples in the scalar decode loop and batch-1 ran 7-10% slower.
//
// In an anonymous namespace, as attention_common.h: each translation unit gets its own copy.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "sleef_exp.h"
#include "vec8.h"

#ifdef BATON_VEC8
namespace {

// n (<= 8) tokens, rows D apart, against G heads' fp32 q ([G][D]) and state (acc [G][D], m, l).
template <int D, typename T>
void attend_chunk_avx2(const T* kchunk, const T* vchunk, int64_t n, const float* qf, int64_t G, float scale,
                       float* acc, float* m, float* l) {
  constexpr int V = D / 8;
  alignas(32) float kf[8][D];
  alignas(32) float vf[8][D];
  for (int64_t j = 0; j < n; ++j)
    for (int v = 0; v < V; ++v) {
      _mm256_store_ps(kf[j] + 8 * v, widen8(kchunk + j * D + 8 * v));
      _mm256_store_ps(vf[j] + 8 * v, widen8(vchunk + j * D + 8 * v));
    }
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 live = _mm256_cmp_ps(lanes, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    __m256 part[8];
    for (int j = 0; j < 8; ++j) {
      __m256 a = _mm256_setzero_ps();
      if (j < n)
        for (int v = 0; v < V; ++v) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * v), _mm256_load_ps(kf[j] + 8 * v), a);
      part[j] = a;
    }
    const __m256 s = _mm256_blendv_ps(ninf, _mm256_mul_ps(sum8x8(part), _mm256_set1_ps(scale)), live);
    const float m_new = std::max(m[g], hmax8(s));
    const float alpha = std::exp(m[g] - m_new);
    alignas(32) float pe[8];
    const __m256 e = sleef_expf8(_mm256_sub_ps(s, _mm256_set1_ps(m_new)));
    _mm256_store_ps(pe, e);
    l[g] = l[g] * alpha + hsum8(e);
    m[g] = m_new;
    float* ag = acc + g * D;
    const __m256 al = _mm256_set1_ps(alpha);
    for (int v = 0; v < V; ++v) {
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(ag + 8 * v), al);
      for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(pe[j]), _mm256_load_ps(vf[j] + 8 * v), a);
      _mm256_storeu_ps(ag + 8 * v, a);
    }
  }
}


// Keys [t, end) of a paged (sequence, kv head) (block table bt; rows D apart inside a block) in
// chunks of up to 8 that do not cross a block. Returns false, doing nothing, where D is not one
// this chunk is compiled for (the caller runs its portable loop).
template <typename T>
bool attend_keys_avx2(const T* kbase, const T* vbase, const int32_t* bt, int64_t k_bstride, int64_t v_bstride,
                      int64_t bs, int64_t D, int64_t t, int64_t end, const float* qf, int64_t G, float scale,
                      float* acc, float* m, float* l) {
  if (D != 64 && D != 128) return false;
  while (t < end) {
    const int64_t blk = bt[t / bs], off = t % bs;
    const int64_t n = std::min({int64_t{8}, bs - off, end - t});
    const T* k8 = kbase + blk * k_bstride + off * D;
    const T* v8 = vbase + blk * v_bstride + off * D;
    if (D == 64) attend_chunk_avx2<64>(k8, v8, n, qf, G, scale, acc, m, l);
    else attend_chunk_avx2<128>(k8, v8, n, qf, G, scale, acc, m, l);
    t += n;
  }
  return true;
}

}  // namespace
#endif
