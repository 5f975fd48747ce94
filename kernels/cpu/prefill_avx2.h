// Paged prefill attention's loop on AVX2 (no AVX-512), for D 64 and 128: a register-blocked tile
// of 6 query rows x 16 keys, as an fp32 GEMM micro-kernel is (12 accumulators, two key vectors and
// one broadcast query value in the 16 ymm registers). Per 16-key chunk: S = Q K^T (6 x 16, q
// pre-scaled), the causal mask where a row's position ends inside the chunk, the online softmax
// per row (SLEEF's expf, 8 lanes), then O = O * alpha + P V over the chunk's 16 keys, 16 output
// dims (two vectors) of the 6 rows at a time, O in an L1-resident fp32 buffer (6 x D).
// The K/V of a (sequence, kv head) are widened to fp32 once per thread, 16 keys a chunk: K as
// [D][16] (the chunk's keys side by side, one row per dim), V as [16][D]; keys past the context
// are zeros (so that a masked key's probability, 0, never meets a NaN).
// The row-at-a-time loop this replaces (attention_avx2.h's chunk for one row) re-widened each key
// for every query row and reduced every score across lanes: ~25 GFLOP/s on a 2-core Zen 3, where
// the GEMMs reach 110-145.
//
// In an anonymous namespace, as attention_common.h: each translation unit gets its own copy.

#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "sleef_exp.h"
#include "vec8.h"

#ifdef BATON_VEC8
namespace {

constexpr int kTileKeys = 16;  // keys per packed chunk
constexpr int kTileRows = 6;   // query rows per register tile

// Chunk c (keys 16c..16c+15) of a paged (sequence, kv head) widened to fp32: kt [D][16], vr [16][D].
template <int D, typename T>
inline void pack_chunk_avx2(const T* kbase, const T* vbase, const int32_t* bt, int64_t k_bstride,
                            int64_t v_bstride, int64_t bs, int64_t ctx, int64_t c, float* kt,
                            float* vr) {
  alignas(32) float krow[D];
  for (int j = 0; j < kTileKeys; ++j) {
    const int64_t t = c * kTileKeys + j;
    if (t >= ctx) {
      for (int d = 0; d < D; ++d) kt[d * kTileKeys + j] = 0.f;
      for (int v = 0; v < D / 8; ++v) _mm256_store_ps(vr + j * D + 8 * v, _mm256_setzero_ps());
      continue;
    }
    const int64_t blk = bt[t / bs], off = t % bs;
    const T* k = kbase + blk * k_bstride + off * D;
    const T* v = vbase + blk * v_bstride + off * D;
    for (int u = 0; u < D / 8; ++u) {
      _mm256_store_ps(krow + 8 * u, widen8(k + 8 * u));
      _mm256_store_ps(vr + j * D + 8 * u, widen8(v + 8 * u));
    }
    for (int d = 0; d < D; ++d) kt[d * kTileKeys + j] = krow[d];
  }
}

// Six query rows (pos[r]: row r sees keys 0..pos[r]; qrow/orow: its q and out rows; rows past n
// repeat row n - 1 and are not written) against the packed chunks kp / vp (16 * D floats each).
template <int D, typename T>
void rows_avx2(float scale, int n, const int64_t* pos, const T* const* qrow, T* const* orow,
               const float* kp, const float* vp) {
  constexpr int R = kTileRows;
  alignas(32) float q[R][D];
  alignas(32) float o[R][D];
  alignas(32) float pr[R][kTileKeys];
  float m[R], l[R], alpha[R];
  const __m256 sc = _mm256_set1_ps(scale);
  int64_t lo = pos[0], hi = pos[0];
  for (int r = 0; r < R; ++r) {
    for (int u = 0; u < D / 8; ++u) {
      _mm256_store_ps(q[r] + 8 * u, _mm256_mul_ps(widen8(qrow[r] + 8 * u), sc));
      _mm256_store_ps(o[r] + 8 * u, _mm256_setzero_ps());
    }
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
    lo = std::min(lo, pos[r]);
    hi = std::max(hi, pos[r]);
  }
  const int64_t chunks = hi / kTileKeys + 1;
  const int64_t open = (lo + 1) / kTileKeys;  // chunks before this one: every key seen by every row
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t c = 0; c < chunks; ++c) {
    const float* kc = kp + c * kTileKeys * D;
    const float* vc = vp + c * kTileKeys * D;
    __m256 s[R][2];
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int d = 0; d < D; ++d) {
      const __m256 b0 = _mm256_load_ps(kc + d * kTileKeys);
      const __m256 b1 = _mm256_load_ps(kc + d * kTileKeys + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(q[r] + d);
        s[r][0] = _mm256_fmadd_ps(a, b0, s[r][0]);
        s[r][1] = _mm256_fmadd_ps(a, b1, s[r][1]);
      }
    }
    if (c >= open) {  // a row's position ends in this chunk: keys past it are masked
      const __m256 k0 = _mm256_add_ps(lanes, _mm256_set1_ps(static_cast<float>(c * kTileKeys)));
      const __m256 k1 = _mm256_add_ps(k0, _mm256_set1_ps(8.f));
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_set1_ps(static_cast<float>(pos[r]));
        s[r][0] = _mm256_blendv_ps(ninf, s[r][0], _mm256_cmp_ps(k0, p, _CMP_LE_OQ));
        s[r][1] = _mm256_blendv_ps(ninf, s[r][1], _mm256_cmp_ps(k1, p, _CMP_LE_OQ));
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const float m_new = std::max(m[r], hmax8(_mm256_max_ps(s[r][0], s[r][1])));
      alpha[r] = m_new > m[r] ? sleef_expf(m[r] - m_new) : 1.f;
      const __m256 mv = _mm256_set1_ps(m_new);
      const __m256 e0 = sleef_expf8(_mm256_sub_ps(s[r][0], mv));
      const __m256 e1 = sleef_expf8(_mm256_sub_ps(s[r][1], mv));
      _mm256_store_ps(pr[r], e0);
      _mm256_store_ps(pr[r] + 8, e1);
      l[r] = l[r] * alpha[r] + hsum8(_mm256_add_ps(e0, e1));
      m[r] = m_new;
    }
    for (int u = 0; u < D / 16; ++u) {
      __m256 acc[R][2];
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 al = _mm256_set1_ps(alpha[r]);
        acc[r][0] = _mm256_mul_ps(_mm256_load_ps(o[r] + 16 * u), al);
        acc[r][1] = _mm256_mul_ps(_mm256_load_ps(o[r] + 16 * u + 8), al);
      }
#pragma GCC unroll 4
      for (int j = 0; j < kTileKeys; ++j) {
        const __m256 b0 = _mm256_load_ps(vc + j * D + 16 * u);
        const __m256 b1 = _mm256_load_ps(vc + j * D + 16 * u + 8);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
          const __m256 a = _mm256_broadcast_ss(pr[r] + j);
          acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
        }
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(o[r] + 16 * u, acc[r][0]);
        _mm256_store_ps(o[r] + 16 * u + 8, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    const __m256 inv = _mm256_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
    for (int u = 0; u < D / 8; ++u)
      store8(orow[r] + 8 * u, _mm256_mul_ps(_mm256_load_ps(o[r] + 8 * u), inv));
  }
}

}  // namespace
#endif  // BATON_VEC8
