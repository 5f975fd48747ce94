// Cascade decode attention's shared pass on AMX tiles (bf16, D = 64), where the kernels are built
// for a CPU with AMX-BF16 (cascade.cpp's pick_shared takes it when Linux grants the tile state).
// In an anonymous namespace, included by cascade.cpp: one translation unit, as before the split.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_common.h"
#include "cascade_shared.h"

namespace {

#if defined(BATON_CASCADE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define BATON_CASCADE_AMX 1
// ---------------------------------------------------------------------------------------------
// Shared pass on AMX tiles (bf16, D = 64): 16 query rows x 32 keys per step. The packed chunks
// of Shared<bf16, 64, true, true> are already the tiles' VNNI layouts: K as [D/2 dim pairs][16
// keys] dwords (a B tile per 16 dims pairs), V as [16 key pairs][16 dims] dwords per 16 dims (a
// B tile per 16 output dims), and the bf16 probabilities of a row, key pairs in dwords, are an
// A tile's row. Tiles: 0-3 the output (16 x 64 fp32), 4 the scores and then the probabilities,
// 5 and 7 the queries (dims 0-31, 32-63), 6 the K or V operand. The softmax runs on AVX-512
// exactly as in prefill_loop.h's PrefillLoop::rows (lazy base-2 reference point; the rare rescale
// moves the output through memory).

struct SharedAmx {
  using S = Shared<c10::BFloat16, 64, true, true>;
  static constexpr int D = 64, NV = 4, M = 16;
  using Exp2 = Exp2Poly<4>;

  // 16 rows (n_valid of them real, the others zero queries, not stored).
  static void rows(const CascadeParams& p, int n_valid, int64_t n_keys, const c10::BFloat16* const* qrow,
                   float* const* orow, float* const* lserow, const uint8_t* kbuf, const uint8_t* vbuf) {
    alignas(64) c10::BFloat16 qbuf[M][D];
    alignas(64) float sbuf[M][32];
    alignas(64) uint32_t pbf[M][16];
    alignas(64) float obuf[M][D];
    for (int r = 0; r < M; ++r) {
      if (r < n_valid) {
        std::memcpy(qbuf[r], qrow[r], sizeof(qbuf[r]));
      } else {
        std::memset(qbuf[r], 0, sizeof(qbuf[r]));
      }
    }
    _tile_loadd(5, qbuf[0], D * 2);
    _tile_loadd(7, qbuf[0] + 32, D * 2);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);

    constexpr float kSlack = 8.f;
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    const __m512 slack = _mm512_set1_ps(kSlack);
    const __m512 cscale = _mm512_set1_ps(p.scale * 1.44269504088896341f);
    __m512 m[M], m_hi[M], l[M];
    for (int r = 0; r < M; ++r) {
      m[r] = m_hi[r] = neg_inf;
      l[r] = _mm512_setzero_ps();
    }
    const int64_t n_chunks = (n_keys + 31) / 32;
    const int64_t n_full = n_keys / 32;
    for (int64_t c = 0; c < n_chunks; ++c) {
      const uint8_t* kc = kbuf + c * S::kKChunkBytes;
      for (int h = 0; h < 2; ++h) {  // scores of keys 32c + 16h .. + 15
        const uint8_t* grp = kc + h * (D / 2) * 64;
        _tile_zero(4);
        _tile_loadd(6, grp, 64);  // dim pairs 0-15
        _tile_dpbf16ps(4, 5, 6);
        _tile_loadd(6, grp + 16 * 64, 64);  // dim pairs 16-31
        _tile_dpbf16ps(4, 7, 6);
        _tile_stored(4, &sbuf[0][16 * h], 32 * 4);
      }
      const bool masked = c >= n_full;
      const __mmask16 k0 = masked ? prefix_mask(n_keys - 32 * c) : 0xFFFF;
      const __mmask16 k1 = masked ? prefix_mask(n_keys - 32 * c - 16) : 0xFFFF;
      alignas(64) float alpha[M];
      bool rescale = false;
      for (int r = 0; r < M; ++r) {
        __m512 s0 = _mm512_mul_ps(_mm512_load_ps(&sbuf[r][0]), cscale);
        __m512 s1 = _mm512_mul_ps(_mm512_load_ps(&sbuf[r][16]), cscale);
        if (masked) {
          s0 = _mm512_mask_mov_ps(neg_inf, k0, s0);
          s1 = _mm512_mask_mov_ps(neg_inf, k1, s1);
        }
        alpha[r] = 1.f;
        if (_mm512_cmp_ps_mask(s0, m_hi[r], _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, m_hi[r], _CMP_GT_OQ)) {
          const __m512 m_new = bcast_max(_mm512_max_ps(s0, s1));
          if (!_mm512_cmp_ps_mask(m[r], neg_inf, _CMP_EQ_OQ)) {
            const __m512 a = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(m[r], m_new));
            l[r] = _mm512_mul_ps(l[r], a);
            alpha[r] = _mm512_cvtss_f32(a);
            rescale = true;
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
        _mm512_store_si512(pbf[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      if (rescale) {  // out rows *= alpha, through memory
        store_out(obuf);
        for (int r = 0; r < M; ++r) {
          const __m512 a = _mm512_set1_ps(alpha[r]);
          for (int v = 0; v < NV; ++v)
            _mm512_store_ps(&obuf[r][16 * v], _mm512_mul_ps(_mm512_load_ps(&obuf[r][16 * v]), a));
        }
        _tile_loadd(0, &obuf[0][0], D * 4);
        _tile_loadd(1, &obuf[0][16], D * 4);
        _tile_loadd(2, &obuf[0][32], D * 4);
        _tile_loadd(3, &obuf[0][48], D * 4);
      }
      // out += P V: P rows are 16 key pairs; V of dims 16v..16v+15 is 16 rows of NV * 64 bytes.
      const uint8_t* vc = vbuf + c * S::kVChunkBytes;
      _tile_loadd(4, pbf[0], 64);
      _tile_loadd(6, vc + 0 * 64, NV * 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(6, vc + 1 * 64, NV * 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(6, vc + 2 * 64, NV * 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(6, vc + 3 * 64, NV * 64);
      _tile_dpbf16ps(3, 4, 6);
    }
    store_out(obuf);
    for (int r = 0; r < n_valid; ++r) {
      const float lsum = _mm512_reduce_add_ps(l[r]);
      const __m512 inv = _mm512_set1_ps(1.f / lsum);
      for (int v = 0; v < NV; ++v)
        _mm512_storeu_ps(orow[r] + 16 * v, _mm512_mul_ps(_mm512_load_ps(&obuf[r][16 * v]), inv));
      *lserow[r] = (_mm512_cvtss_f32(m[r]) + std::log2(lsum)) * 0.69314718055994531f;
    }
  }

  static inline void store_out(float (*obuf)[D]) {
    _tile_stored(0, &obuf[0][0], D * 4);
    _tile_stored(1, &obuf[0][16], D * 4);
    _tile_stored(2, &obuf[0][32], D * 4);
    _tile_stored(3, &obuf[0][48], D * 4);
  }

  static void item(const CascadeParams& p, const SharedItem& it, S::PackState& ps) {
    S::pack(p, it, ps);
    const uint8_t* kb = ps.kbuf->data()->bytes;
    const uint8_t* vb = ps.vbuf->data()->bytes;
    const int64_t n_keys = static_cast<int64_t>(p.group_blocks[it.g]) * p.bs;
    const auto* q = static_cast<const c10::BFloat16*>(p.q);
    for (int64_t r0 = it.r0; r0 < it.r1; r0 += M) {
      const c10::BFloat16* qrow[M];
      float* orow[M];
      float* lserow[M];
      const int n_valid = static_cast<int>(std::min<int64_t>(M, it.r1 - r0));
      for (int r = 0; r < n_valid; ++r) {
        const int64_t i = r0 + r;
        const int64_t b = item_row(p, it, i), h = it.kh * p.G + i % p.G;
        qrow[r] = q + b * p.q_bstride + h * p.q_hstride;
        orow[r] = p.state_o + (b * p.H + h) * D;
        lserow[r] = p.state_lse + b * p.H + h;
      }
      rows(p, n_valid, n_keys, qrow, orow, lserow, kb, vb);
    }
  }

  static void range(const CascadeParams& p, const std::vector<SharedItem>& items, int64_t lo,
                    int64_t hi) {
    thread_local std::vector<CacheLine> kbuf, vbuf;
    S::PackState ps;
    ps.kbuf = &kbuf;
    ps.vbuf = &vbuf;
    amx_configure();
    for (int64_t i = lo; i < hi; ++i) item(p, items[i], ps);
    _tile_release();
  }
};
#endif  // AMX

}  // namespace
