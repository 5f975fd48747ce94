// Paged decode attention for the CPU: one query token per sequence, reading the paged KV cache in
// place (no gather). Matches baton.kernels.reference.paged_decode_attention_ref.
//
//   q:            [B, H, D]                     (inner dim contiguous, any b/h strides)
//   k/v_cache:    [num_blocks, KV, bs, D]        (inner three dims contiguous, any dim-0 stride)
//   block_tables: [B, max_blocks] int32          (inner dim contiguous; unused slots are not read)
//   context_lens: [B] int32                      (0 gives a zero output row)
//   out:          [B, H, D] in q's dtype         (inner dim contiguous)
//
// Work is split over (sequence, kv head) pairs; the G = H / KV query heads of a pair share every K
// and V row read. Streaming softmax in fp32, chunk by chunk (16 tokens, never crossing a block).
// The AVX-512 path computes 16 token scores per head with a transposing reduction tree, one exp per
// 16 tokens, and converts bf16 to fp32 in registers (a shift for the even elements, a mask for the
// odd ones, so V accumulates in an even/odd order that is undone when the output is written). With
// AVX512-BF16 the q.k products of bf16 inputs use vdpbf16ps (bf16 products are exact in fp32).
// Each thread gets a contiguous range of pairs of about equal token work (at::parallel_for, torch's
// own pool) and software-prefetches K/V rows two blocks ahead along that range, since random block
// placement defeats the hardware prefetchers. The portable path (no AVX-512, or other G / D) is a
// plain per-token loop.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define BATON_AVX512 1
#endif

#include "attention_common.h"

namespace {

struct Params {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  int64_t q_bstride, q_hstride;
  int64_t o_bstride, o_hstride;
  int64_t k_bstride, v_bstride;  // elements between consecutive blocks (dim-0 strides)
  int64_t head_stride;           // bs * D: elements between kv heads inside a block
  int64_t H, KV, G, D, bs;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* lens;
  float scale;
};

// ---------------------------------------------------------------------------------------------
// Portable path: any G and D, one token at a time.
template <typename T>
void attend_pair_generic(const Params& p, int64_t b, int64_t kh, std::vector<float>& scratch) {
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
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = to_float(q[g * p.q_hstride + d]);
    m[g] = -std::numeric_limits<float>::infinity();
  }
  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  for (int64_t t = 0; t < len; ++t) {
    const int64_t blk = bt[t / bs], off = t % bs;
    const T* krow = kbase + blk * p.k_bstride + off * D;
    const T* vrow = vbase + blk * p.v_bstride + off * D;
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

#ifdef BATON_AVX512
// ---------------------------------------------------------------------------------------------
// AVX-512 path.

// Walks the (pair, block) sequence of a thread's range, kPrefetchBlocks ahead of the computation.
struct PrefetchCursor {
  const Params* p = nullptr;
  int64_t pair = 0, end = 0, block = 0, elem_size = 0;
  const char* k = nullptr;  // the block being prefetched
  const char* v = nullptr;
  int64_t rows = 0;         // rows of it that hold tokens (0: nothing left)

  void init(const Params& params, int64_t begin_pair, int64_t end_pair, int64_t esize) {
    p = &params;
    pair = begin_pair;
    end = end_pair;
    block = -1;
    elem_size = esize;
    advance();
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
      block = 0;
    }
    k = v = nullptr;
    rows = 0;
  }
};

template <typename T, int G, int D>
void attend_pair_avx512(const Params& p, int64_t b, int64_t kh, PrefetchCursor& pf) {
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
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    l[g] = _mm512_setzero_ps();
  }
  alignas(64) float prob[G][16];
  const __m512 scale = _mm512_set1_ps(p.scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  const int32_t* bt = p.block_tables + b * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + kh * p.head_stride;
  const int64_t n_blocks = (len + bs - 1) / bs;
  constexpr int64_t kRowBytes = D * sizeof(T);
  for (int64_t j = 0; j < n_blocks; ++j) {
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
          const __m512 alpha = exp_ps(_mm512_sub_ps(m[g], m_new));  // 0 on the first chunk
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

  alignas(64) float tmp[16 * NV];
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
using PairFn = void (*)(const Params&, int64_t, int64_t, PrefetchCursor&);

template <typename T>
PairFn<T> pick_avx512(int64_t G, int64_t D) {
#define BATON_CASE(GG, DD) \
  if (G == GG && D == DD) return &attend_pair_avx512<T, GG, DD>;
  BATON_CASE(1, 64) BATON_CASE(2, 64) BATON_CASE(3, 64) BATON_CASE(4, 64)
  BATON_CASE(1, 128) BATON_CASE(2, 128) BATON_CASE(3, 128) BATON_CASE(4, 128)
#undef BATON_CASE
  return nullptr;
}
#endif  // BATON_AVX512

// Split the (b, kv_head) pairs into `parts` contiguous ranges of about equal token work.
std::vector<int64_t> balanced_split(const Params& p, int64_t B, int64_t parts) {
  std::vector<int64_t> work(static_cast<size_t>(B) + 1, 0);
  for (int64_t b = 0; b < B; ++b) work[b + 1] = work[b] + (p.lens[b] + 32) * p.KV;
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, 0);
  const int64_t total = work[B];
  int64_t pair = 0;
  const int64_t n_pairs = B * p.KV;
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t target = total * i / parts;
    // the first pair whose start is >= target
    while (pair < n_pairs) {
      const int64_t b = pair / p.KV, kh = pair % p.KV;
      const int64_t start = work[b] + (p.lens[b] + 32) * kh;
      if (start >= target) break;
      ++pair;
    }
    bounds[i] = pair;
  }
  bounds[parts] = n_pairs;
  return bounds;
}

template <typename T>
void run(const Params& p, int64_t B) {
  const int64_t n_pairs = B * p.KV;
#ifdef BATON_AVX512
  PairFn<T> fast = pick_avx512<T>(p.G, p.D);
#endif
  auto do_range = [&](int64_t lo, int64_t hi) {
#ifdef BATON_AVX512
    if (fast != nullptr) {
      PrefetchCursor pf;
      pf.init(p, lo, hi, sizeof(T));
      for (int k = 0; k < kPrefetchBlocks; ++k) {  // nothing to overlap these with
        for (int64_t r = 0; r < pf.rows; ++r) {
          for (int64_t o = 0; o < p.D * static_cast<int64_t>(sizeof(T)); o += 64) {
            _mm_prefetch(pf.k + r * p.D * sizeof(T) + o, BATON_PREFETCH_HINT);
            _mm_prefetch(pf.v + r * p.D * sizeof(T) + o, BATON_PREFETCH_HINT);
          }
        }
        pf.advance();
      }
      for (int64_t i = lo; i < hi; ++i) fast(p, i / p.KV, i % p.KV, pf);
      return;
    }
#endif
    std::vector<float> scratch;
    for (int64_t i = lo; i < hi; ++i) attend_pair_generic<T>(p, i / p.KV, i % p.KV, scratch);
  };
  int64_t total_rows = 0;
  for (int64_t b = 0; b < B; ++b) total_rows += p.lens[b];
  total_rows *= p.KV;
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || n_pairs <= 1 || total_rows < 2048 || at::in_parallel_region()) {
    do_range(0, n_pairs);
    return;
  }
  const int64_t parts = std::min(threads, n_pairs);
  const std::vector<int64_t> bounds = balanced_split(p, B, parts);
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t part = lo; part < hi; ++part) do_range(bounds[part], bounds[part + 1]);
  });
}

}  // namespace

void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
                        v_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                        context_lens.device().is_cpu(),
                    "paged_decode_attention: all tensors must be on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && v_cache.dim() == 4,
                    "k_cache and v_cache must be [num_blocks, KV, block_size, D], got ",
                    k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ: ",
                    k_cache.sizes(), " vs ", v_cache.sizes());
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
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= max_blocks * bs, "context_lens[", b, "] = ",
                      lens[b], " is out of range for ", max_blocks, " blocks of ", bs);
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
  p.bt_stride = block_tables.stride(0);
  p.lens = lens;
  p.scale = static_cast<float>(scale);
  switch (dtype) {
    case at::kFloat: run<float>(p, B); break;
    case at::kBFloat16: run<c10::BFloat16>(p, B); break;
    case at::kHalf: run<c10::Half>(p, B); break;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", dtype);
  }
}

bool has_avx512() {
#ifdef BATON_AVX512
  return true;
#else
  return false;
#endif
}
