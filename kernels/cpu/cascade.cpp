// Cascade decode attention for the CPU: one query token per sequence, where groups of sequences
// share the first blocks of their block tables (prefix caching hands requests with a common prompt
// prefix the same physical blocks). Matches baton.kernels.cascade.cascade_decode_attention_ref,
// which is exact attention over each row's whole context (paged_decode_attention_ref).
//
//   q, out, k/v_cache, block_tables, context_lens: as paged_decode_attention (paged_attention.cpp)
//   group_rows:    [R] int32    the decode rows of every group, group after group
//   group_starts:  [NG + 1] int32  group g owns group_rows[group_starts[g] .. group_starts[g+1])
//   group_blocks:  [NG] int32   full blocks group g shares (the first member's first ids; every
//                               member's table must start with the same ids)
//
// Two passes, then an exact merge:
//  1. Shared pass, per (group, kv head, tile of query rows): the rows are (member, query head)
//     pairs, all against the same shared keys, so this is a GEMM-shaped problem (S = Q K^T,
//     streaming softmax, O = P V) on K/V packed once per (group, kv head) into a thread-local
//     buffer -- the paged prefill kernel's inner loop (paged_prefill.cpp) without a causal mask.
//     It writes each (row, head)'s normalized partial output and log-sum-exp (fp32 scratch).
//  2. Suffix pass, per (row, kv head): the paged decode kernel's loop (paged_attention.cpp) over
//     the row's own blocks only (from group_blocks on), started from the shared pass's state
//     (running max = lse, sum = 1, accumulator = partial output): continuing the online softmax
//     from a partial result is the log-sum-exp merge (FlashInfer's merge_state) done in registers.
// Rows in no group run pass 2 alone over their whole context, as the plain kernel does.
// Both kernels' AVX-512 helpers (row loaders, dot products, exp polynomials, chunk packing) come
// from attention_common.h; the two loops themselves are adaptations of theirs (no mask, an LSE out;
// a start from a state), kept here. The portable path (no AVX-512, or other G / D) is a scalar loop
// for both passes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

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

// ---------------------------------------------------------------------------------------------
// Portable paths.

// Shared pass of one item, one (row, head) and one key at a time.
template <typename T>
void shared_generic(const CascadeParams& p, const SharedItem& it, std::vector<float>& scratch) {
  const int64_t D = p.D, bs = p.bs;
  const int64_t n_keys = static_cast<int64_t>(p.group_blocks[it.g]) * bs;
  const int32_t* bt = p.block_tables + p.group_rows[p.group_starts[it.g]] * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + it.kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + it.kh * p.head_stride;
  scratch.resize(static_cast<size_t>(2 * D));
  float* qf = scratch.data();
  float* acc = qf + D;
  for (int64_t i = it.r0; i < it.r1; ++i) {
    const int64_t b = item_row(p, it, i), h = it.kh * p.G + i % p.G;
    const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + h * p.q_hstride;
    for (int64_t d = 0; d < D; ++d) {
      qf[d] = to_float(q[d]);
      acc[d] = 0.f;
    }
    float m = kNegInf, l = 0.f;
    for (int64_t t = 0; t < n_keys; ++t) {
      const T* krow = kbase + bt[t / bs] * p.k_bstride + (t % bs) * D;
      const T* vrow = vbase + bt[t / bs] * p.v_bstride + (t % bs) * D;
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
    float* o = p.state_o + (b * p.H + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / l;
    p.state_lse[b * p.H + h] = m + std::log(l);
  }
}

// Suffix pass of one (row, kv head), from the shared state, one key at a time.
template <typename T>
void suffix_generic(const CascadeParams& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
  const int64_t G = p.G, D = p.D, bs = p.bs;
  const int64_t len = p.lens[b];
  const T* q = static_cast<const T*>(p.q) + b * p.q_bstride + kh * G * p.q_hstride;
  T* out = static_cast<T*>(p.out) + b * p.o_bstride + kh * G * p.o_hstride;
  scratch.assign(static_cast<size_t>(2 * G * D + 2 * G), 0.f);
  float* qf = scratch.data();
  float* acc = qf + G * D;
  float* m = acc + G * D;
  float* l = m + G;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = kh * G + g;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[g * p.q_hstride + d]);
    const float lse = p.state_lse[b * p.H + h];
    m[g] = lse;
    if (lse > kNegInf) {
      l[g] = 1.f;
      const float* o = p.state_o + (b * p.H + h) * D;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] = o[d];
    }
  }
  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  for (int64_t t = static_cast<int64_t>(p.start_block[b]) * bs; t < len; ++t) {
    const T* krow = kbase + bt[t / bs] * p.k_bstride + (t % bs) * D;
    const T* vrow = vbase + bt[t / bs] * p.v_bstride + (t % bs) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qg[d] * to_float(krow[d]);
      s *= p.scale;
      const float m_new = std::max(m[g], s);
      const float alpha = std::exp(m[g] - m_new);
      const float pe = std::exp(s - m_new);
      l[g] = l[g] * alpha + pe;
      m[g] = m_new;
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] = ag[d] * alpha + pe * to_float(vrow[d]);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    for (int64_t d = 0; d < D; ++d) out[g * p.o_hstride + d] = from_float<T>(acc[g * D + d] * inv);
  }
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define BATON_CASCADE_AMX 1
// ---------------------------------------------------------------------------------------------
// Shared pass on AMX tiles (bf16, D = 64): 16 query rows x 32 keys per step. The packed chunks
// of Shared<bf16, 64, true, true> are already the tiles' VNNI layouts: K as [D/2 dim pairs][16
// keys] dwords (a B tile per 16 dims pairs), V as [16 key pairs][16 dims] dwords per 16 dims (a
// B tile per 16 output dims), and the bf16 probabilities of a row, key pairs in dwords, are an
// A tile's row. Tiles: 0-3 the output (16 x 64 fp32), 4 the scores and then the probabilities,
// 5 and 7 the queries (dims 0-31, 32-63), 6 the K or V operand. The softmax runs on AVX-512
// exactly as in Shared::rows (lazy base-2 reference point; the rare rescale moves the output
// through memory).

// Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

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

using SharedRangeFn = void (*)(const CascadeParams&, const std::vector<SharedItem>&, int64_t,
                               int64_t);

template <typename T>
SharedRangeFn pick_shared(int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#ifdef BATON_CASCADE_AMX
    if (D == 64 && amx_ready()) return &SharedAmx::range;
#endif
    if (D == 64) return &Shared<T, 64, true, true>::range;
    if (D == 128) return &Shared<T, 128, true, true>::range;
    return nullptr;
  }
#endif
  if (D == 64) return &Shared<T, 64, false, false>::range;
  if (D == 128) return &Shared<T, 128, false, false>::range;
  return nullptr;
}


// ---------------------------------------------------------------------------------------------
// Suffix pass: paged_attention.cpp's pair loop, from each row's start block and shared state.

// Walks the (pair, block) sequence of a thread's range from each row's start block,
// kPrefetchBlocks ahead of the computation.
struct PrefetchCursor {
  const CascadeParams* p = nullptr;
  int64_t pair = 0, end = 0, block = 0, elem_size = 0;
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t rows = 0;

  void init(const CascadeParams& params, int64_t begin_pair, int64_t end_pair, int64_t esize) {
    p = &params;
    pair = begin_pair;
    end = end_pair;
    block = begin_pair < end_pair ? p->start_block[begin_pair / p->KV] - 1 : -1;
    elem_size = esize;
    advance();
  }
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
      block = pair < end ? p->start_block[pair / p->KV] : 0;
    }
    k = v = nullptr;
    rows = 0;
  }
};

template <typename T, int G, int D>
void suffix_avx512(const CascadeParams& p, int64_t b, int64_t kh, PrefetchCursor& pf) {
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
  alignas(64) float tmp[16 * NV];
  for (int g = 0; g < G; ++g) {
    const int64_t h = kh * G + g;
    const float lse = p.state_lse[b * p.H + h];
    m[g] = _mm512_set1_ps(lse);
    if (lse > kNegInf) {  // the shared pass's result as a state: max lse, sum 1, acc its output
      const float* o = p.state_o + (b * p.H + h) * D;
      for (int c = 0; c < NV; ++c)
        for (int i = 0; i < 16; ++i) tmp[16 * c + i] = o[R::dim(c, i)];
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_load_ps(tmp + 16 * c);
      l[g] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(1.f));
    } else {
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
      l[g] = _mm512_setzero_ps();
    }
  }
  alignas(64) float prob[G][16];
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  const int64_t n_blocks = (len + bs - 1) / bs;
  constexpr int64_t kRowBytes = D * sizeof(T);
  for (int64_t j = p.start_block[b]; j < n_blocks; ++j) {
    const T* kb = kbase + bt[j] * p.k_bstride;
    const T* vb = vbase + bt[j] * p.v_bstride;
    const int64_t blen = std::min(bs, len - j * bs);
    const char* pk = pf.k;
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
        const __m512 m_new = _mm512_max_ps(m[g], bcast_max(sg));
        if (_mm512_cmp_ps_mask(m_new, m[g], _CMP_GT_OQ)) {
          const __m512 alpha = exp_ps(_mm512_sub_ps(m[g], m_new));
          for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
          l[g] = _mm512_mul_ps(l[g], alpha);
          m[g] = m_new;
        }
        const __m512 pg = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(sg, m[g])));
        _mm512_store_ps(prob[g], pg);
        l[g] = _mm512_add_ps(l[g], pg);
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
    for (int64_t r = blen; r < p_rows; ++r) prefetch_row<kRowBytes>(pk, pv, r);
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

template <typename T>
using SuffixFn = void (*)(const CascadeParams&, int64_t, int64_t, PrefetchCursor&);

template <typename T>
SuffixFn<T> pick_suffix(int64_t G, int64_t D) {
#define BATON_CASE(GG, DD) \
  if (G == GG && D == DD) return &suffix_avx512<T, GG, DD>;
  BATON_CASE(1, 64) BATON_CASE(2, 64) BATON_CASE(3, 64) BATON_CASE(4, 64)
  BATON_CASE(1, 128) BATON_CASE(2, 128) BATON_CASE(3, 128) BATON_CASE(4, 128)
#undef BATON_CASE
  return nullptr;
}
#endif  // BATON_CASCADE_AVX512

// Contiguous ranges [bounds[i], bounds[i+1]) of `work` (prefix sums, work.size() = n + 1) of about
// equal work, one per part.
std::vector<int64_t> split_work(const std::vector<int64_t>& work, int64_t parts) {
  const int64_t n = static_cast<int64_t>(work.size()) - 1;
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, n);
  bounds[0] = 0;
  int64_t it = 0;
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t target = work[n] * i / parts;
    while (it < n && work[it + 1] <= target) ++it;
    if (it < n && target - work[it] > work[it + 1] - target) ++it;
    bounds[i] = std::max(it, bounds[i - 1]);
  }
  return bounds;
}

// Run fn(lo, hi) over [0, n) split by `work`, in parallel when it is worth it.
template <typename Fn>
void parallel_ranges(const std::vector<int64_t>& work, int64_t min_work, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(work.size()) - 1;
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || n <= 1 || work[n] < min_work || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  const int64_t parts = std::min(threads, n);
  const std::vector<int64_t> bounds = split_work(work, parts);
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t part = lo; part < hi; ++part) fn(bounds[part], bounds[part + 1]);
  });
}

constexpr int64_t kMaxTileRows = 32;  // (member, head) rows per shared work item
constexpr int64_t kMinTileRows = 4;

template <typename T>
void run_shared(const CascadeParams& p, int64_t n_groups) {
  auto group_rows = [&](int64_t g) { return (p.group_starts[g + 1] - p.group_starts[g]) * p.G; };
  auto count_items = [&](int64_t tile) {
    int64_t n = 0;
    for (int64_t g = 0; g < n_groups; ++g) n += (group_rows(g) + tile - 1) / tile;
    return n * p.KV;
  };
  const int64_t threads = at::get_num_threads();
  int64_t tile = kMaxTileRows;
  while (tile > kMinTileRows && count_items(tile) < 4 * threads) tile /= 2;
  std::vector<SharedItem> items;
  std::vector<int64_t> work(1, 0);
  for (int64_t g = 0; g < n_groups; ++g) {
    const int64_t n_keys = static_cast<int64_t>(p.group_blocks[g]) * p.bs;
    for (int64_t kh = 0; kh < p.KV; ++kh)
      for (int64_t r0 = 0; r0 < group_rows(g); r0 += tile) {
        const int64_t r1 = std::min(group_rows(g), r0 + tile);
        items.push_back({g, kh, r0, r1});
        work.push_back(work.back() + (r1 - r0 + 8) * n_keys);  // + packing, about 8 rows' worth
      }
  }
#ifdef BATON_CASCADE_AVX512
  const SharedRangeFn fast = pick_shared<T>(p.D);
#endif
  // On AMX the shared pass is cheap (64 rows x 2k shared tokens: ~0.7 ms on one core), so below
  // ~2 ms of work it runs on one thread: a second parallel region would cost more than it saves
  // whenever a thread waits for a core (a loaded machine), as the suffix pass after it already may.
  int64_t min_work = 16384;
#ifdef BATON_CASCADE_AMX
  if (fast == &SharedAmx::range) min_work = 4'000'000;
#endif
  parallel_ranges(work, min_work, [&](int64_t lo, int64_t hi) {
#ifdef BATON_CASCADE_AVX512
    if (fast != nullptr) {
      fast(p, items, lo, hi);
      return;
    }
#endif
    std::vector<float> scratch;
    for (int64_t i = lo; i < hi; ++i) shared_generic<T>(p, items[i], scratch);
  });
}

template <typename T>
void run_suffix(const CascadeParams& p, int64_t B) {
  const int64_t n_pairs = B * p.KV;
  std::vector<int64_t> work(static_cast<size_t>(n_pairs) + 1, 0);
  for (int64_t i = 0; i < n_pairs; ++i) {
    const int64_t b = i / p.KV;
    work[i + 1] = work[i] + (p.lens[b] - static_cast<int64_t>(p.start_block[b]) * p.bs + 32);
  }
#ifdef BATON_CASCADE_AVX512
  const SuffixFn<T> fast = pick_suffix<T>(p.G, p.D);
#endif
  parallel_ranges(work, 2048, [&](int64_t lo, int64_t hi) {
#ifdef BATON_CASCADE_AVX512
    if (fast != nullptr) {
      PrefetchCursor pf;
      pf.init(p, lo, hi, sizeof(T));
      const int64_t row_bytes = p.D * static_cast<int64_t>(sizeof(T));
      for (int k = 0; k < kPrefetchBlocks; ++k) {  // nothing to overlap these with
        for (int64_t r = 0; r < pf.rows; ++r)
          for (int64_t o = 0; o < row_bytes; o += 64) {
            _mm_prefetch(pf.k + r * row_bytes + o, BATON_PREFETCH_HINT);
            _mm_prefetch(pf.v + r * row_bytes + o, BATON_PREFETCH_HINT);
          }
        pf.advance();
      }
      for (int64_t i = lo; i < hi; ++i) fast(p, i / p.KV, i % p.KV, pf);
      return;
    }
#endif
    std::vector<float> scratch;
    for (int64_t i = lo; i < hi; ++i) suffix_generic<T>(p, i / p.KV, i % p.KV, scratch);
  });
}

}  // namespace

void cascade_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor context_lens,
                              at::Tensor group_rows, at::Tensor group_starts,
                              at::Tensor group_blocks, double scale) {
  for (const at::Tensor* t : {&out, &q, &k_cache, &v_cache, &block_tables, &context_lens,
                              &group_rows, &group_starts, &group_blocks})
    TORCH_CHECK_VALUE(t->device().is_cpu(), "cascade_decode_attention: all tensors must be on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache and v_cache must both be [num_blocks, KV, block_size, D], got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  const auto dtype = q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "unsupported dtype ", dtype, " (float32, bfloat16 or float16)");
  TORCH_CHECK_VALUE(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
                    "q, k_cache and v_cache dtypes must match");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(1), bs = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == D, "head_dim mismatch: q has ", D, ", cache has ",
                    k_cache.size(3));
  TORCH_CHECK_VALUE(KV > 0 && H % KV == 0, "num_heads ", H, " must be a multiple of num_kv_heads ",
                    KV);
  TORCH_CHECK_VALUE(bs > 0, "block_size must be positive");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK_VALUE(c->stride(3) == 1 && c->stride(2) == D && c->stride(1) == bs * D,
                      "k_cache/v_cache must be contiguous in their last three dims, strides ",
                      c->strides());
  }
  TORCH_CHECK_VALUE(q.stride(2) == 1, "q must be contiguous in its last dim, strides ", q.strides());
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && out.scalar_type() == dtype && out.stride(2) == 1,
                    "out must be ", q.sizes(), " ", dtype, " with a contiguous last dim");
  for (const at::Tensor* t : {&block_tables, &context_lens, &group_rows, &group_starts, &group_blocks})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt,
                      "block_tables, context_lens and the group tensors must be int32");
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == B &&
                        (block_tables.stride(1) == 1 || block_tables.size(1) <= 1),
                    "block_tables must be [B, max_blocks] with a contiguous last dim, got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(context_lens.dim() == 1 && context_lens.size(0) == B,
                    "context_lens must be [B], got ", context_lens.sizes());
  TORCH_CHECK_VALUE(group_starts.dim() == 1 && group_starts.size(0) >= 1 && group_blocks.dim() == 1 &&
                        group_blocks.size(0) == group_starts.size(0) - 1 && group_rows.dim() == 1,
                    "group_starts must be [G + 1], group_blocks [G] and group_rows [R], got ",
                    group_starts.sizes(), ", ", group_blocks.sizes(), ", ", group_rows.sizes());
  const at::Tensor lens_c = context_lens.contiguous();
  const at::Tensor rows_c = group_rows.contiguous();
  const at::Tensor starts_c = group_starts.contiguous();
  const at::Tensor gblocks_c = group_blocks.contiguous();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  const int32_t* grows = rows_c.data_ptr<int32_t>();
  const int32_t* gstarts = starts_c.data_ptr<int32_t>();
  const int32_t* gblocks = gblocks_c.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t bt_stride = block_tables.stride(0);
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  const int64_t n_groups = group_blocks.size(0), n_rows = group_rows.size(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= max_blocks * bs, "context_lens[", b, "] = ",
                      lens[b], " is out of range for ", max_blocks, " blocks of ", bs);
    const int64_t nb = (lens[b] + bs - 1) / bs;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t id = bt[b * bt_stride + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", j, "] = ", id,
                        " is out of range for ", num_blocks, " blocks");
    }
  }
  // Each row in at most one group; a group's members share its blocks, all full for each.
  std::vector<int32_t> start_block(static_cast<size_t>(B), 0);
  TORCH_CHECK_VALUE(gstarts[0] == 0 && gstarts[n_groups] == n_rows,
                    "group_starts must run from 0 to len(group_rows)");
  for (int64_t g = 0; g < n_groups; ++g) {
    TORCH_CHECK_VALUE(gstarts[g + 1] > gstarts[g], "group ", g, " is empty");
    TORCH_CHECK_VALUE(gblocks[g] >= 1, "group ", g, " shares ", gblocks[g], " blocks");
    const int64_t first = grows[gstarts[g]];
    for (int64_t i = gstarts[g]; i < gstarts[g + 1]; ++i) {
      const int64_t b = grows[i];
      TORCH_CHECK_VALUE(b >= 0 && b < B, "group_rows[", i, "] = ", b, " is out of range for ", B,
                        " rows");
      TORCH_CHECK_VALUE(start_block[b] == 0, "row ", b, " is in more than one group");
      TORCH_CHECK_VALUE(static_cast<int64_t>(gblocks[g]) * bs <= lens[b], "group ", g, " shares ",
                        gblocks[g], " blocks, more than row ", b, "'s ", lens[b], " tokens fill");
      for (int64_t j = 0; j < gblocks[g]; ++j)
        TORCH_CHECK_VALUE(bt[b * bt_stride + j] == bt[first * bt_stride + j], "row ", b,
                          " does not share block ", j, " of group ", g);
      start_block[b] = gblocks[g];
    }
  }
  if (B == 0 || H == 0 || D == 0) return;

  std::vector<float> state_o(static_cast<size_t>(B * H * D));
  std::vector<float> state_lse(static_cast<size_t>(B * H), kNegInf);
  CascadeParams p;
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.q_bstride = q.stride(0);
  p.q_hstride = q.stride(1);
  p.o_bstride = out.stride(0);
  p.o_hstride = out.stride(1);
  p.k_bstride = k_cache.stride(0);
  p.v_bstride = v_cache.stride(0);
  p.head_stride = bs * D;
  p.H = H;
  p.KV = KV;
  p.G = H / KV;
  p.D = D;
  p.bs = bs;
  p.block_tables = bt;
  p.bt_stride = bt_stride;
  p.lens = lens;
  p.start_block = start_block.data();
  p.group_rows = grows;
  p.group_starts = gstarts;
  p.group_blocks = gblocks;
  p.state_o = state_o.data();
  p.state_lse = state_lse.data();
  p.scale = static_cast<float>(scale);
  switch (dtype) {
    case at::kFloat:
      run_shared<float>(p, n_groups);
      run_suffix<float>(p, B);
      break;
    case at::kBFloat16:
      run_shared<c10::BFloat16>(p, n_groups);
      run_suffix<c10::BFloat16>(p, B);
      break;
    case at::kHalf:
      run_shared<c10::Half>(p, n_groups);
      run_suffix<c10::Half>(p, B);
      break;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", dtype);
  }
}
