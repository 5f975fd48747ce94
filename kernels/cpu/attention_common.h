// What the CPU attention kernels share (paged_attention.cpp, paged_prefill.cpp, cascade.cpp,
// kv_quant.cpp): scalar conversions, and on AVX-512 the exp polynomials, the row loaders, the q.k
// dot products and the 16-token reduction tree of the decode loops, the software prefetch, and the
// 32-key chunk packing of the prefill loops.
//
// Everything is in an anonymous namespace, as it was when each .cpp held its own copy: every
// translation unit still gets its own internal definitions, so a kernel compiles to the same code
// (same inlining, no symbol shared between files). cpu_ops hashes this header into the build's
// name, so an edit here rebuilds every kernel.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }  // BFloat16 / Half: round to nearest even

// 64-byte aligned storage for packed K/V (a std::vector of them: C++17 aligned new).
struct alignas(64) CacheLine {
  uint8_t bytes[64];
};

#if defined(__AVX512F__) || defined(__AVX2__)
// Software prefetch of the K/V rows kPrefetchBlocks blocks ahead of the one being computed,
// following the thread's (pair, block) order across pair boundaries (the decode loops, AVX-512's
// and AVX2's). Issued one row per row computed, into L2: with random block placement the hardware
// prefetchers only see short 2 KB runs.
constexpr int kPrefetchBlocks = 2;
#ifndef BATON_PREFETCH_HINT
#define BATON_PREFETCH_HINT _MM_HINT_T1
#endif

// Prefetch row r of a block's K and V (kRowBytes each) into L2.
template <int64_t kRowBytes>
inline void prefetch_row(const char* k, const char* v, int64_t r) {
#pragma GCC unroll 8
  for (int64_t o = 0; o < kRowBytes; o += 64) {
    _mm_prefetch(k + r * kRowBytes + o, BATON_PREFETCH_HINT);
    _mm_prefetch(v + r * kRowBytes + o, BATON_PREFETCH_HINT);
  }
}
#endif

#if defined(__AVX512F__)
// exp for x <= 0 (Cephes expf polynomial, ~1 ulp); -inf and very negative inputs give 0.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

// Row loaders: D elements of a row as D/16 fp32 vectors, in an order given by dim().
template <typename T, int D>
struct Row;

template <int D>
struct Row<float, D> {
  static constexpr int NV = D / 16;
  static inline void load(const float* p, __m512* r) {
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) r[c] = _mm512_loadu_ps(p + 16 * c);
  }
  static inline int dim(int c, int i) { return 16 * c + i; }
};

// bf16: each 32-element chunk becomes (even elements, odd elements).
template <int D>
struct Row<c10::BFloat16, D> {
  static constexpr int NV = D / 16;
  static inline void load(const c10::BFloat16* p, __m512* r) {
    const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
#pragma GCC unroll 8
    for (int c = 0; c < NV / 2; ++c) {
      const __m512i x = _mm512_loadu_si512(reinterpret_cast<const void*>(p + 32 * c));
      r[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      r[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi_mask));
    }
  }
  static inline int dim(int c, int i) { return 32 * (c / 2) + 2 * i + (c % 2); }
};

template <int D>
struct Row<c10::Half, D> {
  static constexpr int NV = D / 16;
  static inline void load(const c10::Half* p, __m512* r) {
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c)
      r[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c)));
  }
  static inline int dim(int c, int i) { return 16 * c + i; }
};

// Transposing reduction tree: 16 vectors (one per token) -> one vector of their 16 lane sums.
// After the four levels lane 4i+j holds token i+4j; kTokenOrder undoes that.
inline __m512 tree1(__m512 a, __m512 b) {  // [a0+a2, a1+a3, b0+b2, b1+b3] (128-bit chunks)
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 tree2(__m512 a, __m512 b) {  // chunk c: the 4 partial sums of vector c
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
inline __m512 tree3(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
inline __m512 tree4(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
// Max over the 16 lanes, broadcast to every lane.
inline __m512 bcast_max(__m512 x) {
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
  x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
  x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
  return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}

inline __m512i token_order() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// q.k for the G heads of one token: per head a 16-lane vector whose lane sum is the dot product.
template <typename T, int G, int D>
struct Dot {
  __m512 q[G][D / 16];
  inline void init(const T* qp, int64_t hstride) {
    for (int g = 0; g < G; ++g) Row<T, D>::load(qp + g * hstride, q[g]);
  }
  inline void operator()(const T* krow, __m512* s) const {
    constexpr int NV = D / 16;
    __m512 k[NV];
    Row<T, D>::load(krow, k);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(q[g][0], k[0]);
#pragma GCC unroll 8
      for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(q[g][c], k[c], a);
      s[g] = a;
    }
  }
};

#if defined(__AVX512BF16__)
template <int G, int D>
struct Dot<c10::BFloat16, G, D> {
  static constexpr int NC = D / 32;
  __m512bh q[G][NC];
  inline void init(const c10::BFloat16* qp, int64_t hstride) {
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < NC; ++c)
        q[g][c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(qp + g * hstride + 32 * c));
  }
  inline void operator()(const c10::BFloat16* krow, __m512* s) const {
    __m512bh k[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c)
      k[c] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(krow + 32 * c));
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], k[0]);
#pragma GCC unroll 8
      for (int c = 1; c < NC; ++c) a = _mm512_dpbf16_ps(a, q[g][c], k[c]);
      s[g] = a;
    }
  }
};
#endif

// Raw scores (before scale) of up to 16 consecutive rows; rows >= n are not read and give 0.
template <typename T, int G, int D, bool FULL>
inline void scores16(const Dot<T, G, D>& dot, const T* krow, int n, __m512* out) {
  __m512 z[2][G];
#pragma GCC unroll 2
  for (int h8 = 0; h8 < 2; ++h8) {
    __m512 y[2][G];
#pragma GCC unroll 2
    for (int h4 = 0; h4 < 2; ++h4) {
      __m512 w[2][G];
#pragma GCC unroll 2
      for (int h2 = 0; h2 < 2; ++h2) {
        __m512 v[2][G];
#pragma GCC unroll 2
        for (int u = 0; u < 2; ++u) {
          const int t = 8 * h8 + 4 * h4 + 2 * h2 + u;
          if (FULL || t < n) {
            dot(krow + t * D, v[u]);
          } else {
            for (int g = 0; g < G; ++g) v[u][g] = _mm512_setzero_ps();
          }
        }
        for (int g = 0; g < G; ++g) w[h2][g] = tree1(v[0][g], v[1][g]);
      }
      for (int g = 0; g < G; ++g) y[h4][g] = tree2(w[0][g], w[1][g]);
    }
    for (int g = 0; g < G; ++g) z[h8][g] = tree3(y[0][g], y[1][g]);
  }
  const __m512i order = token_order();
  for (int g = 0; g < G; ++g) out[g] = _mm512_permutexvar_ps(order, tree4(z[0][g], z[1][g]));
}

// 2^x for x <= kSlack (a few units above 0 at most): x = n + f with n an integer and
// |f| <= 1/2, 2^f by a minimax polynomial of degree DEG (relative error 2.7e-6 for degree 4,
// 1e-7 for degree 6), times 2^n by vscalefps (so very negative x give 0). MASKED: lanes outside k
// are zero (they may be -inf or NaN in x).
template <int DEG>
struct Exp2Poly {
  template <bool MASKED>
  static inline __m512 eval(__mmask16 k, __m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y;
    if constexpr (DEG == 4) {
      y = _mm512_set1_ps(0.009570043534040451f);
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05591786280274391f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.2402474582195282f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931217908859253f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.9999992847442627f));
    } else {
      static_assert(DEG == 6, "degree 4 or 6");
      y = _mm512_set1_ps(0.0001534576149424538f);
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.0013399932067841291f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.009618489071726799f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.05550328642129898f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.24022646248340607f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.6931471824645996f));
      y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
    }
    if constexpr (MASKED) return _mm512_maskz_scalef_ps(k, y, n);
    return _mm512_scalef_ps(y, n);
  }
};

// The probabilities 2^(s - m) of a 32-key chunk's scores s0 (keys 0-15) and s1 (16-31) against a
// row's reference point m; where the chunk is masked, only the keys in k0 / k1 (the others 0).
template <typename Exp2>
inline void chunk_probs(bool masked, __mmask16 k0, __mmask16 k1, __m512 s0, __m512 s1, __m512 m,
                        __m512& p0, __m512& p1) {
  if (masked) {
    p0 = Exp2::template eval<true>(k0, _mm512_sub_ps(s0, m));
    p1 = Exp2::template eval<true>(k1, _mm512_sub_ps(s1, m));
  } else {
    p0 = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(s0, m));
    p1 = Exp2::template eval<false>(0xFFFF, _mm512_sub_ps(s1, m));
  }
}

// Lanes 0..n-1 of 16 (n may be <= 0 or >= 16): a 16-key group's valid keys, a row's tail
// (vec16.h's elementwise kernels).
inline __mmask16 prefix_mask(int64_t n) {
  if (n >= 16) return static_cast<__mmask16>(0xFFFF);
  if (n <= 0) return 0;
  return static_cast<__mmask16>((1u << n) - 1u);
}

inline uint32_t load_u32(const void* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

#if defined(__AVX512BW__)
// Pack 32-key chunk c (keys >= ctx are zero) of one (sequence, kv head) into the layouts that
// paged_prefill.cpp's header describes: QKBF: K as bf16 dim pairs (vdpbf16ps), else fp32; PVBF: V
// as bf16 key pairs, else fp32. p: any params with bs, k_bstride and v_bstride.
template <typename T, int D, bool QKBF, bool PVBF, typename Params>
inline void pack_chunk(const Params& p, const T* kbase, const T* vbase, const int32_t* bt, int64_t ctx,
                       int64_t c, uint8_t* kdst, uint8_t* vdst) {
  constexpr int NV = D / 16;
  const int64_t bs = p.bs;
  auto krow = [&](int64_t t) { return kbase + bt[t / bs] * p.k_bstride + (t % bs) * D; };
  auto vrow = [&](int64_t t) { return vbase + bt[t / bs] * p.v_bstride + (t % bs) * D; };
  const int64_t t0 = 32 * c;
  if constexpr (QKBF) {
    uint32_t* kw = reinterpret_cast<uint32_t*>(kdst);
    for (int h = 0; h < 2; ++h) {
      uint32_t* grp = kw + h * (D / 2) * 16;
      for (int i = 0; i < 16; ++i) {
        const int64_t t = t0 + 16 * h + i;
        if (t < ctx) {
          const T* row = krow(t);
#pragma GCC unroll 8
          for (int j = 0; j < D / 2; ++j) grp[j * 16 + i] = load_u32(row + 2 * j);
        } else {
          for (int j = 0; j < D / 2; ++j) grp[j * 16 + i] = 0;
        }
      }
    }
  } else {
    float* kf = reinterpret_cast<float*>(kdst);
    for (int h = 0; h < 2; ++h) {
      float* grp = kf + h * D * 16;
      for (int i = 0; i < 16; ++i) {
        const int64_t t = t0 + 16 * h + i;
        if (t < ctx) {
          const T* row = krow(t);
#pragma GCC unroll 8
          for (int d = 0; d < D; ++d) grp[d * 16 + i] = to_float(row[d]);
        } else {
          for (int d = 0; d < D; ++d) grp[d * 16 + i] = 0.f;
        }
      }
    }
  }
  if constexpr (PVBF) {
    // Key pair u: 16-bit elements 2i / 2i+1 of output vector (u, c') are dim 16c'+i of keys
    // 2u / 2u+1.
    __m512i idx[2];
    alignas(64) int16_t lo[32], hi[32];
    for (int i = 0; i < 16; ++i) {
      lo[2 * i] = static_cast<int16_t>(i);
      lo[2 * i + 1] = static_cast<int16_t>(32 + i);
      hi[2 * i] = static_cast<int16_t>(16 + i);
      hi[2 * i + 1] = static_cast<int16_t>(48 + i);
    }
    idx[0] = _mm512_load_si512(lo);
    idx[1] = _mm512_load_si512(hi);
    __m512i* out = reinterpret_cast<__m512i*>(vdst);
    for (int u = 0; u < 16; ++u) {
      const int64_t ta = t0 + 2 * u, tb = ta + 1;
      const T* a = ta < ctx ? vrow(ta) : nullptr;
      const T* b = tb < ctx ? vrow(tb) : nullptr;
#pragma GCC unroll 4
      for (int h = 0; h < D / 32; ++h) {
        const __m512i va = a ? _mm512_loadu_si512(a + 32 * h) : _mm512_setzero_si512();
        const __m512i vb = b ? _mm512_loadu_si512(b + 32 * h) : _mm512_setzero_si512();
        out[u * NV + 2 * h] = _mm512_permutex2var_epi16(va, idx[0], vb);
        out[u * NV + 2 * h + 1] = _mm512_permutex2var_epi16(va, idx[1], vb);
      }
    }
  } else {
    float* vf = reinterpret_cast<float*>(vdst);
    for (int i = 0; i < 32; ++i) {
      const int64_t t = t0 + i;
      float* dst = vf + i * D;
      if (t < ctx) {
        const T* row = vrow(t);
#pragma GCC unroll 8
        for (int d = 0; d < D; ++d) dst[d] = to_float(row[d]);
      } else {
        for (int d = 0; d < D; ++d) dst[d] = 0.f;
      }
    }
  }
}
#endif  // __AVX512BW__

#endif  // __AVX512F__

}  // namespace
