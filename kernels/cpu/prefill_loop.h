// The prefill loop: R query rows of one (sequence or group, kv head) against its K/V, packed in
// 32-key chunks (attention_common.h's pack_chunk), with the rows' output (R x D fp32) in registers
// across the whole key range: per chunk, S = Q K^T, streaming softmax, O = O * alpha + P V. Written
// once for the two kernels that run it:
//   paged_prefill.cpp (CAUSAL, not LSE_OUT): row r sees keys 0..pos[r] (its position), and its
//     output is written normalized in T;
//   cascade.cpp's shared pass (not CAUSAL, LSE_OUT): every row sees the group's n_keys shared
//     keys, and its output is written normalized in fp32 with its log-sum-exp (a partial result
//     that the suffix pass continues from).
// Only the chunks past some row's last key are masked (the masks are per row when CAUSAL, else one
// for all rows); chunks past every row's last key are never visited. The flags select code with
// `if constexpr`, so each kernel compiles to the instructions it had before this was shared (GCC
// assigns some registers and stack slots differently).
//
// Softmax: fp32, in base 2 on scores times scale * log2(e), with a lazily updated reference point
// per row (its running max, moved only when a score exceeds it by more than 8, so probabilities
// stay below 2^8 and the O / l rescale is rare after the first chunk). 2^x by a minimax polynomial
// (relative error 1e-7; 3e-6 where the probabilities are then rounded to bf16).
//
// Layouts of the packed buffers (per 32-key chunk):
//   bf16 with AVX512-BF16 (QKBF, PVBF): K as two 16-key groups of [D/2][16] dwords (each dword a
//     pair of dimensions of one key), so one vdpbf16ps of a broadcast q dword adds 2 dims of 16
//     scores; V as 16 key pairs of [D/16][16] dwords (dims 16c..16c+15 of keys 2u and 2u+1
//     interleaved), so one vdpbf16ps of a broadcast (p_2u, p_2u+1) pair adds 2 keys to 16 output
//     dims. q.k products of bf16 values are exact in fp32; the probabilities are rounded to bf16
//     for P V (as torch's flash attention does for bf16), accumulation is fp32.
//   fp32 / fp16 / bf16 without AVX512-BF16: K as two groups of [D][16] floats, V as [32][D]
//     floats; plain fp32 FMAs.
// The portable loop (prefill_row_generic: no AVX-512, or D other than 64 / 128) is one query row
// and one key at a time (8 keys on AVX2); paged_prefill.cpp takes prefill_avx2.h's tile on AVX2
// for D 64 and 128, cascade.cpp's shared pass still this loop.
//
// In an anonymous namespace, as attention_common.h: each kernel's translation unit gets its own
// instantiations (cpu_ops hashes this header into the build's name).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "attention_avx2.h"
#include "attention_common.h"

namespace {

// One query row (qf: D floats) against keys 0..n_keys-1 of a paged (sequence, kv head), one key at
// a time, from an empty state: acc (D floats) gets the unnormalized output, m the running max of
// the scaled scores, l the softmax sum. Params: any kernel's params with D, bs, k_bstride,
// v_bstride and scale.
template <typename T, typename Params>
inline void prefill_row_generic(const Params& p, const int32_t* bt, const T* kbase, const T* vbase,
                                const float* qf, int64_t n_keys, float* acc, float& m, float& l) {
  const int64_t D = p.D, bs = p.bs;
  for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
  m = -std::numeric_limits<float>::infinity();
  l = 0.f;
#ifdef BATON_VEC8
  if (attend_keys_avx2(kbase, vbase, bt, p.k_bstride, p.v_bstride, bs, D, 0, n_keys, qf, 1, p.scale, acc, &m, &l))
    return;  // attention_avx2.h: 8 keys of a block at a time
#endif
  for (int64_t t = 0; t < n_keys; ++t) {
    const int64_t blk = bt[t / bs], off = t % bs;
    const T* krow = kbase + blk * p.k_bstride + off * D;
    const T* vrow = vbase + blk * p.v_bstride + off * D;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += qf[d] * to_float(krow[d]);
    s *= p.scale;
    const float m_new = std::max(m, s);
    const float alpha = std::exp(m - m_new);
    const float pe = std::exp(s - m_new);
    l = l * alpha + pe;
    m = m_new;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] * alpha + pe * to_float(vrow[d]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// QKBF: q.k with vdpbf16ps (T must be bf16); PVBF: P V with vdpbf16ps.
template <typename T, int D, bool QKBF, bool PVBF>
struct PrefillLoop {
  static_assert(D % 32 == 0, "D must be a multiple of 32");
  static constexpr int NV = D / 16;           // fp32 vectors per row
  static constexpr int R = D <= 64 ? 4 : 2;   // query rows per register block
  static constexpr int NA = 2 * R >= 8 ? 1 : 2;  // partial sums per score vector (latency)
  static constexpr int64_t kKChunkBytes = 32 * D * (QKBF ? 2 : 4);
  static constexpr int64_t kVChunkBytes = 32 * D * (PVBF ? 2 : 4);
  // Probabilities rounded to bf16 need far less than fp32 accuracy.
  using Exp2 = Exp2Poly<PVBF ? 4 : 6>;

  // The keys rows() reads: CAUSAL, row r's position pos[r] (it sees keys 0..pos[r]); else the
  // number of keys n_keys that every row sees (0..n_keys-1).
  template <bool CAUSAL>
  using Keys = std::conditional_t<CAUSAL, const int64_t*, int64_t>;
  // Where rows() writes row r's normalized output: in T at out[r]; or (LSE_OUT) in fp32 at o[r],
  // with its natural-log LSE at *lse[r] (a partial result to merge).
  struct LseOut {
    float* const* o;
    float* const* lse;
  };
  template <bool LSE_OUT>
  using Out = std::conditional_t<LSE_OUT, LseOut, T* const*>;

  // R query rows (rows past n_valid repeat the last one and are not stored) against the packed
  // keys. Params: either kernel's (only scale is read). Where the two kernels wrote a step
  // differently, both forms are kept under `if constexpr`: GCC allocates registers differently
  // for equivalent expressions, and each kernel keeps the code it had.
  template <bool CAUSAL, bool LSE_OUT, typename Params>
  static void rows(const Params& p, int n_valid, Keys<CAUSAL> keys, const T* const* qrow,
                   Out<LSE_OUT> out, const uint8_t* kbuf, const uint8_t* vbuf) {
    // Query rows are broadcast straight from q (bf16 dwords for vdpbf16ps, or fp32); other dtypes
    // are converted to fp32 first.
    constexpr bool kQDirect = QKBF || std::is_same_v<T, float>;
    [[maybe_unused]] alignas(64) float qconv[kQDirect ? 1 : R][D];
    const float* qf[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (!kQDirect) {
        for (int d = 0; d < D; ++d) qconv[r][d] = to_float(qrow[r][d]);
        qf[r] = qconv[r];
      } else if constexpr (!QKBF) {
        qf[r] = reinterpret_cast<const float*>(qrow[r]);
      }
    }
    // CAUSAL: the rows' positions and the last of them; else the key count of every row.
    [[maybe_unused]] const int64_t* pos = nullptr;
    [[maybe_unused]] int64_t pmax = 0, n_keys = 0;
    int64_t n_chunks, n_full;  // n_full: chunks no row needs masked
    if constexpr (CAUSAL) {
      pos = keys;
      int64_t pmin = pos[0];
      pmax = pos[0];
      for (int r = 1; r < R; ++r) {
        pmin = std::min(pmin, pos[r]);
        pmax = std::max(pmax, pos[r]);
      }
      n_chunks = pmax / 32 + 1;
      n_full = (pmin + 1) / 32;
    } else {
      n_keys = keys;
      n_chunks = (n_keys + 31) / 32;
      n_full = n_keys / 32;
    }

    // Softmax in base 2 on scores scaled by scale * log2(e). The reference point m of a row is
    // its running max, updated lazily: only when a score exceeds it by more than kSlack (so the
    // probabilities stay below 2^kSlack), which after the first chunk is rare.
    constexpr float kSlack = 8.f;
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 slack = _mm512_set1_ps(kSlack);
    const __m512 cscale = _mm512_set1_ps(p.scale * 1.44269504088896341f);
    __m512 acc[R][NV];
    __m512 m[R], m_hi[R], l[R];  // m and m + kSlack: all lanes equal; l: lane-wise partial sums
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
      m[r] = m_hi[r] = neg_inf;
      l[r] = _mm512_setzero_ps();
    }
    [[maybe_unused]] alignas(64) uint32_t pbf[PVBF ? R : 1][16];
    [[maybe_unused]] alignas(64) float pf[PVBF ? 1 : R][32];

    for (int64_t c = 0; c < n_chunks; ++c) {
      // ---- scores of the chunk's 32 keys: s[r][h] holds keys 32c + 16h + lane
      __m512 s[R][2];
      {
        __m512 sa[NA][R][2];
        for (int a = 0; a < NA; ++a)
          for (int r = 0; r < R; ++r) sa[a][r][0] = sa[a][r][1] = _mm512_setzero_ps();
        if constexpr (QKBF) {
#if defined(__AVX512BF16__)
          const uint32_t* kc = reinterpret_cast<const uint32_t*>(kbuf + c * kKChunkBytes);
#pragma GCC unroll 4
          for (int j = 0; j < D / 2; j += NA) {
#pragma GCC unroll 2
            for (int a = 0; a < NA; ++a) {
              const __m512bh k0 = (__m512bh)_mm512_load_si512(kc + (j + a) * 16);
              const __m512bh k1 = (__m512bh)_mm512_load_si512(kc + (D / 2 + j + a) * 16);
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) {
                const __m512bh qb =
                    (__m512bh)_mm512_set1_epi32(static_cast<int>(load_u32(qrow[r] + 2 * (j + a))));
                sa[a][r][0] = _mm512_dpbf16_ps(sa[a][r][0], qb, k0);
                sa[a][r][1] = _mm512_dpbf16_ps(sa[a][r][1], qb, k1);
              }
            }
          }
#endif
        } else {
          const float* kc = reinterpret_cast<const float*>(kbuf + c * kKChunkBytes);
#pragma GCC unroll 4
          for (int d = 0; d < D; d += NA) {
#pragma GCC unroll 2
            for (int a = 0; a < NA; ++a) {
              const __m512 k0 = _mm512_load_ps(kc + (d + a) * 16);
              const __m512 k1 = _mm512_load_ps(kc + (D + d + a) * 16);
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) {
                const __m512 qb = _mm512_set1_ps(qf[r][d + a]);
                sa[a][r][0] = _mm512_fmadd_ps(qb, k0, sa[a][r][0]);
                sa[a][r][1] = _mm512_fmadd_ps(qb, k1, sa[a][r][1]);
              }
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          s[r][0] = sa[0][r][0];
          s[r][1] = sa[0][r][1];
          for (int a = 1; a < NA; ++a) {
            s[r][0] = _mm512_add_ps(s[r][0], sa[a][r][0]);
            s[r][1] = _mm512_add_ps(s[r][1], sa[a][r][1]);
          }
        }
      }

      // ---- streaming softmax
      const bool masked = c >= n_full;
      // Keys of the chunk that every row sees (not CAUSAL) or row r sees (CAUSAL, set per row).
      [[maybe_unused]] const __mmask16 all0 = !CAUSAL && masked ? prefix_mask(n_keys - 32 * c) : 0xFFFF;
      [[maybe_unused]] const __mmask16 all1 =
          !CAUSAL && masked ? prefix_mask(n_keys - 32 * c - 16) : 0xFFFF;
      for (int r = 0; r < R; ++r) {
        __m512 s0 = _mm512_mul_ps(s[r][0], cscale);
        __m512 s1 = _mm512_mul_ps(s[r][1], cscale);
        __mmask16 k0 = all0, k1 = all1;
        if (masked) {
          if constexpr (CAUSAL) {
            const int64_t n = pos[r] - 32 * c + 1;
            k0 = prefix_mask(n);
            k1 = prefix_mask(n - 16);
          }
          s0 = _mm512_mask_mov_ps(neg_inf, k0, s0);
          s1 = _mm512_mask_mov_ps(neg_inf, k1, s1);
        }
        if (_mm512_cmp_ps_mask(s0, m_hi[r], _CMP_GT_OQ) |
            _mm512_cmp_ps_mask(s1, m_hi[r], _CMP_GT_OQ)) {  // new reference point
          const __m512 m_new = bcast_max(_mm512_max_ps(s0, s1));
          if (!_mm512_cmp_ps_mask(m[r], neg_inf, _CMP_EQ_OQ)) {  // not the first chunk: rescale
            const __m512 alpha = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(m[r], m_new));
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], alpha);
            l[r] = _mm512_mul_ps(l[r], alpha);
          }
          m[r] = m_new;
          m_hi[r] = _mm512_add_ps(m_new, slack);
        }
        __m512 p0, p1;
        chunk_probs<Exp2>(masked, k0, k1, s0, s1, m[r], p0, p1);
        l[r] = _mm512_add_ps(l[r], _mm512_add_ps(p0, p1));
        if constexpr (PVBF) {
#if defined(__AVX512BF16__)
          _mm512_store_si512(pbf[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
#endif
        } else {
          _mm512_store_ps(pf[r], p0);
          _mm512_store_ps(pf[r] + 16, p1);
        }
      }

      // ---- acc += P V over the keys some row sees
      const int64_t n_chunk_keys = CAUSAL ? std::min<int64_t>(32, pmax - 32 * c + 1)
                                          : std::min<int64_t>(32, n_keys - 32 * c);
      if constexpr (PVBF) {
#if defined(__AVX512BF16__)
        const __m512i* vc = reinterpret_cast<const __m512i*>(vbuf + c * kVChunkBytes);
        const int n_pairs = static_cast<int>((n_chunk_keys + 1) / 2);
        for (int u = 0; u < n_pairs; ++u) {
          __m512bh vv[NV];
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_load_si512(vc + u * NV + v);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pbf[r][u]));
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pb, vv[v]);
          }
        }
#endif
      } else {
        const float* vc = reinterpret_cast<const float*>(vbuf + c * kVChunkBytes);
        for (int t = 0; t < n_chunk_keys; ++t) {
          __m512 vv[NV];
#pragma GCC unroll 8
          for (int v = 0; v < NV; ++v) vv[v] = _mm512_load_ps(vc + t * D + 16 * v);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m512 pb = _mm512_set1_ps(pf[r][t]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(pb, vv[v], acc[r][v]);
          }
        }
      }
    }

    if constexpr (LSE_OUT) {
      for (int r = 0; r < n_valid; ++r) {
        const float lsum = _mm512_reduce_add_ps(l[r]);
        const __m512 inv = _mm512_set1_ps(1.f / lsum);  // lsum >= 1: the max key gives 2^0
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out.o[r] + 16 * v, _mm512_mul_ps(acc[r][v], inv));
        *out.lse[r] = (_mm512_cvtss_f32(m[r]) + std::log2(lsum)) * 0.69314718055994531f;
      }
    } else {  // normalized, in T (0 for a row that saw no key)
      alignas(64) float tmp[D];
      for (int r = 0; r < n_valid; ++r) {
        const float lsum = _mm512_reduce_add_ps(l[r]);
        const __m512 inv = _mm512_set1_ps(lsum > 0.f ? 1.f / lsum : 0.f);
        T* o = out[r];
        if constexpr (std::is_same_v<T, float>) {
          for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + 16 * v, _mm512_mul_ps(acc[r][v], inv));
        } else if constexpr (std::is_same_v<T, c10::Half>) {
          for (int v = 0; v < NV; ++v)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * v),
                                _mm512_cvtps_ph(_mm512_mul_ps(acc[r][v], inv),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#if defined(__AVX512BF16__)
        } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // round to nearest even
          for (int v = 0; v < NV; v += 2)
            _mm512_storeu_si512(o + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(
                                                _mm512_mul_ps(acc[r][v + 1], inv),
                                                _mm512_mul_ps(acc[r][v], inv)));
#endif
        } else {
          for (int v = 0; v < NV; ++v) _mm512_store_ps(tmp + 16 * v, _mm512_mul_ps(acc[r][v], inv));
          for (int d = 0; d < D; ++d) o[d] = from_float<T>(tmp[d]);
        }
      }
    }
  }
};
#endif  // __AVX512F__ && __AVX512BW__

}  // namespace
