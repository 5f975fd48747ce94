// Paged decode attention for the CPU: one query token per sequence, reading the paged KV cache in
// place (no gather). Matches baton.kernels.reference.paged_decode_attention_ref.
//
//   q:            [B, H, D]                     (inner dim contiguous, any b/h strides)
//   k/v_cache:    [num_blocks, KV, bs, D]        (inner three dims contiguous, any dim-0 stride)
//   block_tables: [B, max_blocks] int32          (inner dim contiguous; unused slots are not read)
//   context_lens: [B] int32                      (0 gives a zero output row)
//   out:          [B, H, D] in q's dtype         (inner dim contiguous)
//
// Work is split over (sequence, kv head) pairs: each thread gets a contiguous range of pairs of
// about equal token work (at::parallel_for, torch's own pool) and runs decode_loop.h's loop over it
// from an empty state and block 0 (cascade.cpp's suffix pass runs the same loop from a state). That
// header describes the loop: the G = H / KV query heads of a pair share every K and V row read; on
// AVX-512, 16 token scores per head at a time (with AVX512-BF16 the q.k products of bf16 inputs
// use vdpbf16ps: bf16 products are exact in fp32) and K/V rows prefetched two blocks ahead along
// the thread's range; elsewhere (no AVX-512, or other G / D) a plain per-token loop.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define BATON_AVX512 1
#endif

#include "attention_common.h"
#include "decode_loop.h"
#include "dynamic_for.h"
#include "ops.h"

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

constexpr int64_t kPartsPerThread = 8;

}  // namespace

bool decode_attention_is_serial(const int32_t* lens, int64_t batch, int64_t kv_heads) {
  int64_t total_rows = 0;
  for (int64_t b = 0; b < batch; ++b) total_rows += lens[b];
  total_rows *= kv_heads;
  return at::get_num_threads() <= 1 || batch * kv_heads <= 1 || total_rows < 2048 ||
         at::in_parallel_region();
}

namespace {

template <typename T>
void run(const Params& p, int64_t B) {
  const int64_t n_pairs = B * p.KV;
  auto do_range = [&](int64_t lo, int64_t hi) { decode_range<T, false>(p, lo, hi); };
  if (decode_attention_is_serial(p.lens, B, p.KV)) {
    do_range(0, n_pairs);
    return;
  }
  const int64_t threads = at::get_num_threads();
  // kPartsPerThread ranges of about equal work a thread, each thread running its own in order and
  // then taking the others' that are not started yet (dynamic_for.h): a thread slowed by the
  // other's traffic or by the scheduler does fewer, instead of the other waiting for it.
  const int64_t parts = std::min(threads * kPartsPerThread, n_pairs);
  const std::vector<int64_t> bounds = balanced_split(p, B, parts);
  dynamic_for(parts, [] {}, [&](int64_t part) { do_range(bounds[part], bounds[part + 1]); }, [] {});
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
