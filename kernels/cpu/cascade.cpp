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
//     buffer -- the paged prefill kernel's loop (prefill_loop.h, which paged_prefill.cpp runs
//     causal) without a causal mask, writing each (row, head)'s normalized partial output and
//     log-sum-exp (fp32 scratch).
//  2. Suffix pass, per (row, kv head): the paged decode kernel's loop (decode_loop.h, which
//     paged_attention.cpp runs from an empty state) over the row's own blocks only (from
//     group_blocks on), started from the shared pass's state (running max = lse, sum = 1,
//     accumulator = partial output): continuing the online softmax from a partial result is the
//     log-sum-exp merge (FlashInfer's merge_state) done in registers.
// Rows in no group run pass 2 alone over their whole context, as the plain kernel does.
// The AVX-512 helpers (row loaders, dot products, exp polynomials, chunk packing) come from
// attention_common.h, both loops (and their portable versions) from decode_loop.h and
// prefill_loop.h, written once for this kernel and the plain ones. cascade_shared.h holds the
// parameters and the AVX-512 shared pass's items, cascade_amx.h the shared pass on AMX tiles; this
// file the portable shared pass (no AVX-512, or other D), the scheduling and the entry point.

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

#include "attention_common.h"
#include "cascade_amx.h"
#include "cascade_shared.h"
#include "decode_loop.h"
#include "ops.h"
#include "prefill_loop.h"

namespace {

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
    for (int64_t d = 0; d < D; ++d) qf[d] = to_float(q[d]);
    float m, l;
    prefill_row_generic<T>(p, bt, kbase, vbase, qf, n_keys, acc, m, l);
    float* o = p.state_o + (b * p.H + h) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / l;
    p.state_lse[b * p.H + h] = m + std::log(l);
  }
}

#ifdef BATON_CASCADE_AVX512
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
  parallel_ranges(work, 2048, [&](int64_t lo, int64_t hi) { decode_range<T, true>(p, lo, hi); });
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
