// Cascade decode attention (cascade.cpp): the work a call describes (CascadeParams, the shared
// pass's items) and the shared pass on AVX-512, a GEMM-shaped pass of a group's (member, query head)
// rows over the K/V it shares, packed once per (group, kv head) as paged_prefill.cpp packs them.
// Included by cascade.cpp and cascade_amx.h; in an anonymous namespace like the rest of the kernel
// (one translation unit, compiled as when this was part of cascade.cpp).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BATON_CASCADE_AVX512 1
#endif

#include "attention_common.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct CascadeParams {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  int64_t q_bstride, q_hstride;
  int64_t o_bstride, o_hstride;
  int64_t k_bstride, v_bstride;  // elements between consecutive blocks (dim-0 strides)
  int64_t head_stride;           // bs * D
  int64_t H, KV, G, D, bs;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* lens;
  const int32_t* start_block;  // [B]: first block of each row's own pass (its group's shared count)
  const int32_t* group_rows;
  const int32_t* group_starts;
  const int32_t* group_blocks;
  float* state_o;    // [B, H, D]: shared pass's normalized output per (row, head)
  float* state_lse;  // [B, H]: its log-sum-exp of the scaled scores; -inf where there is none
  float scale;
};

// Rows r0..r1-1 of group g's (member, query head) rows under kv head kh: row i is member i / G,
// head kh * G + i % G.
struct SharedItem {
  int64_t g, kh, r0, r1;
};

inline int64_t item_row(const CascadeParams& p, const SharedItem& it, int64_t i) {
  return p.group_rows[p.group_starts[it.g] + i / p.G];
}

#ifdef BATON_CASCADE_AVX512
// ---------------------------------------------------------------------------------------------
// Shared pass: QKBF: q.k with vdpbf16ps (T must be bf16); PVBF: P V with vdpbf16ps.
template <typename T, int D, bool QKBF, bool PVBF>
struct Shared {
  static_assert(D % 32 == 0, "D must be a multiple of 32");
  static constexpr int NV = D / 16;           // fp32 vectors per row
  static constexpr int R = D <= 64 ? 4 : 2;   // query rows per register block
  static constexpr int NA = 2 * R >= 8 ? 1 : 2;  // partial sums per score vector (latency)
  static constexpr int64_t kKChunkBytes = 32 * D * (QKBF ? 2 : 4);
  static constexpr int64_t kVChunkBytes = 32 * D * (PVBF ? 2 : 4);
  using Exp2 = Exp2Poly<PVBF ? 4 : 6>;

  // R query rows (rows past n_valid repeat the last one and are not stored) against the
  // n_keys packed shared keys; writes each valid row's normalized output and natural-log LSE.
  static void rows(const CascadeParams& p, int n_valid, int64_t n_keys, const T* const* qrow,
                   float* const* orow, float* const* lserow, const uint8_t* kbuf,
                   const uint8_t* vbuf) {
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
    const int64_t n_chunks = (n_keys + 31) / 32;
    const int64_t n_full = n_keys / 32;  // chunks with no key masked

    // Base-2 softmax on scores times scale * log2(e), with a lazily moved reference point per row
    // (as in paged_prefill.cpp: moved only when a score passes it by more than kSlack).
    constexpr float kSlack = 8.f;
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    const __m512 slack = _mm512_set1_ps(kSlack);
    const __m512 cscale = _mm512_set1_ps(p.scale * 1.44269504088896341f);
    __m512 acc[R][NV];
    __m512 m[R], m_hi[R], l[R];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_setzero_ps();
      m[r] = m_hi[r] = neg_inf;
      l[r] = _mm512_setzero_ps();
    }
    [[maybe_unused]] alignas(64) uint32_t pbf[PVBF ? R : 1][16];
    [[maybe_unused]] alignas(64) float pf[PVBF ? 1 : R][32];

    for (int64_t c = 0; c < n_chunks; ++c) {
      __m512 s[R][2];  // s[r][h]: keys 32c + 16h + lane
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

      const bool masked = c >= n_full;
      const __mmask16 k0 = masked ? prefix_mask(n_keys - 32 * c) : 0xFFFF;
      const __mmask16 k1 = masked ? prefix_mask(n_keys - 32 * c - 16) : 0xFFFF;
      for (int r = 0; r < R; ++r) {
        __m512 s0 = _mm512_mul_ps(s[r][0], cscale);
        __m512 s1 = _mm512_mul_ps(s[r][1], cscale);
        if (masked) {
          s0 = _mm512_mask_mov_ps(neg_inf, k0, s0);
          s1 = _mm512_mask_mov_ps(neg_inf, k1, s1);
        }
        if (_mm512_cmp_ps_mask(s0, m_hi[r], _CMP_GT_OQ) |
            _mm512_cmp_ps_mask(s1, m_hi[r], _CMP_GT_OQ)) {  // new reference point
          const __m512 m_new = bcast_max(_mm512_max_ps(s0, s1));
          if (!_mm512_cmp_ps_mask(m[r], neg_inf, _CMP_EQ_OQ)) {
            const __m512 alpha = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(m[r], m_new));
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], alpha);
            l[r] = _mm512_mul_ps(l[r], alpha);
          }
          m[r] = m_new;
          m_hi[r] = _mm512_add_ps(m_new, slack);
        }
        __m512 p0, p1;
        if (masked) {
          p0 = Exp2::template eval<true>(k0, _mm512_sub_ps(s0, m[r]));
          p1 = Exp2::template eval<true>(k1, _mm512_sub_ps(s1, m[r]));
        } else {
          p0 = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(s0, m[r]));
          p1 = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(s1, m[r]));
        }
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

      const int64_t n_chunk_keys = std::min<int64_t>(32, n_keys - 32 * c);
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

    for (int r = 0; r < n_valid; ++r) {
      const float lsum = _mm512_reduce_add_ps(l[r]);
      const __m512 inv = _mm512_set1_ps(1.f / lsum);  // lsum >= 1: the max key gives 2^0
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(orow[r] + 16 * v, _mm512_mul_ps(acc[r][v], inv));
      *lserow[r] = (_mm512_cvtss_f32(m[r]) + std::log2(lsum)) * 0.69314718055994531f;
    }
  }

  struct PackState {
    int64_t g = -1, kh = -1;
    std::vector<CacheLine>* kbuf;
    std::vector<CacheLine>* vbuf;
  };

  // Pack the item's (group, kv head) shared K/V unless the buffers hold it already.
  static void pack(const CascadeParams& p, const SharedItem& it, PackState& ps) {
    const int64_t n_keys = static_cast<int64_t>(p.group_blocks[it.g]) * p.bs;
    const int64_t n_chunks = (n_keys + 31) / 32;
    if (ps.g != it.g || ps.kh != it.kh) {
      ps.g = it.g;
      ps.kh = it.kh;
      if (static_cast<int64_t>(ps.kbuf->size()) * 64 < n_chunks * kKChunkBytes)
        ps.kbuf->resize(static_cast<size_t>(n_chunks * kKChunkBytes / 64));
      if (static_cast<int64_t>(ps.vbuf->size()) * 64 < n_chunks * kVChunkBytes)
        ps.vbuf->resize(static_cast<size_t>(n_chunks * kVChunkBytes / 64));
      const int32_t* bt = p.block_tables + p.group_rows[p.group_starts[it.g]] * p.bt_stride;
      const T* kbase = static_cast<const T*>(p.k) + it.kh * p.head_stride;
      const T* vbase = static_cast<const T*>(p.v) + it.kh * p.head_stride;
      uint8_t* kb = ps.kbuf->data()->bytes;
      uint8_t* vb = ps.vbuf->data()->bytes;
      for (int64_t c = 0; c < n_chunks; ++c)
        pack_chunk<T, D, QKBF, PVBF>(p, kbase, vbase, bt, n_keys, c, kb + c * kKChunkBytes,
                                     vb + c * kVChunkBytes);
    }
  }

  static void item(const CascadeParams& p, const SharedItem& it, PackState& ps) {
    pack(p, it, ps);
    const int64_t n_keys = static_cast<int64_t>(p.group_blocks[it.g]) * p.bs;
    const uint8_t* kb = ps.kbuf->data()->bytes;
    const uint8_t* vb = ps.vbuf->data()->bytes;
    const T* q = static_cast<const T*>(p.q);
    for (int64_t r0 = it.r0; r0 < it.r1; r0 += R) {
      const T* qrow[R];
      float* orow[R];
      float* lserow[R];
      for (int r = 0; r < R; ++r) {
        const int64_t i = std::min<int64_t>(r0 + r, it.r1 - 1);
        const int64_t b = item_row(p, it, i), h = it.kh * p.G + i % p.G;
        qrow[r] = q + b * p.q_bstride + h * p.q_hstride;
        orow[r] = p.state_o + (b * p.H + h) * D;
        lserow[r] = p.state_lse + b * p.H + h;
      }
      rows(p, static_cast<int>(std::min<int64_t>(R, it.r1 - r0)), n_keys, qrow, orow, lserow, kb, vb);
    }
  }

  static void range(const CascadeParams& p, const std::vector<SharedItem>& items, int64_t lo,
                    int64_t hi) {
    thread_local std::vector<CacheLine> kbuf, vbuf;
    PackState ps;
    ps.kbuf = &kbuf;
    ps.vbuf = &vbuf;
    for (int64_t i = lo; i < hi; ++i) item(p, items[i], ps);
  }
};
#endif  // BATON_CASCADE_AVX512

}  // namespace
