// 16 query rows against K/V packed in 32-key chunks (attention_common.h's pack_chunk, bf16, D = 64),
// on AMX tiles: the loop of prefill_loop.h's PrefillLoop::rows, 16 rows at a time instead of R in
// registers. Run by two kernels:
//   paged_prefill.cpp (CAUSAL, out in T): row r sees keys 0..pos[r], its position; a chunk is
//     masked per row only where some row's last key falls in it or before it;
//   cascade.cpp's shared pass (not CAUSAL, LSE_OUT): every row sees the group's n_keys keys; its
//     output is written normalized in fp32 with its log-sum-exp.
// The packed chunks are already the tiles' VNNI layouts: K as [D/2 dim pairs][16 keys] dwords (a B
// tile per 16 dim pairs), V as [16 key pairs][16 dims] dwords per 16 dims (a B tile per 16 output
// dims), and the bf16 probabilities of a row, key pairs in dwords, are an A tile's row. Tiles: 0-3
// the output (16 x 64 fp32), 4 the scores and then the probabilities, 5 and 7 the queries (dims
// 0-31, 32-63), 6 the K or V operand (amx_configure's shapes: all 16 rows x 64 bytes). The softmax
// runs on AVX-512 as in PrefillLoop::rows (base 2, a lazy reference point per row; the rare
// rescale moves the output through memory); the probabilities are rounded to bf16 for P V.
//
// In an anonymous namespace, as attention_common.h.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "amx_common.h"
#include "attention_common.h"

namespace {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATON_AMX_ROWS 1

template <bool CAUSAL, bool LSE_OUT>
struct AmxRows {
  using T = c10::BFloat16;
  static constexpr int D = 64, NV = 4, M = 16;
  static constexpr int64_t kKChunkBytes = 32 * D * 2;
  static constexpr int64_t kVChunkBytes = 32 * D * 2;
  using Exp2 = Exp2Poly<4>;

  // CAUSAL: each row's position; else the key count of every row.
  using Keys = std::conditional_t<CAUSAL, const int64_t*, int64_t>;
  struct LseOut {
    float* const* o;
    float* const* lse;
  };
  using Out = std::conditional_t<LSE_OUT, LseOut, T* const*>;

  // Rows 0..n_valid-1 of qrow (the others zero queries, not stored).
  static void rows(float scale, int n_valid, Keys keys, const T* const* qrow, Out out, const uint8_t* kbuf,
                   const uint8_t* vbuf) {
    alignas(64) T qbuf[M][D];
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

    // The chunks to visit, and the first that some row needs masked.
    int64_t n_chunks, n_full;
    [[maybe_unused]] int64_t pos[M];
    if constexpr (CAUSAL) {
      int64_t pmin = keys[0], pmax = keys[0];
      for (int r = 0; r < M; ++r) {
        pos[r] = keys[std::min(r, n_valid - 1)];  // padded rows: the last real one's keys
        pmin = std::min(pmin, pos[r]);
        pmax = std::max(pmax, pos[r]);
      }
      n_chunks = pmax / 32 + 1;
      n_full = (pmin + 1) / 32;
    } else {
      n_chunks = (keys + 31) / 32;
      n_full = keys / 32;
    }

    constexpr float kSlack = 8.f;
    const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 slack = _mm512_set1_ps(kSlack);
    const __m512 cscale = _mm512_set1_ps(scale * 1.44269504088896341f);
    __m512 m[M], m_hi[M], l[M];
    for (int r = 0; r < M; ++r) {
      m[r] = m_hi[r] = neg_inf;
      l[r] = _mm512_setzero_ps();
    }
    for (int64_t c = 0; c < n_chunks; ++c) {
      const uint8_t* kc = kbuf + c * kKChunkBytes;
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
      alignas(64) float alpha[M];
      bool rescale = false;
      for (int r = 0; r < M; ++r) {
        __mmask16 k0 = 0xFFFF, k1 = 0xFFFF;
        if (masked) {
          int64_t n;
          if constexpr (CAUSAL) {
            n = pos[r] + 1 - 32 * c;
          } else {
            n = keys - 32 * c;
          }
          k0 = prefix_mask(n);
          k1 = prefix_mask(n - 16);
        }
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
        chunk_probs<Exp2>(masked, k0, k1, s0, s1, m[r], p0, p1);
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
      const uint8_t* vc = vbuf + c * kVChunkBytes;
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
      if constexpr (LSE_OUT) {
        for (int v = 0; v < NV; ++v)
          _mm512_storeu_ps(out.o[r] + 16 * v, _mm512_mul_ps(_mm512_load_ps(&obuf[r][16 * v]), inv));
        *out.lse[r] = (_mm512_cvtss_f32(m[r]) + std::log2(lsum)) * 0.69314718055994531f;
      } else {
        for (int v = 0; v < NV; ++v) {
          const __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&obuf[r][16 * v]), inv));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * v), (__m256i)o);
        }
      }
    }
  }

  static inline void store_out(float (*obuf)[D]) {
    _tile_stored(0, &obuf[0][0], D * 4);
    _tile_stored(1, &obuf[0][16], D * 4);
    _tile_stored(2, &obuf[0][32], D * 4);
    _tile_stored(3, &obuf[0][48], D * 4);
  }
};
#endif  // AMX-BF16

}  // namespace
