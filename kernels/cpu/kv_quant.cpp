// A quantized paged KV cache on the CPU (baton.kernels.kv_quant has the format and the torch
// references): each (token, kv head) row is D one-byte codes (int8, fp8 e4m3fn or fp8 e5m2; the
// cache's dtype says which) followed by the row's bf16 scale, R = D + 2 bytes.
//
//   rope_and_cache_quant          fused.rope_and_cache, then k and v quantized into their slots
//   paged_decode_attention_quant  decode attention reading the codes in place, dequantized in
//                                 registers (matches kv_quant.paged_decode_attention_quant_ref);
//                                 an int8 cache on AVX512-VNNI multiplies the codes as integers
//                                 (kv_quant.paged_decode_attention_int8_ref, see below)
//   kv_int8_integer_kernel        whether that integer path serves a (group, head_dim)
//   dequantize_blocks             blocks of a layer's K or V cache into a dense model-dtype cache
//                                 (the quantized prefill path: the paged prefill kernel reads it)
//
// Decoding codes to fp32: int8 sign-extends; e5m2 is the high byte of an fp16 (shift, vcvtph2ps);
// e4m3fn's exponent and mantissa shifted into an fp16 give the value times 2^-8 exactly (normals
// and subnormals alike, as both formats put the binary point the same way), so the 2^8 goes into
// the row's scale. The row scale multiplies the q.k sum (K) and the softmax weight (V), never each
// element.
//
// Decode work is split over (sequence, kv head) pairs of about equal token work, as in
// paged_attention.cpp; the G query heads of a pair share every K/V row read; the rows of the block
// kQuantPrefetchBlocks ahead are prefetched into L2 while one block is computed (random block
// placement defeats the hardware prefetchers).

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>  // not ATen/ATen.h: every operator's header, 12 s of each compile
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BATON_KVQ_AVX512 1
#endif

#include "attention_common.h"
#include "ops.h"
#include "vec16.h"

void rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& kv_layer, const at::Tensor& slot_blocks,
                    const at::Tensor& slot_offsets, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim);

namespace {

using bf16 = c10::BFloat16;

enum Fmt { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };

constexpr int64_t kScaleBytes = 2;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
Fmt fmt_of(at::ScalarType t) {
  if (t == at::kChar) return kInt8;
  if (t == at::kFloat8_e4m3fn) return kE4M3;
  TORCH_CHECK_VALUE(t == at::kFloat8_e5m2, "not a quantized KV cache dtype: ", t,
                    " (int8, float8_e4m3fn or float8_e5m2)");
  return kE5M2;
}

constexpr float qmax(Fmt f) { return f == kInt8 ? 127.f : (f == kE4M3 ? 448.f : 57344.f); }

// What a row's stored scale is multiplied by to dequantize its decoded codes (see the top).
constexpr float decode_factor(Fmt f) { return f == kE4M3 ? 256.f : 1.f; }

inline float decode_scalar(Fmt f, uint8_t b) {
  switch (f) {
    case kInt8: return static_cast<float>(static_cast<int8_t>(b));
    case kE4M3: return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
    default: return static_cast<float>(c10::Float8_e5m2(b, c10::Float8_e5m2::from_bits()));
  }
}

inline uint8_t encode_scalar(Fmt f, float x) {  // x already divided by the scale
  const float m = qmax(f);
  x = std::min(std::max(x, -m), m);
  switch (f) {
    case kInt8: return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(x)));
    case kE4M3: return c10::Float8_e4m3fn(x).x;
    default: return c10::Float8_e5m2(x).x;
  }
}

#ifdef BATON_KVQ_AVX512
// quantize_row for int8 codes, 16 values at a time: the same amax, the same division by the bf16
// scale and the same rounding (to nearest even) and clamp, so the same codes.
template <typename T>
inline void quantize_row_int8(const T* x, int64_t D, uint8_t* row) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = prefix_mask(D - d);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + d, m)));
  }
  const bf16 scale(_mm512_reduce_max_ps(amax) / 127.f);
  const float s = to_float(scale);
  const __m512 vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(127.f);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 m = prefix_mask(D - d);
    __m512i codes = _mm512_setzero_si512();
    if (s > 0.f) {
      __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16(x + d, m), vs),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_min_ps(_mm512_max_ps(q, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
      codes = _mm512_cvtps_epi32(q);
    }
    _mm_mask_storeu_epi8(row + d, m, _mm512_cvtepi32_epi8(codes));
  }
  std::memcpy(row + D, &scale.x, kScaleBytes);
}
#endif

// Quantize D values into a row of D codes and a bf16 scale (kv_quant.quantize_rows_ref).
template <typename T>
inline void quantize_row(Fmt f, const T* x, int64_t D, uint8_t* row) {
#ifdef BATON_KVQ_AVX512
  if (f == kInt8) {
    quantize_row_int8(x, D, row);
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(to_float(x[d])));
  const bf16 scale(amax / qmax(f));
  const float s = to_float(scale);
  for (int64_t d = 0; d < D; ++d) row[d] = s > 0.f ? encode_scalar(f, to_float(x[d]) / s) : 0;
  std::memcpy(row + D, &scale.x, kScaleBytes);
}

inline float row_scale(const uint8_t* row, int64_t D) {
  uint16_t bits;
  std::memcpy(&bits, row + D, kScaleBytes);
  return bf16_to_float(bits);
}

// ---------------------------------------------------------------------------------------------
// rope_and_cache_quant

template <typename T>
void quantize_rows(Fmt f, const at::Tensor& qkv, const at::Tensor& kv_layer,
                   const at::Tensor& blocks, const at::Tensor& offsets, int64_t H, int64_t KV,
                   int64_t D) {
  const int64_t N = qkv.size(0);
  const T* base = static_cast<const T*>(qkv.data_ptr());
  const int64_t qs = qkv.stride(0);
  uint8_t* cache = static_cast<uint8_t*>(kv_layer.data_ptr());
  const int64_t bstride = kv_layer.stride(0), kvstride = kv_layer.stride(1);
  const int64_t R = D + kScaleBytes, bs = kv_layer.size(3);
  const int64_t* blk = blocks.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t bst = blocks.stride(0), ost = offsets.stride(0);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, 2 * KV * D));
  at::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const T* k = base + n * qs + H * D;
      const T* v = k + KV * D;
      uint8_t* slot = cache + blk[n * bst] * bstride + off[n * ost] * R;
      for (int64_t h = 0; h < KV; ++h) {
        quantize_row(f, k + h * D, D, slot + h * bs * R);
        quantize_row(f, v + h * D, D, slot + kvstride + h * bs * R);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// paged_decode_attention_quant

struct Params {
  const void* q;
  void* out;
  const uint8_t* k;
  const uint8_t* v;
  int64_t q_bstride, q_hstride;
  int64_t o_bstride, o_hstride;
  int64_t k_bstride, v_bstride;  // bytes between consecutive blocks (dim-0 strides)
  int64_t head_stride;           // bs * R: bytes between kv heads inside a block
  int64_t H, KV, G, D, R, bs;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* lens;
  float scale;
  Fmt fmt;
};

// Portable path: any G and D, one token at a time.
template <typename T>
void attend_pair_generic(const Params& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
  const int64_t G = p.G, D = p.D, R = p.R, bs = p.bs;
  const int64_t len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;
  scratch.assign(static_cast<size_t>(2 * G * D + 2 * G + 2 * D), 0.f);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* m = acc + G * D;
  float* l = m + G;
  float* kf = l + G;
  float* vf = kf + D;
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[g * p.q_hstride + d]);
    m[g] = -std::numeric_limits<float>::infinity();
  }
  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const uint8_t* kbase = p.k + kh * p.head_stride;
  const uint8_t* vbase = p.v + kh * p.head_stride;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t blk = bt[t / bs], off = t % bs;
    const uint8_t* krow = kbase + blk * p.k_bstride + off * R;
    const uint8_t* vrow = vbase + blk * p.v_bstride + off * R;
    const float ks = row_scale(krow, D), vs = row_scale(vrow, D);
    for (int64_t d = 0; d < D; ++d) {
      kf[d] = decode_scalar(p.fmt, krow[d]);
      vf[d] = decode_scalar(p.fmt, vrow[d]);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
      s *= ks * p.scale;
      const float m_new = std::max(m[g], s);
      const float alpha = std::exp(m[g] - m_new);
      const float pe = std::exp(s - m_new);
      l[g] = l[g] * alpha + pe;
      m[g] = m_new;
      const float pv = pe * vs;
      float* ag = acc + g * D;
      for (int64_t d = 0; d < D; ++d) ag[d] = ag[d] * alpha + pv * vf[d];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * p.o_hstride + d] = from_float<T>(acc[g * D + d] * inv);
  }
}

#ifdef BATON_KVQ_AVX512
// 16 codes -> 16 fp32 (times decode_factor for e4m3).
template <Fmt F>
inline __m512 decode16(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (F == kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else if constexpr (F == kE5M2) {
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
  } else {
    // Sign-extended, a code shifted left by 7 is the fp16 of value * 2^-8 but for bit 14, which
    // the sign extension sets in negative codes.
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0xBFFF))));
  }
}

// A row of D codes as D / 16 fp32 vectors.
template <Fmt F, int D>
inline void decode_row(const uint8_t* p, __m512* r) {
#pragma GCC unroll 8
  for (int c = 0; c < D / 16; ++c) r[c] = decode16<F>(p + 16 * c);
}

// q.k of the G heads for one row: per head a vector whose lane sum is the dot product.
template <Fmt F, int G, int D>
inline void dot_row(const __m512 (&q)[G][D / 16], const uint8_t* krow, __m512* s) {
  constexpr int NV = D / 16;
  __m512 k[NV];
  decode_row<F, D>(krow, k);
#pragma GCC unroll 8
  for (int g = 0; g < G; ++g) {
    __m512 a = _mm512_mul_ps(q[g][0], k[0]);
#pragma GCC unroll 8
    for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(q[g][c], k[c], a);
    s[g] = a;
  }
}

// Raw q.k sums of the G heads for 16 rows starting at krow (rows >= n give 0, not read). The tree
// is reduced as the rows come (as in paged_attention.cpp), so few vectors are live at once.
template <Fmt F, int G, int D, bool FULL>
inline void scores16(const __m512 (&q)[G][D / 16], const uint8_t* krow, int64_t R, int n,
                     __m512* out) {
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
            dot_row<F, G, D>(q, krow + t * R, v[u]);
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

__attribute__((always_inline)) inline void prefetch_region(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
}

// How far ahead the decode loops prefetch: at 64 x 4k tokens (int8, 2 threads, Zen 4) 1 block ahead
// ran the VNNI kernel in 6.1 ms a layer, 2 in 5.6, 3 in 5.9, 4 in 6.0 (medians of 3).
constexpr int64_t kQuantPrefetchBlocks = 2;

// Block j's K and V rows of one (sequence, kv head) into L2, if the sequence has a block j. Always
// inlined: a call from the decode loops would spill every live zmm register (all caller-saved).
__attribute__((always_inline)) inline void prefetch_block(const uint8_t* kbase, const uint8_t* vbase,
                                                          const int32_t* bt, int64_t k_bstride,
                                                          int64_t v_bstride, int64_t bs, int64_t R,
                                                          int64_t len, int64_t j) {
  if (j * bs >= len) return;
  const int64_t rows = std::min(bs, len - j * bs);
  prefetch_region(kbase + bt[j] * k_bstride, rows * R);
  prefetch_region(vbase + bt[j] * v_bstride, rows * R);
}

template <typename T, Fmt F, int G, int D>
void attend_pair_avx512(const Params& p, int64_t b, int64_t kh) {
  constexpr int NV = D / 16;
  const int64_t bs = p.bs, R = p.R;
  const int64_t len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;

  __m512 qv[G][NV];
  const __m512 sc = _mm512_set1_ps(p.scale);
  for (int g = 0; g < G; ++g) {
    alignas(64) float tmp[D];
    for (int d = 0; d < D; ++d) tmp[d] = to_float(q[g * p.q_hstride + d]);
    for (int c = 0; c < NV; ++c) qv[g][c] = _mm512_mul_ps(_mm512_load_ps(tmp + 16 * c), sc);
  }
  __m512 acc[G][NV];
  __m512 m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[g] = _mm512_setzero_ps();
  }
  alignas(64) float prob[G][16];
  alignas(64) float kscale[16];
  alignas(64) float vscale[16];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const float factor = decode_factor(F);

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const uint8_t* kbase = p.k + kh * p.head_stride;
  const uint8_t* vbase = p.v + kh * p.head_stride;
  const int64_t n_blocks = (len + bs - 1) / bs;
  for (int64_t j = 1; j < kQuantPrefetchBlocks; ++j)
    prefetch_block(kbase, vbase, bt, p.k_bstride, p.v_bstride, bs, R, len, j);
  for (int64_t j = 0; j < n_blocks; ++j) {
    const uint8_t* kb = kbase + bt[j] * p.k_bstride;
    const uint8_t* vb = vbase + bt[j] * p.v_bstride;
    const int64_t blen = std::min(bs, len - j * bs);
    prefetch_block(kbase, vbase, bt, p.k_bstride, p.v_bstride, bs, R, len, j + kQuantPrefetchBlocks);
    for (int64_t t0 = 0; t0 < blen; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, blen - t0));
      const uint8_t* kr = kb + t0 * R;
      const uint8_t* vr = vb + t0 * R;
      for (int t = 0; t < 16; ++t) {
        kscale[t] = t < n ? row_scale(kr + t * R, D) * factor : 0.f;
        vscale[t] = t < n ? row_scale(vr + t * R, D) * factor : 0.f;
      }
      __m512 s[G];
      if (n == 16) {
        scores16<F, G, D, true>(qv, kr, R, n, s);
      } else {
        scores16<F, G, D, false>(qv, kr, R, n, s);
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      const __m512 ks = _mm512_load_ps(kscale);
      const __m512 vs = _mm512_load_ps(vscale);
      for (int g = 0; g < G; ++g) {
        const __m512 sg = _mm512_mask_mul_ps(neg_inf, valid, s[g], ks);
        const __m512 m_new = _mm512_max_ps(m[g], bcast_max(sg));
        if (_mm512_cmp_ps_mask(m_new, m[g], _CMP_GT_OQ)) {
          const __m512 alpha = exp_ps(_mm512_sub_ps(m[g], m_new));
          for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
          l[g] = _mm512_mul_ps(l[g], alpha);
          m[g] = m_new;
        }
        const __m512 pg = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sg, m[g])));
        l[g] = _mm512_add_ps(l[g], pg);
        _mm512_store_ps(prob[g], _mm512_mul_ps(pg, vs));  // the V row's scale goes with its weight
      }
      for (int t = 0; t < n; ++t) {
        __m512 v[NV];
        decode_row<F, D>(vr + t * R, v);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512 pb = _mm512_set1_ps(prob[g][t]);
#pragma GCC unroll 8
          for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(pb, v[c], acc[g][c]);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float lsum = _mm512_reduce_add_ps(l[g]);
    const __m512 inv = _mm512_set1_ps(lsum > 0.f ? 1.f / lsum : 0.f);
    alignas(64) float tmp[D];
    for (int c = 0; c < NV; ++c) _mm512_store_ps(tmp + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    T* og = out + g * p.o_hstride;
    for (int d = 0; d < D; ++d) og[d] = from_float<T>(tmp[d]);
  }
}

using PairFn = void (*)(const Params&, int64_t, int64_t);

#ifdef __AVX512VNNI__
// ---------------------------------------------------------------------------------------------
// int8 cache on the integer dot-product instructions (AVX512-VNNI vpdpbusd: 4 byte products
// summed into each int32 lane). The fp32 path above decodes every code to fp32 and spends as many
// instructions per row as the bf16 kernel does; this one multiplies the codes as they are:
//
// - q is quantized once per head and step: symmetric int8 with a per-head scale (the rounding of
//   a K row's own codes). q.k is then an exact integer sum of code products: 16 K rows are
//   transposed as 16 x 16 dwords so that vector c holds dword c (codes 4c..4c+3) of every row, and
//   one vpdpbusd per dword column and head adds a broadcast dword of q's codes into all 16 rows'
//   sums. vpdpbusd multiplies unsigned by signed bytes: the K codes are offset by 128 (xor 0x80),
//   and 128 * sum(q codes), the same for every row, is subtracted.
// - The softmax weights of 16 rows, each times its V row's scale, are quantized to 8 unsigned bits
//   against their largest (a scale per head and 16 rows); 4 V rows are interleaved bytewise so that
//   each int32 lane holds one value of 4 rows, and one vpdpbusd per head and 16 values adds the 4
//   rows' weighted values. The int32 sums go back to fp32 once per 16 rows. The normalizer (the
//   sum of the weights) stays fp32, so the only rounding added is each weight's half step of 1/255
//   of the largest weight among its 16 rows.
//
// kv_quant.paged_decode_attention_int8_ref computes exactly this in torch.
#define BATON_KVQ_VNNI 1

// r[t] (row t, 16 dwords) -> r[c] (dword c of rows 0..15): a 16 x 16 transpose of dwords.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4a + j], 128-bit lane L: dword 4L + j of rows 4a .. 4a + 3.
  for (int a = 0; a < 4; ++a) {
    u[4 * a + 0] = _mm512_unpacklo_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 1] = _mm512_unpackhi_epi64(t[4 * a], t[4 * a + 2]);
    u[4 * a + 2] = _mm512_unpacklo_epi64(t[4 * a + 1], t[4 * a + 3]);
    u[4 * a + 3] = _mm512_unpackhi_epi64(t[4 * a + 1], t[4 * a + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i p0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i p1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i p2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i p3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(p0, p2, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
    r[4 + j] = _mm512_shuffle_i32x4(p1, p3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
  }
}

// 4 rows of 64 codes -> x[c], whose dword lane 4L + i holds value 16L + 4c + i of rows 0..3 (a
// byte each, row order): the operand layout of vpdpbusd for a weighted sum of the 4 rows.
inline void interleave4(__m512i r0, __m512i r1, __m512i r2, __m512i r3, __m512i* x) {
  const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
  const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
  x[0] = _mm512_unpacklo_epi16(a, c);
  x[1] = _mm512_unpackhi_epi16(a, c);
  x[2] = _mm512_unpacklo_epi16(b, d);
  x[3] = _mm512_unpackhi_epi16(b, d);
}

// Rows t < n of a chunk as 64-byte vectors (rows past n read as zero, never loaded).
template <bool FULL>
inline __m512i load_row(const uint8_t* p, int t, int n) {
  if (FULL || t < n) return _mm512_loadu_si512(p);
  return _mm512_setzero_si512();
}

// The bf16 scales of 16 rows (at byte D of each) as fp32: the dword that ends with each scale is
// gathered and its low half (the row's last two codes) cleared.
inline __m512 gather_scales(const uint8_t* rows, __m512i idx, __mmask16 valid) {
  const __m512i w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, idx, rows, 1);
  return _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

template <typename T, int G, int D>
void attend_pair_vnni(const Params& p, int64_t b, int64_t kh) {
  constexpr int NZ = D / 64;  // 64-byte vectors per row
  constexpr int NC = D / 4;   // dword columns of a row
  constexpr int NV = D / 16;  // fp32 / int32 vectors of one head's output
  const int64_t bs = p.bs, R = p.R;
  const int64_t len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;

  // q (times the softmax scale) as int8 codes, 4 to a dword, and a scale per head.
  alignas(64) int32_t qd[G][NC];
  float qscale[G];
  __m512i qcorr[G];
  for (int g = 0; g < G; ++g) {
    float qf[D];
    float amax = 0.f;
    for (int d = 0; d < D; ++d) {
      qf[d] = to_float(q[g * p.q_hstride + d]) * p.scale;
      amax = std::max(amax, std::fabs(qf[d]));
    }
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t codes[D];
    int32_t sum = 0;
    for (int d = 0; d < D; ++d) {
      codes[d] = static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, qf[d] * inv))));
      sum += codes[d];
    }
    std::memcpy(qd[g], codes, D);
    qscale[g] = amax / 127.f;
    qcorr[g] = _mm512_set1_epi32(128 * sum);
  }

  __m512 acc[G][NV];
  __m512 m[G], l[G];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[g] = _mm512_setzero_ps();
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i idx = _mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(R))),
      _mm512_set1_epi32(static_cast<int32_t>(D - 2)));
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  alignas(64) uint8_t wq[G][16];

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const uint8_t* kbase = p.k + kh * p.head_stride;
  const uint8_t* vbase = p.v + kh * p.head_stride;
  const int64_t n_blocks = (len + bs - 1) / bs;
  for (int64_t j = 1; j < kQuantPrefetchBlocks; ++j)
    prefetch_block(kbase, vbase, bt, p.k_bstride, p.v_bstride, bs, R, len, j);
  for (int64_t j = 0; j < n_blocks; ++j) {
    const uint8_t* kb = kbase + bt[j] * p.k_bstride;
    const uint8_t* vb = vbase + bt[j] * p.v_bstride;
    const int64_t blen = std::min(bs, len - j * bs);
    prefetch_block(kbase, vbase, bt, p.k_bstride, p.v_bstride, bs, R, len, j + kQuantPrefetchBlocks);
    for (int64_t t0 = 0; t0 < blen; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, blen - t0));
      const bool full = n == 16;
      const uint8_t* kr = kb + t0 * R;
      const uint8_t* vr = vb + t0 * R;
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      const __m512 ks = gather_scales(kr, idx, valid);
      const __m512 vs = gather_scales(vr, idx, valid);

      // q.k: int32 sums of code products of the G heads for the 16 rows.
      __m512i dots[G];
      for (int g = 0; g < G; ++g) dots[g] = _mm512_setzero_si512();
#pragma GCC unroll 2
      for (int z = 0; z < NZ; ++z) {
        __m512i cols[16];
        for (int t = 0; t < 16; ++t) {
          cols[t] = full ? load_row<true>(kr + t * R + 64 * z, t, n) : load_row<false>(kr + t * R + 64 * z, t, n);
        }
        transpose16(cols);
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) {
          const __m512i kc = _mm512_xor_si512(cols[c], bias);
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) dots[g] = _mm512_dpbusd_epi32(dots[g], kc, _mm512_set1_epi32(qd[g][16 * z + c]));
        }
      }

      // Online softmax; each row's weight times its V scale, quantized against the largest.
      __m512 wscale[G];
      for (int g = 0; g < G; ++g) {
        const __m512 raw = _mm512_cvtepi32_ps(_mm512_sub_epi32(dots[g], qcorr[g]));
        const __m512 sg = _mm512_mask_mul_ps(neg_inf, valid, raw, _mm512_mul_ps(ks, _mm512_set1_ps(qscale[g])));
        const __m512 m_new = _mm512_max_ps(m[g], bcast_max(sg));
        if (_mm512_cmp_ps_mask(m_new, m[g], _CMP_GT_OQ)) {
          const __m512 alpha = exp_ps(_mm512_sub_ps(m[g], m_new));
          for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
          l[g] = _mm512_mul_ps(l[g], alpha);
          m[g] = m_new;
        }
        const __m512 pg = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sg, m[g])));
        l[g] = _mm512_add_ps(l[g], pg);
        const __m512 w = _mm512_mul_ps(pg, vs);
        const __m512 wmax = bcast_max(w);
        const __mmask16 nz = _mm512_cmp_ps_mask(wmax, _mm512_setzero_ps(), _CMP_GT_OQ);
        const __m512 winv = _mm512_maskz_div_ps(nz, _mm512_set1_ps(255.f), wmax);
        const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(w, winv));  // round half to even
        _mm_store_si128(reinterpret_cast<__m128i*>(wq[g]), _mm512_cvtusepi32_epi8(codes));
        wscale[g] = _mm512_mul_ps(wmax, _mm512_set1_ps(1.f / 255.f));
      }

      // sum_t w_t * v_t in int32, 4 rows at a time.
      __m512i iacc[G][NV];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) iacc[g][c] = _mm512_setzero_si512();
      for (int t4 = 0; t4 < n; t4 += 4) {
        const uint8_t* v0 = vr + t4 * R;
#pragma GCC unroll 2
        for (int z = 0; z < NZ; ++z) {
          __m512i x[4];
          interleave4(load_row<false>(v0 + 64 * z, t4, n), load_row<false>(v0 + R + 64 * z, t4 + 1, n),
                      load_row<false>(v0 + 2 * R + 64 * z, t4 + 2, n),
                      load_row<false>(v0 + 3 * R + 64 * z, t4 + 3, n), x);
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) {
            int32_t w4;
            std::memcpy(&w4, wq[g] + t4, 4);
            const __m512i wb = _mm512_set1_epi32(w4);
            for (int c = 0; c < 4; ++c) iacc[g][4 * z + c] = _mm512_dpbusd_epi32(iacc[g][4 * z + c], wb, x[c]);
          }
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c)
          acc[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g][c]), wscale[g], acc[g][c]);
    }
  }
  // acc[g][4z + c] lane 4L + i holds value 64z + 16L + 4c + i (interleave4's order).
  for (int g = 0; g < G; ++g) {
    const float lsum = _mm512_reduce_add_ps(l[g]);
    const __m512 inv = _mm512_set1_ps(lsum > 0.f ? 1.f / lsum : 0.f);
    alignas(64) float tmp[NV][16];
    for (int c = 0; c < NV; ++c) _mm512_store_ps(tmp[c], _mm512_mul_ps(acc[g][c], inv));
    T* og = out + g * p.o_hstride;
    for (int z = 0; z < NZ; ++z)
      for (int c = 0; c < 4; ++c)
        for (int L = 0; L < 4; ++L)
          for (int i = 0; i < 4; ++i) og[64 * z + 16 * L + 4 * c + i] = from_float<T>(tmp[4 * z + c][4 * L + i]);
  }
}

template <typename T>
PairFn pick_vnni(int64_t G, int64_t D) {
#define BATON_CASE(GG, DD) \
  if (G == GG && D == DD) return &attend_pair_vnni<T, GG, DD>;
  BATON_CASE(1, 64) BATON_CASE(2, 64) BATON_CASE(3, 64) BATON_CASE(4, 64)
  BATON_CASE(1, 128) BATON_CASE(2, 128) BATON_CASE(3, 128) BATON_CASE(4, 128)
#undef BATON_CASE
  return nullptr;
}
#endif  // __AVX512VNNI__


template <typename T, Fmt F>
PairFn pick_fmt(int64_t G, int64_t D) {
#define BATON_CASE(GG, DD) \
  if (G == GG && D == DD) return &attend_pair_avx512<T, F, GG, DD>;
  BATON_CASE(1, 32) BATON_CASE(2, 32) BATON_CASE(3, 32) BATON_CASE(4, 32)
  BATON_CASE(1, 64) BATON_CASE(2, 64) BATON_CASE(3, 64) BATON_CASE(4, 64)
  BATON_CASE(1, 128) BATON_CASE(2, 128) BATON_CASE(3, 128) BATON_CASE(4, 128)
#undef BATON_CASE
  return nullptr;
}

template <typename T>
PairFn pick_avx512(Fmt f, int64_t G, int64_t D) {
  switch (f) {
    case kInt8: {
#ifdef BATON_KVQ_VNNI
      if (const PairFn f = pick_vnni<T>(G, D)) return f;
#endif
      return pick_fmt<T, kInt8>(G, D);
    }
    case kE4M3: return pick_fmt<T, kE4M3>(G, D);
    default: return pick_fmt<T, kE5M2>(G, D);
  }
}
#endif  // BATON_KVQ_AVX512

// Split the (b, kv_head) pairs into `parts` contiguous ranges of about equal token work.
std::vector<int64_t> balanced_split(const Params& p, int64_t B, int64_t parts) {
  const int64_t n_pairs = B * p.KV;
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, n_pairs);
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += (p.lens[b] + 32) * p.KV;
  int64_t done = 0, part = 1;
  bounds[0] = 0;
  for (int64_t pair = 0; pair < n_pairs && part < parts; ++pair) {
    while (part < parts && done >= total * part / parts) bounds[part++] = pair;
    done += p.lens[pair / p.KV] + 32;
  }
  return bounds;
}

template <typename T>
void run(const Params& p, int64_t B) {
  const int64_t n_pairs = B * p.KV;
#ifdef BATON_KVQ_AVX512
  const PairFn fast = pick_avx512<T>(p.fmt, p.G, p.D);
#endif
  auto do_range = [&](int64_t lo, int64_t hi) {
#ifdef BATON_KVQ_AVX512
    if (fast != nullptr) {
      for (int64_t i = lo; i < hi; ++i) fast(p, i / p.KV, i % p.KV);
      return;
    }
#endif
    std::vector<float> scratch;
    for (int64_t i = lo; i < hi; ++i) attend_pair_generic<T>(p, i / p.KV, i % p.KV, scratch);
  };
  if (decode_attention_is_serial(p.lens, B, p.KV)) {
    do_range(0, n_pairs);
    return;
  }
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::min(threads, n_pairs);
  const std::vector<int64_t> bounds = balanced_split(p, B, parts);
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t part = lo; part < hi; ++part) do_range(bounds[part], bounds[part + 1]);
  });
}

// Checks a layer's quantized K or V cache view [num_blocks, KV, bs, D + 2] against head_dim D.
void check_cache(const char* op, const at::Tensor& c, int64_t D) {
  TORCH_CHECK_VALUE(c.device().is_cpu(), op, ": the cache must be on the CPU");
  TORCH_CHECK_VALUE(c.dim() == 4, op, ": the cache must be [num_blocks, KV, block_size, D + 2], got ",
                    c.sizes());
  fmt_of(c.scalar_type());
  TORCH_CHECK_VALUE(c.size(3) == D + kScaleBytes, op, ": cache rows of ", c.size(3),
                    " bytes do not hold head_dim ", D, " plus a ", kScaleBytes, "-byte scale");
  TORCH_CHECK_VALUE(c.stride(3) == 1 && c.stride(2) == c.size(3) && c.stride(1) == c.size(2) * c.size(3),
                    op, ": the cache must be contiguous in its last three dims, strides ", c.strides());
}

inline bool is_model_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

}  // namespace

void rope_and_cache_quant(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& kv_layer,
                          const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const Fmt f = fmt_of(kv_layer.scalar_type());
  const int64_t N = qkv.size(0), KV = num_kv_heads, D = head_dim;
  TORCH_CHECK_VALUE(kv_layer.device().is_cpu() && kv_layer.dim() == 5 && kv_layer.size(1) == 2 &&
                        kv_layer.size(2) == KV && kv_layer.size(4) == D + kScaleBytes,
                    "rope_and_cache_quant: kv_layer must be [num_blocks, 2, ", KV, ", block_size, ",
                    D + kScaleBytes, "], got ", kv_layer.sizes());
  const int64_t R = D + kScaleBytes, bs = kv_layer.size(3);
  TORCH_CHECK_VALUE(kv_layer.stride(4) == 1 && kv_layer.stride(3) == R && kv_layer.stride(2) == bs * R,
                    "rope_and_cache_quant: kv_layer must be contiguous in its last three dims, strides ",
                    kv_layer.strides());
  TORCH_CHECK_VALUE(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                        slot_blocks.dim() == 1 && slot_offsets.dim() == 1 && slot_blocks.size(0) == N &&
                        slot_offsets.size(0) == N,
                    "rope_and_cache_quant: slot_blocks and slot_offsets must be [", N, "] int64");
  const int64_t* blk = slot_blocks.data_ptr<int64_t>();
  const int64_t* off = slot_offsets.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK_VALUE(blk[n * slot_blocks.stride(0)] >= 0 && blk[n * slot_blocks.stride(0)] < kv_layer.size(0),
                      "rope_and_cache_quant: slot_blocks[", n, "] out of range");
    TORCH_CHECK_VALUE(off[n * slot_offsets.stride(0)] >= 0 && off[n * slot_offsets.stride(0)] < bs,
                      "rope_and_cache_quant: slot_offsets[", n, "] out of range");
  }
  // The rotation (and every check of qkv, positions, tables, block ids and offsets) is
  // rope_and_cache's, into a dense one-slot-per-row scratch cache; k and v are then read from qkv,
  // rotated in place.
  const at::Tensor scratch = at::empty({N, 2, KV, 1, D}, qkv.options());
  const at::Tensor rows = at::arange(N, positions.options().dtype(at::kLong));
  rope_and_cache(qkv, positions, cos, sin, scratch, rows, at::zeros_like(rows), num_heads, KV, D);
  if (qkv.scalar_type() == at::kFloat) {
    quantize_rows<float>(f, qkv, kv_layer, slot_blocks, slot_offsets, num_heads, KV, D);
  } else {
    quantize_rows<bf16>(f, qkv, kv_layer, slot_blocks, slot_offsets, num_heads, KV, D);
  }
}

void paged_decode_attention_quant(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                                  at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && out.device().is_cpu() && block_tables.device().is_cpu() &&
                        context_lens.device().is_cpu(),
                    "paged_decode_attention_quant: all tensors must be on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [B, H, D], got ", q.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(is_model_dtype(dtype), "unsupported q dtype ", dtype, " (float32 or bfloat16)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_cache("paged_decode_attention_quant", k_cache, D);
  check_cache("paged_decode_attention_quant", v_cache, D);
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
                    "k_cache and v_cache differ: ", k_cache.sizes(), " vs ", v_cache.sizes());
  const int64_t KV = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK_VALUE(KV > 0 && H % KV == 0, "num_heads ", H, " must be a multiple of num_kv_heads ", KV);
  TORCH_CHECK_VALUE(q.stride(2) == 1, "q must be contiguous in its last dim, strides ", q.strides());
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == dtype && out.stride(2) == 1,
                    "out must be ", q.sizes(), " ", dtype, " with a contiguous last dim");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
                    "block_tables and context_lens must be int32");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == B &&
                        (block_tables.stride(1) == 1 || block_tables.size(1) <= 1),
                    "block_tables must be [B, max_blocks] with a contiguous last dim, got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == B,
                    "context_lens must be [B], got ", context_lens.sizes());
  const at::Tensor lens_c = context_lens.contiguous();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= max_blocks * bs, "context_lens[", b, "] = ", lens[b],
                      " is out of range for ", max_blocks, " blocks of ", bs);
    const int64_t nb = (lens[b] + bs - 1) / bs;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t id = bt[b * block_tables.stride(0) + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                        " is out of range for ", num_blocks, " blocks");
    }
  }
  if (B == 0 || H == 0 || D == 0) return;
  Params p;
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.k = static_cast<const uint8_t*>(k_cache.data_ptr());
  p.v = static_cast<const uint8_t*>(v_cache.data_ptr());
  p.q_bstride = q.stride(0);
  p.q_hstride = q.stride(1);
  p.o_bstride = out.stride(0);
  p.o_hstride = out.stride(1);
  p.k_bstride = k_cache.stride(0);
  p.v_bstride = v_cache.stride(0);
  p.R = D + kScaleBytes;
  p.head_stride = bs * p.R;
  p.H = H;
  p.KV = KV;
  p.G = H / KV;
  p.D = D;
  p.bs = bs;
  p.block_tables = bt;
  p.bt_stride = block_tables.stride(0);
  p.lens = lens;
  p.scale = static_cast<float>(scale);
  p.fmt = fmt_of(k_cache.scalar_type());
  if (dtype == at::kFloat) {
    run<float>(p, B);
  } else {
    run<bf16>(p, B);
  }
}

void dequantize_blocks(at::Tensor out, at::Tensor cache, at::Tensor block_ids) {
  TORCH_CHECK_VALUE(out.device().is_cpu() && block_ids.device().is_cpu(),
                    "dequantize_blocks: all tensors must be on the CPU");
  TORCH_CHECK_VALUE(out.dim() == 4 && out.is_contiguous() && is_model_dtype(out.scalar_type()),
                    "dequantize_blocks: out must be a contiguous [n, KV, block_size, D] float32 or "
                    "bfloat16 tensor, got ", out.sizes(), " ", out.scalar_type());
  const int64_t D = out.size(3);
  check_cache("dequantize_blocks", cache, D);
  TORCH_CHECK_VALUE(cache.size(1) == out.size(1) && cache.size(2) == out.size(2),
                    "dequantize_blocks: out ", out.sizes(), " does not match the cache ", cache.sizes());
  TORCH_CHECK_VALUE(block_ids.scalar_type() == at::kInt && block_ids.dim() == 1 &&
                        block_ids.size(0) == out.size(0),
                    "dequantize_blocks: block_ids must be [", out.size(0), "] int32");
  const at::Tensor ids_c = block_ids.contiguous();
  const int32_t* ids = ids_c.data_ptr<int32_t>();
  for (int64_t i = 0; i < ids_c.size(0); ++i)
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < cache.size(0), "dequantize_blocks: block id ", ids[i],
                      " is out of range for ", cache.size(0), " blocks");
  const Fmt f = fmt_of(cache.scalar_type());
  const int64_t rows_per_block = cache.size(1) * cache.size(2), R = D + kScaleBytes;
  const uint8_t* src = static_cast<const uint8_t*>(cache.data_ptr());
  const int64_t bstride = cache.stride(0);
  auto body = [&](auto* dst) {
    using T = std::remove_pointer_t<decltype(dst)>;
    at::parallel_for(0, out.size(0), 4, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const uint8_t* blk = src + ids[i] * bstride;
        T* o = dst + i * rows_per_block * D;
        for (int64_t r = 0; r < rows_per_block; ++r) {
          const uint8_t* row = blk + r * R;
          const float s = row_scale(row, D);
          int64_t d = 0;
#ifdef BATON_KVQ_AVX512
          if (f == kInt8) {  // 16 codes at a time
            const __m512 vs = _mm512_set1_ps(s);
            for (; d + 16 <= D; d += 16) {
              store16(o + r * D + d, _mm512_mul_ps(decode16<kInt8>(row + d), vs), 0xFFFF);
            }
          }
#endif
          for (; d < D; ++d) o[r * D + d] = from_float<T>(decode_scalar(f, row[d]) * s);
        }
      }
    });
  };
  if (out.scalar_type() == at::kFloat) {
    body(out.data_ptr<float>());
  } else {
    body(static_cast<bf16*>(out.data_ptr()));
  }
}

bool kv_int8_integer_kernel(int64_t group, int64_t head_dim) {
#ifdef BATON_KVQ_VNNI
  return pick_vnni<float>(group, head_dim) != nullptr;
#else
  (void)group;
  (void)head_dim;
  return false;
#endif
}
