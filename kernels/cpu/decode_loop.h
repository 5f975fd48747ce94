// The decode loop: one query token of each (sequence, kv head) pair against that sequence's paged
// K/V, with the G = H / KV query heads of the pair sharing every K and V row read. Written once for
// the two kernels that run it:
//   paged_attention.cpp (FROM_STATE = false): from an empty online-softmax state, from block 0;
//   cascade.cpp's suffix pass (FROM_STATE = true): from the state the shared pass left for each
//     (row, head) (running max = its log-sum-exp, sum = 1, accumulator = its normalized output),
//     from the row's first unshared block. Continuing the online softmax from a partial result is
//     the log-sum-exp merge (FlashInfer's merge_state) done in registers.
//
// Params (either kernel's) provides q, out, k, v, q_bstride, q_hstride, o_bstride, o_hstride,
// k_bstride, v_bstride, head_stride, H, KV, G, D, bs, block_tables, bt_stride, lens and scale; with
// FROM_STATE also start_block ([B] first block of each row), state_o ([B, H, D] fp32) and
// state_lse ([B, H]; -inf: no state, start empty). The FROM_STATE branches are `if constexpr`, so
// paged decode compiles to the loop it had before this was shared.
//
// Streaming softmax in fp32, chunk by chunk (16 tokens, never crossing a block). The AVX-512 loop
// computes 16 token scores per head with a transposing reduction tree, one exp per 16 tokens, and
// converts bf16 to fp32 in registers (so V accumulates in the order of Row<T, D>::dim, undone when
// the output is written), and software-prefetches K/V rows kPrefetchBlocks blocks ahead along a
// thread's range of pairs, since random block placement defeats the hardware prefetchers. On AVX2
// (G 1-4, D 64 or 128) decode_pair_avx2 does the same 16 keys at a time with 8-lane vectors. The
// portable loop (any G and D) takes one token at a time (8 on AVX2, attention_avx2.h).
//
// In an anonymous namespace, as attention_common.h: each kernel's translation unit gets its own
// instantiations (cpu_ops hashes this header into the build's name).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "attention_common.h"
#include "attention_avx2.h"
#include "sleef_exp.h"

namespace {

// First block of pair (b, *)'s loop.
template <bool FROM_STATE, typename Params>
inline int64_t decode_first_block(const Params& p, int64_t b) {
  if constexpr (FROM_STATE) {
    return p.start_block[b];
  } else {
    return 0;
  }
}

// ---------------------------------------------------------------------------------------------
// Portable loop: any G and D, up to kGenericChunk tokens of one block at a time: their scores, one
// rescale of the state a chunk, and the chunk's exps in one vectorizable loop (SLEEF's expf, as
// torch's vectorized exp), where one token at a time took two libm exps a token and head (on a
// 2-core AVX2-only EPYC, W1 spent 10% of its samples in libm's expf and 13% in this loop).
constexpr int64_t kGenericChunk = 16;

template <typename T, bool FROM_STATE, typename Params>
void decode_pair_generic(const Params& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
  const int64_t G = p.G, D = p.D, bs = p.bs;
  const int64_t len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;
  scratch.assign(static_cast<size_t>(2 * G * D + 2 * G + G * kGenericChunk), 0.f);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* m = acc + G * D;
  float* l = m + G;
  float* sc = l + G;  // [G][kGenericChunk]: the chunk's scores, then their exps
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[g * p.q_hstride + d]);
    if constexpr (FROM_STATE) {
      const int64_t h = kh * G + g;
      const float lse = p.state_lse[b * p.H + h];
      m[g] = lse;
      if (lse > -std::numeric_limits<float>::infinity()) {  // max lse, sum 1, acc its output
        l[g] = 1.f;
        const float* o = p.state_o + (b * p.H + h) * D;
        for (int64_t d = 0; d < D; ++d) acc[g * D + d] = o[d];
      }
    } else {
      m[g] = -std::numeric_limits<float>::infinity();
    }
  }
  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  const int64_t first = decode_first_block<FROM_STATE>(p, b) * bs;
#ifdef BATON_VEC8
  const bool done =
      attend_keys_avx2(kbase, vbase, bt, p.k_bstride, p.v_bstride, bs, D, first, len, qf, G, p.scale, acc, m, l);
#else
  constexpr bool done = false;
#endif
  for (int64_t t = done ? len : first; t < len;) {
    const int64_t blk = bt[t / bs], off = t % bs;
    const int64_t n = std::min({kGenericChunk, bs - off, len - t});
    const T* kchunk = kbase + blk * p.k_bstride + off * D;  // the chunk's rows, D apart
    const T* vchunk = vbase + blk * p.v_bstride + off * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float* sg = sc + g * kGenericChunk;
      for (int64_t j = 0; j < n; ++j) {
        const T* krow = kchunk + j * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(krow[d]);
        sg[j] = s * p.scale;
      }
      float m_new = m[g];
      for (int64_t j = 0; j < n; ++j) m_new = std::max(m_new, sg[j]);
      const float alpha = std::exp(m[g] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; ++j) {
        const float pe = sleef_expf(sg[j] - m_new);
        sg[j] = pe;
        sum += pe;
      }
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] *= alpha;
      for (int64_t j = 0; j < n; ++j) {
        const T* vrow = vchunk + j * D;
        const float pe = sg[j];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += pe * to_float(vrow[d]);
      }
    }
    t += n;
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * p.o_hstride + d] = from_float<T>(acc[g * D + d] * inv);
  }
}

#if defined(__AVX512F__) || defined(BATON_VEC8)
// Walks the (pair, block) sequence of a thread's range, from each pair's first block,
// kPrefetchBlocks ahead of the computation.
template <typename Params, bool FROM_STATE>
struct DecodePrefetch {
  const Params* p = nullptr;
  int64_t pair = 0, end = 0, block = 0, elem_size = 0;
  const char* k = nullptr;  // the block being prefetched
  const char* v = nullptr;
  int64_t rows = 0;         // rows of it that hold tokens (0: nothing left)

  // Start at begin_pair and prefetch the first kPrefetchBlocks blocks (nothing to overlap with).
  void start(const Params& params, int64_t begin_pair, int64_t end_pair, int64_t esize) {
    p = &params;
    pair = begin_pair;
    end = end_pair;
    block = begin_pair < end_pair ? decode_first_block<FROM_STATE>(*p, begin_pair / p->KV) - 1 : -1;
    elem_size = esize;
    advance();
    const int64_t row_bytes = p->D * esize;
    for (int i = 0; i < kPrefetchBlocks; ++i) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < row_bytes; o += 64) {
          _mm_prefetch(k + r * row_bytes + o, BATON_PREFETCH_HINT);
          _mm_prefetch(v + r * row_bytes + o, BATON_PREFETCH_HINT);
        }
      advance();
    }
  }
  // Move to the next (pair, block) with tokens.
  void advance() {
    ++block;
    while (pair < end) {
      const int64_t b = pair / p->KV, kh = pair % p->KV;
      const int64_t len = p->lens[b];
      if (block * p->bs < len) {
        const int64_t id = p->block_tables[b * p->bt_stride + block];
        const int64_t head = kh * p->head_stride;
        k = static_cast<const char*>(p->k) + (id * p->k_bstride + head) * elem_size;
        v = static_cast<const char*>(p->v) + (id * p->v_bstride + head) * elem_size;
        rows = std::min(p->bs, len - block * p->bs);
        return;
      }
      ++pair;
      block = pair < end ? decode_first_block<FROM_STATE>(*p, pair / p->KV) : 0;
    }
    k = v = nullptr;
    rows = 0;
  }
};

template <typename T, typename Params, bool FROM_STATE>
using DecodePairFn = void (*)(const Params&, int64_t, int64_t, DecodePrefetch<Params, FROM_STATE>&);
#endif

#ifdef BATON_VEC8
// ---------------------------------------------------------------------------------------------
// AVX2 loop (G 1-4, D 64 or 128): a block's keys 16 at a time, each K row widened in registers
// once for the G heads (8-lane partial dot products, summed across lanes by vec8.h's tree), the
// running max moved only when a chunk's max exceeds it (one scalar exp and a rescale of the
// accumulators then), the chunk's exps in two 8-lane SLEEF expfs, the softmax sums lane-wise until
// the end, and V read 8 dims at a time for the G heads' accumulators (in L1: G x D floats do not
// fit 16 registers). K/V rows of the block kPrefetchBlocks ahead are prefetched as the keys are
// scored, as the AVX-512 loop does. attention_avx2.h's chunk (the portable loop's, before this)
// staged every widened row through the stack, took a libm exp a head and 8 keys, and prefetched
// nothing: decode attention read ~6 GB/s on a 2-core Zen 3 where the machine streams ~18.
// 16 elements of a row as two 8-lane vectors. bf16: one 256-bit load, its even elements (shifted
// up) and its odd ones (masked), 3 instructions where two widening loads take 6; fp32 and fp16 in
// order. q, K and V are read alike, so q.k is the same sum and the accumulators hold dims in the
// order pair_dim gives, undone when the output is written.
inline void load_pair(const c10::BFloat16* p, __m256& a, __m256& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}
template <typename T>
inline void load_pair(const T* p, __m256& a, __m256& b) {
  a = widen8(p);
  b = widen8(p + 8);
}
// The row dim that lane i of accumulator vector u holds (16 dims per pair of vectors).
template <typename T>
constexpr int pair_dim(int u, int i) {
  return std::is_same_v<T, c10::BFloat16> ? 16 * (u / 2) + 2 * i + u % 2 : 8 * u + i;
}

template <typename T, int G, int D, bool FROM_STATE, typename Params>
void decode_pair_avx2(const Params& p, int64_t b, int64_t kh, DecodePrefetch<Params, FROM_STATE>& pf) {
  constexpr int U = D / 8;
  constexpr int64_t kRowBytes = D * sizeof(T);
  const int64_t bs = p.bs, len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;
  alignas(32) float qf[G][D];  // q * scale
  alignas(32) float acc[G][D];
  alignas(32) __m256 part[G][16];  // key t's 8-lane partial q.k
  alignas(32) float prob[G][16];
  float m[G];
  __m256 l[G];  // lane-wise softmax sums
  const __m256 scale = _mm256_set1_ps(p.scale);
  for (int g = 0; g < G; ++g) {
    for (int w = 0; w < U / 2; ++w) {
      __m256 q0, q1;
      load_pair(q + g * p.q_hstride + 16 * w, q0, q1);
      _mm256_store_ps(qf[g] + 16 * w, _mm256_mul_ps(q0, scale));
      _mm256_store_ps(qf[g] + 16 * w + 8, _mm256_mul_ps(q1, scale));
    }
    for (int u = 0; u < U; ++u) _mm256_store_ps(acc[g] + 8 * u, _mm256_setzero_ps());
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = _mm256_setzero_ps();
    if constexpr (FROM_STATE) {
      const int64_t h = kh * G + g;
      const float lse = p.state_lse[b * p.H + h];
      if (lse > -std::numeric_limits<float>::infinity()) {  // max lse, sum 1, acc its output
        m[g] = lse;
        l[g] = _mm256_setr_ps(1.f, 0, 0, 0, 0, 0, 0, 0);
        const float* o = p.state_o + (b * p.H + h) * D;
        for (int u = 0; u < U; ++u)
          for (int i = 0; i < 8; ++i) acc[g][8 * u + i] = o[pair_dim<T>(u, i)];
      }
    }
  }
  const __m256 lanes = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  const int64_t n_blocks = (len + bs - 1) / bs;
  for (int64_t j = decode_first_block<FROM_STATE>(p, b); j < n_blocks; ++j) {
    const T* kb = kbase + bt[j] * p.k_bstride;
    const T* vb = vbase + bt[j] * p.v_bstride;
    const int64_t blen = std::min(bs, len - j * bs);
    const char* pk = pf.k;  // locals: GCC drops prefetches of addresses it reloads from *this
    const char* pv = pf.v;
    const int64_t p_rows = pf.rows;
    for (int64_t t0 = 0; t0 < blen; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, blen - t0));
      const T* kr = kb + t0 * D;
      const T* vr = vb + t0 * D;
      for (int t = 0; t < n; ++t) {
        if (t0 + t < p_rows) prefetch_row<kRowBytes>(pk, pv, t0 + t);
        __m256 a[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) a[g] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int w = 0; w < U / 2; ++w) {
          __m256 k0, k1;
          load_pair(kr + t * D + 16 * w, k0, k1);
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) {
            a[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + 16 * w), k0, a[g]);
            a[g] = _mm256_fmadd_ps(_mm256_load_ps(qf[g] + 16 * w + 8), k1, a[g]);
          }
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) part[g][t] = a[g];
      }
      for (int t = n; t < 16; ++t)
        for (int g = 0; g < G; ++g) part[g][t] = _mm256_setzero_ps();
      const __m256 live0 = _mm256_cmp_ps(lanes, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
      const __m256 live1 = _mm256_cmp_ps(lanes, _mm256_set1_ps(static_cast<float>(n - 8)), _CMP_LT_OQ);
      for (int g = 0; g < G; ++g) {
        const __m256 s0 = _mm256_blendv_ps(ninf, sum8x8(part[g]), live0);
        const __m256 s1 = n > 8 ? _mm256_blendv_ps(ninf, sum8x8(part[g] + 8), live1) : ninf;
        const float mx = hmax8(_mm256_max_ps(s0, s1));
        if (mx > m[g]) {  // the running max grew: rescale (alpha 0 on an empty state)
          const __m256 alpha = _mm256_set1_ps(sleef_expf(m[g] - mx));
          for (int u = 0; u < U; ++u)
            _mm256_store_ps(acc[g] + 8 * u, _mm256_mul_ps(_mm256_load_ps(acc[g] + 8 * u), alpha));
          l[g] = _mm256_mul_ps(l[g], alpha);
          m[g] = mx;
        }
        const __m256 mv = _mm256_set1_ps(m[g]);
        const __m256 e0 = sleef_expf8(_mm256_sub_ps(s0, mv));
        const __m256 e1 = sleef_expf8(_mm256_sub_ps(s1, mv));
        _mm256_store_ps(prob[g], e0);
        _mm256_store_ps(prob[g] + 8, e1);
        l[g] = _mm256_add_ps(l[g], _mm256_add_ps(e0, e1));
      }
      for (int w = 0; w < U / 2; ++w) {
        __m256 o0[G], o1[G];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          o0[g] = _mm256_load_ps(acc[g] + 16 * w);
          o1[g] = _mm256_load_ps(acc[g] + 16 * w + 8);
        }
        for (int t = 0; t < n; ++t) {
          __m256 v0, v1;
          load_pair(vr + t * D + 16 * w, v0, v1);
#pragma GCC unroll 4
          for (int g = 0; g < G; ++g) {
            const __m256 pb = _mm256_broadcast_ss(prob[g] + t);
            o0[g] = _mm256_fmadd_ps(pb, v0, o0[g]);
            o1[g] = _mm256_fmadd_ps(pb, v1, o1[g]);
          }
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          _mm256_store_ps(acc[g] + 16 * w, o0[g]);
          _mm256_store_ps(acc[g] + 16 * w + 8, o1[g]);
        }
      }
    }
    for (int64_t r = blen; r < p_rows; ++r) prefetch_row<kRowBytes>(pk, pv, r);  // short block
    pf.advance();
  }
  alignas(32) float row[D];  // the output in dim order
  for (int g = 0; g < G; ++g) {
    const float lsum = hsum8(l[g]);
    const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
    for (int u = 0; u < U; ++u)
      for (int i = 0; i < 8; ++i) row[pair_dim<T>(u, i)] = acc[g][8 * u + i] * inv;
    T* og = out + g * p.o_hstride;
    for (int u = 0; u < U; ++u) store8(og + 8 * u, _mm256_load_ps(row + 8 * u));
  }
}

// The AVX2 loop for G query heads per kv head and head dim D, or nullptr (the portable loop).
template <typename T, typename Params, bool FROM_STATE>
DecodePairFn<T, Params, FROM_STATE> pick_decode_avx2(int64_t G, int64_t D) {
#define BATON_CASE(GG, DD) \
  if (G == GG && D == DD) return &decode_pair_avx2<T, GG, DD, FROM_STATE, Params>;
  BATON_CASE(1, 64) BATON_CASE(2, 64) BATON_CASE(3, 64) BATON_CASE(4, 64)
  BATON_CASE(1, 128) BATON_CASE(2, 128) BATON_CASE(3, 128) BATON_CASE(4, 128)
#undef BATON_CASE
  return nullptr;
}
#endif  // BATON_VEC8

#if defined(__AVX512F__)
// ---------------------------------------------------------------------------------------------
// AVX-512 loop.


template <typename T, int G, int D, bool FROM_STATE, typename Params>
void decode_pair_avx512(const Params& p, int64_t b, int64_t kh, DecodePrefetch<Params, FROM_STATE>& pf) {
  using R = Row<T, D>;
  constexpr int NV = D / 16;
  const int64_t bs = p.bs;
  const int64_t len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;

  Dot<T, G, D> dot;
  dot.init(q, p.q_hstride);
  __m512 acc[G][NV];
  __m512 m[G], l[G];  // running max (all lanes equal) and lane-wise partial softmax sums
  alignas(64) float tmp[16 * NV];  // a state row (FROM_STATE) and the output, in memory order
  for (int g = 0; g < G; ++g) {
    if constexpr (FROM_STATE) {
      const int64_t h = kh * G + g;
      const float lse = p.state_lse[b * p.H + h];
      m[g] = _mm512_set1_ps(lse);
      if (lse > -std::numeric_limits<float>::infinity()) {  // max lse, sum 1, acc its output
        const float* o = p.state_o + (b * p.H + h) * D;
        for (int c = 0; c < NV; ++c)
          for (int i = 0; i < 16; ++i) tmp[16 * c + i] = o[R::dim(c, i)];
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_load_ps(tmp + 16 * c);
        l[g] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(1.f));
      } else {
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
        l[g] = _mm512_setzero_ps();
      }
    } else {
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
      m[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      l[g] = _mm512_setzero_ps();
    }
  }
  alignas(64) float prob[G][16];
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  const int64_t n_blocks = (len + bs - 1) / bs;
  constexpr int64_t kRowBytes = D * sizeof(T);
  for (int64_t j = decode_first_block<FROM_STATE>(p, b); j < n_blocks; ++j) {
    const T* kb = kbase + bt[j] * p.k_bstride;
    const T* vb = vbase + bt[j] * p.v_bstride;
    const int64_t blen = std::min(bs, len - j * bs);
    const char* pk = pf.k;  // locals: GCC drops prefetches of addresses it reloads from *this
    const char* pv = pf.v;
    const int64_t p_rows = pf.rows;
    for (int64_t t0 = 0; t0 < blen; t0 += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, blen - t0));
      const T* kr = kb + t0 * D;
      const T* vr = vb + t0 * D;
      __m512 s[G];
      if (n == 16) {
        scores16<T, G, D, true>(dot, kr, n, s);
      } else {
        scores16<T, G, D, false>(dot, kr, n, s);
      }
      const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
      for (int g = 0; g < G; ++g) {
        const __m512 sg = _mm512_mask_mul_ps(neg_inf, valid, s[g], scale);
        const __m512 m_new = _mm512_max_ps(m[g], bcast_max(sg));  // all lanes equal
        if (_mm512_cmp_ps_mask(m_new, m[g], _CMP_GT_OQ)) {  // running max grew: rescale
          const __m512 alpha = exp_ps(_mm512_sub_ps(m[g], m_new));  // 0 on an empty state
          for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
          l[g] = _mm512_mul_ps(l[g], alpha);
          m[g] = m_new;
        }
        const __m512 pg = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sg, m[g])));
        _mm512_store_ps(prob[g], pg);
        l[g] = _mm512_add_ps(l[g], pg);  // lane-wise partial sums, reduced at the end
      }
      for (int t = 0; t < n; ++t) {
        if (t0 + t < p_rows) prefetch_row<kRowBytes>(pk, pv, t0 + t);
        __m512 v[NV];
        R::load(vr + t * D, v);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const __m512 pb = _mm512_set1_ps(prob[g][t]);
#pragma GCC unroll 8
          for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(pb, v[c], acc[g][c]);
        }
      }
    }
    for (int64_t r = blen; r < p_rows; ++r) prefetch_row<kRowBytes>(pk, pv, r);  // short block
    pf.advance();
  }

  for (int g = 0; g < G; ++g) {
    const float lsum = _mm512_reduce_add_ps(l[g]);
    const __m512 inv = _mm512_set1_ps(lsum > 0.f ? 1.f / lsum : 0.f);
    for (int c = 0; c < NV; ++c) _mm512_store_ps(tmp + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    T* og = out + g * p.o_hstride;
    for (int c = 0; c < NV; ++c)
      for (int i = 0; i < 16; ++i) og[R::dim(c, i)] = from_float<T>(tmp[16 * c + i]);
  }
}

// The AVX-512 loop for G query heads per kv head and head dim D, or nullptr (the portable loop).
template <typename T, typename Params, bool FROM_STATE>
DecodePairFn<T, Params, FROM_STATE> pick_decode_avx512(int64_t G, int64_t D) {
#define BATON_CASE(GG, DD) \
  if (G == GG && D == DD) return &decode_pair_avx512<T, GG, DD, FROM_STATE, Params>;
  BATON_CASE(1, 64) BATON_CASE(2, 64) BATON_CASE(3, 64) BATON_CASE(4, 64)
  BATON_CASE(1, 128) BATON_CASE(2, 128) BATON_CASE(3, 128) BATON_CASE(4, 128)
#undef BATON_CASE
  return nullptr;
}
#endif  // __AVX512F__

// Every pair of [lo, hi) (pair i = (sequence i / KV, kv head i % KV)) on one thread: the AVX-512
// loop where it has one for this G and D, else the portable one.
template <typename T, bool FROM_STATE, typename Params>
void decode_range(const Params& p, int64_t lo, int64_t hi) {
#if defined(__AVX512F__)
  const DecodePairFn<T, Params, FROM_STATE> fast = pick_decode_avx512<T, Params, FROM_STATE>(p.G, p.D);
  if (fast != nullptr) {
    DecodePrefetch<Params, FROM_STATE> pf;
    pf.start(p, lo, hi, sizeof(T));
    for (int64_t i = lo; i < hi; ++i) fast(p, i / p.KV, i % p.KV, pf);
    return;
  }
#endif
#ifdef BATON_VEC8
  const DecodePairFn<T, Params, FROM_STATE> fast = pick_decode_avx2<T, Params, FROM_STATE>(p.G, p.D);
  if (fast != nullptr) {
    DecodePrefetch<Params, FROM_STATE> pf;
    pf.start(p, lo, hi, sizeof(T));
    for (int64_t i = lo; i < hi; ++i) fast(p, i / p.KV, i % p.KV, pf);
    return;
  }
#endif
  std::vector<float> scratch;
  for (int64_t i = lo; i < hi; ++i) decode_pair_generic<T, FROM_STATE>(p, i / p.KV, i % p.KV, scratch);
}

}  // namespace
