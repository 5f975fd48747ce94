// Paged prefill attention for the CPU: causal attention of each sequence's new tokens over its
// paged KV cache, read in place (no gather, no mask tensor). Matches
// baton.kernels.reference.paged_prefill_attention_ref applied sequence by sequence.
//
//   q:               [N, H, D]                  (inner dim contiguous, any row/head strides)
//   k/v_cache:       [num_blocks, KV, bs, D]    (inner three dims contiguous, any dim-0 stride)
//   block_tables:    [S, max_blocks] int32      (inner dim contiguous; unused slots are not read)
//   context_lens:    [S] int32                  (tokens cached for s, its new ones included)
//   query_start_loc: [S + 1] int32              (rows qsl[s] .. qsl[s+1]-1 of q are the last
//                                                T_s = qsl[s+1] - qsl[s] tokens of sequence s)
//   out:             [N, H, D] in q's dtype     (inner dim contiguous; rows outside every
//                                                sequence are not written)
//
// The query at position p (context_len - T_s <= p < context_len) attends to positions 0..p.
//
// Work items are (sequence, kv head, tile of up to 32 query positions; smaller tiles when that
// gives too few items for the threads, e.g. a short chunk after a long context); at::parallel_for
// hands each thread a contiguous range of about equal work. A thread packs the K/V rows of its
// current (sequence, kv head) into a thread-local buffer, 32 keys at a time and only as far as its
// items need (consecutive items of one pair extend the same buffer), then computes the item's rows
// (query position x group head: the G = H / KV heads of a group share every K/V row) in blocks of
// R rows through prefill_loop.h's loop, causal (cascade.cpp's shared pass runs the same loop
// without the mask). That header describes the loop (S = Q K^T, streaming base-2 softmax with a
// lazy reference point, O = O * alpha + P V per 32-key chunk, the output in registers), its
// packed layouts and its portable fallback (D other than 64 / 128: a per-row scalar loop). Without
// AVX-512 (AVX2), D 64 and 128 take prefill_avx2.h's tile instead: 6 rows x 16 keys in registers
// over K/V widened to fp32 (4 x 256 fresh tokens, SmolLM2's heads, bf16: 11.3 -> 3.4 ms a layer on
// a 2-core Zen 3; the row-at-a-time loop before it). Where the kernels are built for AMX-BF16 and
// Linux grants the tile state, bf16 with D = 64 takes amx_rows.h's loop instead, 16 rows at a
// time on the tile unit, over the same packed K/V (8 x 256 fresh tokens, SmolLM2's heads: 3.2 ->
// 0.73 ms a layer on a 2-core Xeon, model 167).

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

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BATON_PREFILL_AVX512 1
#endif

#include "amx_rows.h"
#include "attention_common.h"
#include "ops.h"
#include "prefill_avx2.h"
#include "prefill_loop.h"

namespace {

constexpr int64_t kMaxTile = 32;  // query positions per work item
constexpr int64_t kMinTile = 4;

struct PrefillParams {
  const void* q;
  void* out;
  const void* k;
  const void* v;
  int64_t q_rstride, q_hstride;
  int64_t o_rstride, o_hstride;
  int64_t k_bstride, v_bstride;  // elements between consecutive blocks (dim-0 strides)
  int64_t head_stride;           // bs * D
  int64_t H, KV, G, D, bs;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* lens;
  const int32_t* qsl;
  float scale;
};

struct Item {
  int64_t s, kh, i0, i1;  // query indices i0..i1-1 among sequence s's new tokens, kv head kh
};

// ---------------------------------------------------------------------------------------------
// Portable path: one query row at a time, one key at a time.
template <typename T>
void item_generic(const PrefillParams& p, const Item& it, std::vector<float>& scratch) {
  const int64_t G = p.G, D = p.D;
  const int64_t ctx = p.lens[it.s];
  const int64_t start = ctx - (p.qsl[it.s + 1] - p.qsl[it.s]);
  const int32_t* bt = p.block_tables + it.s * p.bt_stride;
  const T* kbase = static_cast<const T*>(p.k) + it.kh * p.head_stride;
  const T* vbase = static_cast<const T*>(p.v) + it.kh * p.head_stride;
  scratch.resize(static_cast<size_t>(2 * D));
  float* qf = scratch.data();
  float* acc = qf + D;
  for (int64_t i = it.i0; i < it.i1; ++i) {
    const int64_t row = p.qsl[it.s] + i, pos = start + i;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = it.kh * G + g;
      const T* q = static_cast<const T*>(p.q) + row * p.q_rstride + h * p.q_hstride;
      T* out = static_cast<T*>(p.out) + row * p.o_rstride + h * p.o_hstride;
      for (int64_t d = 0; d < D; ++d) qf[d] = to_float(q[d]);
      float m, l;
      prefill_row_generic<T>(p, bt, kbase, vbase, qf, pos + 1, acc, m, l);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      for (int64_t d = 0; d < D; ++d) out[d] = from_float<T>(acc[d] * inv);
    }
  }
}

// K/V of the (sequence, kv head) a thread is working on, packed up to `chunks` 32-key chunks.
// The buffers are thread-local and keep their capacity across calls; the pair is reset per call.
struct PackState {
  int64_t s = -1, kh = -1, chunks = 0;
  std::vector<CacheLine>* kbuf;  // 64-byte aligned storage (C++17 aligned new)
  std::vector<CacheLine>* vbuf;
};

using ItemFn = void (*)(const PrefillParams&, const Item&, PackState&);

#ifdef BATON_PREFILL_AVX512
// ---------------------------------------------------------------------------------------------
// AVX-512 path.

// An item: pack the pair's K/V as far as the item needs, then its rows R at a time through
// prefill_loop.h's loop (causal, out in T).
template <typename T, int D, bool QKBF, bool PVBF>
struct Prefill {
  using Loop = PrefillLoop<T, D, QKBF, PVBF>;
  static constexpr int R = Loop::R;
  static constexpr int64_t kKChunkBytes = Loop::kKChunkBytes;
  static constexpr int64_t kVChunkBytes = Loop::kVChunkBytes;

  // Pack the pair's K/V as far as the item needs (extending what the thread's previous item of
  // the same pair packed), and prefetch the item's q rows into L2 and its out rows for writing
  // (likely not cached: q and out are strided rows of large buffers).
  static void prepare(const PrefillParams& p, const Item& it, PackState& ps) {
    const int64_t ctx = p.lens[it.s];
    const int64_t n_new = p.qsl[it.s + 1] - p.qsl[it.s];
    const int64_t start = ctx - n_new;  // position of query 0
    const int64_t need = (start + it.i1 - 1) / 32 + 1;
    if (ps.s != it.s || ps.kh != it.kh) {
      ps.s = it.s;
      ps.kh = it.kh;
      ps.chunks = 0;
    }
    if (ps.chunks < need) {
      if (static_cast<int64_t>(ps.kbuf->size()) * 64 < need * kKChunkBytes)
        ps.kbuf->resize(static_cast<size_t>(need * kKChunkBytes / 64));
      if (static_cast<int64_t>(ps.vbuf->size()) * 64 < need * kVChunkBytes)
        ps.vbuf->resize(static_cast<size_t>(need * kVChunkBytes / 64));
      const int32_t* bt = p.block_tables + it.s * p.bt_stride;
      const T* kbase = static_cast<const T*>(p.k) + it.kh * p.head_stride;
      const T* vbase = static_cast<const T*>(p.v) + it.kh * p.head_stride;
      uint8_t* kb = ps.kbuf->data()->bytes;
      uint8_t* vb = ps.vbuf->data()->bytes;
      for (int64_t c = ps.chunks; c < need; ++c)
        pack_chunk<T, D, QKBF, PVBF>(p, kbase, vbase, bt, ctx, c, kb + c * kKChunkBytes,
                                     vb + c * kVChunkBytes);
      ps.chunks = need;
    }
    const int64_t G = p.G;
    const T* q = static_cast<const T*>(p.q);
    T* out = static_cast<T*>(p.out);
    for (int64_t i = it.i0; i < it.i1; ++i) {
      const int64_t row = p.qsl[it.s] + i;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = it.kh * G + g;
        const char* qr = reinterpret_cast<const char*>(q + row * p.q_rstride + h * p.q_hstride);
        const char* orw = reinterpret_cast<const char*>(out + row * p.o_rstride + h * p.o_hstride);
        for (int64_t o = 0; o < static_cast<int64_t>(D * sizeof(T)); o += 64) {
          _mm_prefetch(qr + o, _MM_HINT_T1);
          __builtin_prefetch(orw + o, 1, 2);
        }
      }
    }
  }

  // Rows r0..r0+n-1 of the item (position-major: row = (i - i0) * G + g; indices past its last
  // row repeat that one): each one's position, q row and out row.
  static void row_refs(const PrefillParams& p, const Item& it, int64_t r0, int n, int64_t* pos,
                       const T** qrow, T** orow) {
    const int64_t G = p.G, n_rows = (it.i1 - it.i0) * G;
    const int64_t start = p.lens[it.s] - (p.qsl[it.s + 1] - p.qsl[it.s]);  // position of query 0
    for (int r = 0; r < n; ++r) {
      const int64_t idx = std::min(r0 + r, n_rows - 1);
      const int64_t i = it.i0 + idx / G, h = it.kh * G + idx % G;
      const int64_t row = p.qsl[it.s] + i;
      pos[r] = start + i;
      qrow[r] = static_cast<const T*>(p.q) + row * p.q_rstride + h * p.q_hstride;
      orow[r] = static_cast<T*>(p.out) + row * p.o_rstride + h * p.o_hstride;
    }
  }

  // An item: its K/V packed, then its rows R at a time through prefill_loop.h's loop.
  static void item(const PrefillParams& p, const Item& it, PackState& ps) {
    prepare(p, it, ps);
    const int64_t n_rows = (it.i1 - it.i0) * p.G;
    for (int64_t r0 = 0; r0 < n_rows; r0 += R) {
      int64_t pos[R];
      const T* qrow[R];
      T* orow[R];
      row_refs(p, it, r0, R, pos, qrow, orow);
      Loop::template rows<true, false>(p, static_cast<int>(std::min<int64_t>(R, n_rows - r0)), pos,
                                       qrow, orow, ps.kbuf->data()->bytes, ps.vbuf->data()->bytes);
    }
  }
};

#ifdef BATON_AMX_ROWS
// bf16, D = 64 on AMX tiles: the item's rows 16 at a time through amx_rows.h's loop (causal, out
// in T), over the same packed K/V.
struct PrefillAmx {
  using Base = Prefill<c10::BFloat16, 64, true, true>;
  using Rows = AmxRows<true, false>;
  static constexpr int M = Rows::M;

  static void item(const PrefillParams& p, const Item& it, PackState& ps) {
    Base::prepare(p, it, ps);
    const int64_t n_rows = (it.i1 - it.i0) * p.G;
    for (int64_t r0 = 0; r0 < n_rows; r0 += M) {
      int64_t pos[M];
      const c10::BFloat16* qrow[M];
      c10::BFloat16* orow[M];
      Base::row_refs(p, it, r0, M, pos, qrow, orow);
      Rows::rows(p.scale, static_cast<int>(std::min<int64_t>(M, n_rows - r0)), pos, qrow, orow,
                 ps.kbuf->data()->bytes, ps.vbuf->data()->bytes);
    }
  }
};
#endif


template <typename T>
ItemFn pick_avx512(int64_t D) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (D == 64) return &Prefill<T, 64, true, true>::item;
    if (D == 128) return &Prefill<T, 128, true, true>::item;
    return nullptr;
  }
#endif
  if (D == 64) return &Prefill<T, 64, false, false>::item;
  if (D == 128) return &Prefill<T, 128, false, false>::item;
  return nullptr;
}
#endif  // BATON_PREFILL_AVX512

#ifdef BATON_VEC8
// ---------------------------------------------------------------------------------------------
// AVX2 path (D 64 or 128): the pair's K/V widened and packed as far as the item needs, then its
// rows 6 at a time through prefill_avx2.h's register tile.
template <typename T, int D>
struct PrefillAvx2 {
  static constexpr int64_t kChunkLines = kTileKeys * D * sizeof(float) / 64;

  static void item(const PrefillParams& p, const Item& it, PackState& ps) {
    const int64_t ctx = p.lens[it.s], G = p.G;
    const int64_t start = ctx - (p.qsl[it.s + 1] - p.qsl[it.s]);  // position of query 0
    const int64_t need = (start + it.i1 - 1) / kTileKeys + 1;
    if (ps.s != it.s || ps.kh != it.kh) {
      ps.s = it.s;
      ps.kh = it.kh;
      ps.chunks = 0;
    }
    if (ps.chunks < need) {
      for (std::vector<CacheLine>* buf : {ps.kbuf, ps.vbuf})
        if (static_cast<int64_t>(buf->size()) < need * kChunkLines)
          buf->resize(static_cast<size_t>(need * kChunkLines));
      const int32_t* bt = p.block_tables + it.s * p.bt_stride;
      const T* kbase = static_cast<const T*>(p.k) + it.kh * p.head_stride;
      const T* vbase = static_cast<const T*>(p.v) + it.kh * p.head_stride;
      for (int64_t c = ps.chunks; c < need; ++c)
        pack_chunk_avx2<D>(kbase, vbase, bt, p.k_bstride, p.v_bstride, p.bs, ctx, c,
                           reinterpret_cast<float*>(ps.kbuf->data() + c * kChunkLines),
                           reinterpret_cast<float*>(ps.vbuf->data() + c * kChunkLines));
      ps.chunks = need;
    }
    const float* kp = reinterpret_cast<const float*>(ps.kbuf->data());
    const float* vp = reinterpret_cast<const float*>(ps.vbuf->data());
    const int64_t n_rows = (it.i1 - it.i0) * G;  // position-major: row = (i - i0) * G + g
    for (int64_t r0 = 0; r0 < n_rows; r0 += kTileRows) {
      int64_t pos[kTileRows];
      const T* qrow[kTileRows];
      T* orow[kTileRows];
      for (int r = 0; r < kTileRows; ++r) {
        const int64_t idx = std::min<int64_t>(r0 + r, n_rows - 1);  // past the last row: repeat it
        const int64_t i = it.i0 + idx / G, h = it.kh * G + idx % G, row = p.qsl[it.s] + i;
        pos[r] = start + i;
        qrow[r] = static_cast<const T*>(p.q) + row * p.q_rstride + h * p.q_hstride;
        orow[r] = static_cast<T*>(p.out) + row * p.o_rstride + h * p.o_hstride;
      }
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, n_rows - r0));
      rows_avx2<D>(p.scale, n, pos, qrow, orow, kp, vp);
    }
  }
};

template <typename T>
ItemFn pick_avx2(int64_t D) {
  if (D == 64) return &PrefillAvx2<T, 64>::item;
  if (D == 128) return &PrefillAvx2<T, 128>::item;
  return nullptr;
}
#endif  // BATON_VEC8

// Work of an item, in (row x key) units plus a per-row overhead.
inline int64_t item_work(const PrefillParams& p, const Item& it) {
  const int64_t start = p.lens[it.s] - (p.qsl[it.s + 1] - p.qsl[it.s]);
  const int64_t n = it.i1 - it.i0;
  return n * p.G * (start + (it.i0 + it.i1 + 1) / 2 + 48);
}

template <typename T>
void run(const PrefillParams& p, int64_t S) {
  const int64_t threads = at::get_num_threads();
  auto count_items = [&](int64_t tile) {
    int64_t n = 0;
    for (int64_t s = 0; s < S; ++s) n += (p.qsl[s + 1] - p.qsl[s] + tile - 1) / tile;
    return n * p.KV;
  };
  int64_t tile = kMaxTile;
  while (tile > kMinTile && count_items(tile) < 4 * threads) tile /= 2;
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(count_items(tile)));
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n_new = p.qsl[s + 1] - p.qsl[s];
    for (int64_t kh = 0; kh < p.KV; ++kh)
      for (int64_t i0 = 0; i0 < n_new; i0 += tile)
        items.push_back({s, kh, i0, std::min(n_new, i0 + tile)});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items == 0) return;
  std::vector<int64_t> work(static_cast<size_t>(n_items) + 1, 0);
  for (int64_t i = 0; i < n_items; ++i) work[i + 1] = work[i] + item_work(p, items[i]);

#ifdef BATON_PREFILL_AVX512
  const ItemFn fast = pick_avx512<T>(p.D);
#elif defined(BATON_VEC8)
  const ItemFn fast = pick_avx2<T>(p.D);
#endif
#ifdef BATON_AMX_ROWS
  bool amx = false;
  if constexpr (std::is_same_v<T, c10::BFloat16>) amx = p.D == 64 && amx_ready();
#endif
  auto do_range = [&](int64_t lo, int64_t hi) {
#ifdef BATON_AMX_ROWS
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (amx) {
        thread_local std::vector<CacheLine> kbuf, vbuf;
        PackState ps;
        ps.kbuf = &kbuf;
        ps.vbuf = &vbuf;
        amx_configure();
        for (int64_t i = lo; i < hi; ++i) PrefillAmx::item(p, items[i], ps);
        _tile_release();
        return;
      }
    }
#endif
#if defined(BATON_PREFILL_AVX512) || defined(BATON_VEC8)
    if (fast != nullptr) {
      thread_local std::vector<CacheLine> kbuf, vbuf;
      PackState ps;
      ps.kbuf = &kbuf;
      ps.vbuf = &vbuf;
      for (int64_t i = lo; i < hi; ++i) fast(p, items[i], ps);
      return;
    }
#endif
    std::vector<float> scratch;
    for (int64_t i = lo; i < hi; ++i) item_generic<T>(p, items[i], scratch);
  };

  const int64_t total = work[n_items];
  if (threads <= 1 || n_items <= 1 || total < 16384 || at::in_parallel_region()) {
    do_range(0, n_items);
    return;
  }
  const int64_t parts = std::min(threads, n_items);
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, n_items);
  bounds[0] = 0;
  int64_t it = 0;
  for (int64_t i = 1; i < parts; ++i) {  // first item of part i: the one closest to total * i / parts
    const int64_t target = total * i / parts;
    while (it < n_items && work[it + 1] <= target) ++it;
    if (it < n_items && target - work[it] > work[it + 1] - target) ++it;
    bounds[i] = std::max(it, bounds[i - 1]);
  }
  at::parallel_for(0, parts, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t part = lo; part < hi; ++part) do_range(bounds[part], bounds[part + 1]);
  });
}

}  // namespace

void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_tables, at::Tensor context_lens,
                             at::Tensor query_start_loc, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
                        v_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                        context_lens.device().is_cpu() && query_start_loc.device().is_cpu(),
                    "paged_prefill_attention: all tensors must be on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be [N, H, D], got ", q.sizes());
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
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
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
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt &&
                        context_lens.scalar_type() == at::kInt &&
                        query_start_loc.scalar_type() == at::kInt,
                    "block_tables, context_lens and query_start_loc must be int32");
  TORCH_CHECK_VALUE(context_lens.dim() == 1, "context_lens must be [S], got ", context_lens.sizes());
  const int64_t S = context_lens.size(0);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == S &&
                        (block_tables.stride(1) == 1 || block_tables.size(1) <= 1),
                    "block_tables must be [S, max_blocks] with a contiguous last dim, got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == S + 1,
                    "query_start_loc must be [S + 1], got ", query_start_loc.sizes());
  const at::Tensor lens_c = context_lens.contiguous();
  const at::Tensor qsl_c = query_start_loc.contiguous();
  const int32_t* lens = lens_c.data_ptr<int32_t>();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int64_t max_blocks = block_tables.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK_VALUE(qsl[0] >= 0 && qsl[S] <= N, "query_start_loc runs from ", qsl[0], " to ",
                    qsl[S], ", outside q's ", N, " rows");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n_new = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
    TORCH_CHECK_VALUE(n_new >= 0, "query_start_loc must be non-decreasing, got ", qsl[s], " then ",
                      qsl[s + 1]);
    TORCH_CHECK_VALUE(lens[s] >= n_new && lens[s] <= max_blocks * bs, "context_lens[", s, "] = ",
                      lens[s], " is out of range: ", n_new, " new tokens, ", max_blocks,
                      " blocks of ", bs);
    if (n_new == 0) continue;  // nothing is read
    const int64_t nb = (lens[s] + bs - 1) / bs;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t id = bt[s * block_tables.stride(0) + j];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", s, ", ", j, "] = ", id,
                        " is out of range for ", num_blocks, " blocks");
    }
  }
  if (S == 0 || N == 0 || H == 0 || D == 0) return;

  PrefillParams p;
  p.q = q.data_ptr();
  p.out = out.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.q_rstride = q.stride(0);
  p.q_hstride = q.stride(1);
  p.o_rstride = out.stride(0);
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
  p.qsl = qsl;
  p.scale = static_cast<float>(scale);
  switch (dtype) {
    case at::kFloat: run<float>(p, S); break;
    case at::kBFloat16: run<c10::BFloat16>(p, S); break;
    case at::kHalf: run<c10::Half>(p, S); break;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", dtype);
  }
}
