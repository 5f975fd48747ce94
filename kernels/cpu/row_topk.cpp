// The k largest entries of each row of a [M, V] bf16 or fp32 matrix (the LM head's logits, V ~ 50k):
// their indices, largest first, equal values in index order (the order a stable descending sort
// gives). What the bf16 greedy path's refinement needs (llama.py's _refine: the best few
// candidates, recomputed exactly), where torch.topk took ~2 ms for 64 rows of SmolLM2's vocabulary
// on 2 cores: ~5% of a W1 decode step.
//
// One pass over a row: a sorted list of the k best so far, and 16 values at a time compared against
// its smallest (one vector compare, and an insertion only for the lanes above it: after the first
// few hundred values, rarely). NaN never enters the list (every comparison with it is false); a row
// with fewer than k values above -inf keeps indices 0, 1, ... in the places left. Rows are split
// over threads (at::parallel_for) when there are enough of them to pay for waking the pool.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "ops.h"
#include "vec16.h"

namespace {

constexpr int64_t kMaxK = 32;

struct TopK {
  int64_t k;
  float vals[kMaxK];
  int64_t idx[kMaxK];

  explicit TopK(int64_t k_) : k(k_) {
    for (int64_t i = 0; i < k; ++i) {
      vals[i] = -std::numeric_limits<float>::infinity();
      idx[i] = i;
    }
  }
  float threshold() const { return vals[k - 1]; }
  // v > threshold(): v goes after every value >= v already in the list (equal values keep index
  // order, since indices arrive in increasing order).
  void insert(float v, int64_t i) {
    int64_t pos = k - 1;
    while (pos > 0 && vals[pos - 1] < v) {
      vals[pos] = vals[pos - 1];
      idx[pos] = idx[pos - 1];
      --pos;
    }
    vals[pos] = v;
    idx[pos] = i;
  }
};

inline float value(float x) { return x; }
inline float value(c10::BFloat16 x) {
  const uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

template <typename T>
void row(const T* x, int64_t V, int64_t k, int64_t* out) {
  TopK top(k);
  int64_t j = 0;
#ifdef BATON_VEC16
  for (; j + 16 <= V; j += 16) {
    const __m512 v = load16(x + j, 0xFFFF);
    __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(top.threshold()), _CMP_GT_OQ);
    while (m) {
      const int lane = __builtin_ctz(m);
      m &= m - 1;
      const float f = value(x[j + lane]);
      if (f > top.threshold()) top.insert(f, j + lane);
    }
  }
#endif
  for (; j < V; ++j) {
    const float f = value(x[j]);
    if (f > top.threshold()) top.insert(f, j);
  }
  std::copy(top.idx, top.idx + k, out);
}

template <typename T>
void run(const at::Tensor& x, const at::Tensor& out, int64_t k) {
  const int64_t M = x.size(0), V = x.size(1);
  const T* base = x.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  // ~16k values a row-chunk before another thread is worth waking.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, V));
  at::parallel_for(0, M, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) row<T>(base + r * xs, V, k, o + r * os);
  });
}

}  // namespace

void row_topk(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && out.device().is_cpu(), "row_topk: tensors must be on the CPU");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1, "x must be [M, V] with a contiguous last dim, got ",
                    x.sizes(), " strides ", x.strides());
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                    "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.stride(1) == 1 &&
                        out.scalar_type() == at::kLong,
                    "out must be [M, k] int64 with a contiguous last dim, got ", out.sizes(), " ",
                    out.scalar_type());
  const int64_t k = out.size(1);
  TORCH_CHECK_VALUE(k >= 1 && k <= kMaxK && k <= x.size(1), "k must be in 1..min(", kMaxK,
                    ", V), got ", k, " for V = ", x.size(1));
  if (x.size(0) == 0) return;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, out, k);
  } else {
    run<c10::BFloat16>(x, out, k);
  }
}
