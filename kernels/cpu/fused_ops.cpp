// Fused elementwise ops of a Llama layer for the CPU, one call each where eager torch runs several:
//
//   add_rms_norm    residual += delta (fp32, in place); out = rms_norm(residual) * weight
//   silu_mul        out = silu(gate) * up over a fused [N, 2I] gate|up projection
//   rope_and_cache  rotate-half RoPE of q and k in a fused qkv row, in place; k and v into the
//                   paged cache [num_blocks, 2, KV, block_size, D] (a layer's strided view)
//
// Model-dtype tensors are bf16 or fp32; the residual stream, weights and RoPE tables are fp32.
// Matches baton.kernels.reference (add_rms_norm_ref, silu_mul_ref, rope_and_cache_ref).
//
// Rounding: the fp32 results are meant to be the bits torch's eager ops give, so that an fp32 model
// stays token-identical to transformers. That takes (all checked by tests/kernels/test_cpu_fused.py):
//   * no FMA contraction: the extension is built with -ffp-contract=off, every product is rounded
//     before it is added (x*cos + rot*sin, acc + x*x);
//   * the sum of squares of rms_norm in the order of torch's CPU sum kernel (cascade_sum ->
//     vectorized_inner_sum: 8-lane vectors, 4 interleaved accumulators, a 4-level cascade every
//     16 groups, scalar tail, then the lanes in order; scalar_inner_sum when H < 8; torch runs its
//     AVX2 kernel for sum even on AVX-512 machines), then / H, + eps, 1 / sqrt, * rstd, * weight
//     as separate fp32 ops;
//   * silu as torch's vectorized kernel computes it, x / (1 + exp(-x)) with SLEEF's expf_u10
//     (reproduced below). Torch computes a row's last I % 32 elements (I % 16 on AVX2-only
//     machines) with std::exp instead, which can differ by an ulp there.
// bf16: silu_mul rounds silu(gate) to bf16 before the product, as the eager bf16 ops do (so bf16 is
// bit-identical to `F.silu(gate) * up` too); rope_and_cache rounds the cos/sin tables to bf16 first
// (transformers' cos.to(dtype)) but then rounds each result once, where eager bf16 rounds three
// times. Float to bf16 conversion is round-to-nearest-even, as c10::BFloat16.
//
// Rows are split over threads with at::parallel_for (torch's pool) once a call has enough work to
// pay for waking the pool; smaller calls run inline on the calling thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BATON_FUSED_AVX512 1
#endif

#include "ops.h"
#include "sleef_exp.h"
#include "vec8.h"
#include "vec16.h"

namespace {

using bf16 = c10::BFloat16;

// Elements of work per thread below which a call stays on the calling thread (waking torch's
// OpenMP pool costs a few microseconds).
constexpr int64_t kParallelGrainElems = 16384;

inline int64_t grain_rows(int64_t elems_per_row) {
  return std::max<int64_t>(1, kParallelGrainElems / std::max<int64_t>(1, elems_per_row));
}

// ---------------------------------------------------------------------------------------------
// Scalar helpers (also the portable path); to_float / from_float are attention_common.h's (through
// vec16.h).

// float -> model dtype -> float.
template <typename T>
inline float round_to(float x) { return to_float(from_float<T>(x)); }

// ---------------------------------------------------------------------------------------------
// add_rms_norm

int64_t ceil_log2(int64_t x) {  // c10::utils::CeilLog2
  if (x <= 2) return 1;
  int64_t r = 0;
  uint64_t v = static_cast<uint64_t>(x) - 1;
  while (v) {
    ++r;
    v >>= 1;
  }
  return r;
}

// x[e] += d[e] (when d), returning the sum of the x[e]^2 in torch's CPU sum order (see the top).
template <typename TD>
float add_and_sum_squares(float* x, const TD* d, int64_t H) {
  constexpr int64_t W = 8, ILP = 4, LEVELS = 4;
  const int64_t vec_size = H / W;
  const int64_t size = vec_size / ILP;  // groups of ILP vectors
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / LEVELS);
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  auto element = [&](int64_t e) {
    float y = x[e];
    if (d != nullptr) {
      y = y + to_float(d[e]);
      x[e] = y;
    }
    return y * y;
  };
  if (H < W) {  // torch's scalar_inner_sum: the same row_sum over single elements
    float p[ILP] = {};
    const int64_t groups = H / ILP;
    for (int64_t i = 0; i < groups; ++i)
      for (int64_t k = 0; k < ILP; ++k) p[k] = p[k] + element(i * ILP + k);
    for (int64_t e = groups * ILP; e < H; ++e) p[0] = p[0] + element(e);
    for (int64_t k = 1; k < ILP; ++k) p[0] = p[0] + p[k];
    return p[0];
  }
  alignas(64) float part[ILP][W];
#ifdef BATON_FUSED_AVX512
  // One group is 32 floats: acc[l][0] holds accumulators 0 | 1 (8 lanes each), acc[l][1] 2 | 3.
  __m512 acc[LEVELS][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
  auto group = [&](int64_t i) {
    float* p = x + i * (W * ILP);
    __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
    if (d != nullptr) {
      a = _mm512_add_ps(a, load16(d + i * (W * ILP), 0xFFFF));
      b = _mm512_add_ps(b, load16(d + i * (W * ILP) + 16, 0xFFFF));
      _mm512_storeu_ps(p, a);
      _mm512_storeu_ps(p + 16, b);
    }
    acc[0][0] = _mm512_add_ps(acc[0][0], _mm512_mul_ps(a, a));
    acc[0][1] = _mm512_add_ps(acc[0][1], _mm512_mul_ps(b, b));
  };
  auto carry = [&](int64_t j) {  // acc[j] += acc[j-1]; acc[j-1] = 0
    for (int h = 0; h < 2; ++h) {
      acc[j][h] = _mm512_add_ps(acc[j][h], acc[j - 1][h]);
      acc[j - 1][h] = _mm512_setzero_ps();
    }
  };
  auto merge = [&](int64_t j) {
    for (int h = 0; h < 2; ++h) acc[0][h] = _mm512_add_ps(acc[0][h], acc[j][h]);
  };
#else
  float acc[LEVELS][ILP][W] = {};
  auto group = [&](int64_t i) {
    for (int64_t k = 0; k < ILP; ++k) {
      float* p = x + (i * ILP + k) * W;
      for (int64_t l = 0; l < W; ++l) {
        float y = p[l];
        if (d != nullptr) {
          y = y + to_float(d[(i * ILP + k) * W + l]);
          p[l] = y;
        }
        acc[0][k][l] = acc[0][k][l] + y * y;
      }
    }
  };
  auto carry = [&](int64_t j) {
    for (int64_t k = 0; k < ILP; ++k)
      for (int64_t l = 0; l < W; ++l) {
        acc[j][k][l] = acc[j][k][l] + acc[j - 1][k][l];
        acc[j - 1][k][l] = 0.f;
      }
  };
  auto merge = [&](int64_t j) {
    for (int64_t k = 0; k < ILP; ++k)
      for (int64_t l = 0; l < W; ++l) acc[0][k][l] = acc[0][k][l] + acc[j][k][l];
  };
#endif
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) group(i);
    for (int64_t j = 1; j < LEVELS; ++j) {
      carry(j);
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i) group(i);
  for (int64_t j = 1; j < LEVELS; ++j) merge(j);
#ifdef BATON_FUSED_AVX512
  _mm512_store_ps(&part[0][0], acc[0][0]);
  _mm512_store_ps(&part[2][0], acc[0][1]);
#else
  std::memcpy(part, acc[0], sizeof(part));
#endif
  for (int64_t v = size * ILP; v < vec_size; ++v)  // vectors left over from the groups
    for (int64_t l = 0; l < W; ++l) part[0][l] = part[0][l] + element(v * W + l);
  for (int64_t k = 1; k < ILP; ++k)
    for (int64_t l = 0; l < W; ++l) part[0][l] = part[0][l] + part[k][l];
  float total = 0.f;
  for (int64_t e = vec_size * W; e < H; ++e) total = total + element(e);
  for (int64_t l = 0; l < W; ++l) total = total + part[0][l];
  return total;
}

template <typename TD, typename TO>
void add_rms_norm_rows(float* res, const TD* delta, int64_t d_stride, const float* w, TO* out,
                       int64_t o_stride, int64_t N, int64_t H, float eps) {
  auto rows = [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      float* x = res + n * H;
      const TD* d = delta != nullptr ? delta + n * d_stride : nullptr;
      TO* o = out + n * o_stride;
      const float mean = add_and_sum_squares(x, d, H) / static_cast<float>(H);
      const float rstd = 1.f / std::sqrt(mean + eps);
#ifdef BATON_FUSED_AVX512
      const __m512 r = _mm512_set1_ps(rstd);
      for (int64_t j = 0; j < H; j += 16) {
        const __mmask16 m = prefix_mask(H - j);
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(load16(x + j, m), r), load16(w + j, m));
        store16(o + j, y, m);
      }
#else
      for (int64_t j = 0; j < H; ++j) o[j] = from_float<TO>((x[j] * rstd) * w[j]);
#endif
    }
  };
  at::parallel_for(0, N, grain_rows(3 * H), rows);
}

// ---------------------------------------------------------------------------------------------
// silu_mul

template <typename T>
void silu_mul_rows(const T* gu, int64_t g_stride, T* out, int64_t o_stride, int64_t N, int64_t I) {
  auto rows = [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo; n < hi; ++n) {
      const T* gate = gu + n * g_stride;
      const T* up = gate + I;
      T* o = out + n * o_stride;
#ifdef BATON_FUSED_AVX512
      for (int64_t j = 0; j < I; j += 16) {
        const __mmask16 m = prefix_mask(I - j);
        store16(o + j, silu_mul16<T>(load16(gate + j, m), load16(up + j, m)), m);
      }
#else
      int64_t j = 0;
#ifdef BATON_VEC8
      // 8 lanes of the same arithmetic as the scalar loop below (sleef_expf8 gives sleef_expf's
      // bits): ~8% of W1's samples on a 2-core AVX2-only EPYC went to the scalar loop.
      if constexpr (!std::is_same_v<T, c10::Half>) {
        for (; j + 8 <= I; j += 8) {
          const __m256 g = widen8(gate + j);
          const __m256 e = sleef_expf8(_mm256_xor_ps(g, _mm256_set1_ps(-0.f)));
          __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
          if constexpr (std::is_same_v<T, c10::BFloat16>) s = round_bf16_8(s);
          store8(o + j, _mm256_mul_ps(s, widen8(up + j)));
        }
      }
#endif
      for (; j < I; ++j) {
        const float g = to_float(gate[j]);
        const float s = round_to<T>(g / (1.f + sleef_expf(-g)));
        o[j] = from_float<T>(s * to_float(up[j]));
      }
#endif
    }
  };
  at::parallel_for(0, N, grain_rows(4 * I), rows);
}

// ---------------------------------------------------------------------------------------------
// rope_and_cache

constexpr int64_t kMaxHeadDim = 512;

struct RopeParams {
  void* qkv;
  int64_t qkv_stride;
  const int64_t* pos;
  int64_t pos_stride;
  const float* cos;
  const float* sin;
  int64_t cos_stride, sin_stride;
  void* kv;
  int64_t kv_bstride, kv_kvstride;  // kv_layer strides of dims 0 (block) and 1 (k|v)
  const int64_t* blocks;
  int64_t blocks_stride;
  const int64_t* offsets;
  int64_t offsets_stride;
  int64_t H, KV, D, bs;
};

// Rotate one head in place: y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2 (products rounded to fp32, the
// sum rounded to T once); also write the result to `copy` when it is not null.
template <typename T>
inline void rotate_head(T* x, const float* c, const float* s, int64_t D, T* copy) {
  const int64_t half = D / 2;
#ifdef BATON_FUSED_AVX512
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 m = prefix_mask(half - j);
    const __m512 x1 = load16(x + j, m), x2 = load16(x + half + j, m);
    const __m512 y1 = _mm512_sub_ps(_mm512_mul_ps(x1, load16(c + j, m)),
                                    _mm512_mul_ps(x2, load16(s + j, m)));
    const __m512 y2 = _mm512_add_ps(_mm512_mul_ps(x2, load16(c + half + j, m)),
                                    _mm512_mul_ps(x1, load16(s + half + j, m)));
    store16(x + j, y1, m);
    store16(x + half + j, y2, m);
    if (copy != nullptr) {
      store16(copy + j, y1, m);
      store16(copy + half + j, y2, m);
    }
  }
#else
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = to_float(x[j]), x2 = to_float(x[half + j]);
    const T y1 = from_float<T>(x1 * c[j] - x2 * s[j]);
    const T y2 = from_float<T>(x2 * c[half + j] + x1 * s[half + j]);
    x[j] = y1;
    x[half + j] = y2;
    if (copy != nullptr) {
      copy[j] = y1;
      copy[half + j] = y2;
    }
  }
#endif
}

template <typename T>
void rope_and_cache_rows(const RopeParams& p, int64_t N) {
  const int64_t H = p.H, KV = p.KV, D = p.D;
  auto rows = [&](int64_t lo, int64_t hi) {
    alignas(64) float cbuf[kMaxHeadDim], sbuf[kMaxHeadDim];
    for (int64_t n = lo; n < hi; ++n) {
      T* row = static_cast<T*>(p.qkv) + n * p.qkv_stride;
      const int64_t pos = p.pos[n * p.pos_stride];
      const float* c = p.cos + pos * p.cos_stride;
      const float* s = p.sin + pos * p.sin_stride;
      if (!std::is_same<T, float>::value) {  // transformers' cos.to(dtype)
        for (int64_t j = 0; j < D; ++j) {
          cbuf[j] = round_to<T>(c[j]);
          sbuf[j] = round_to<T>(s[j]);
        }
        c = cbuf;
        s = sbuf;
      }
      T* kv = static_cast<T*>(p.kv) + p.blocks[n * p.blocks_stride] * p.kv_bstride +
              p.offsets[n * p.offsets_stride] * D;
      for (int64_t h = 0; h < H; ++h) rotate_head<T>(row + h * D, c, s, D, nullptr);
      for (int64_t h = 0; h < KV; ++h)
        rotate_head<T>(row + (H + h) * D, c, s, D, kv + h * p.bs * D);
      T* vdst = kv + p.kv_kvstride;
      const T* vsrc = row + (H + KV) * D;
      for (int64_t h = 0; h < KV; ++h)
        std::memcpy(vdst + h * p.bs * D, vsrc + h * D, static_cast<size_t>(D) * sizeof(T));
    }
  };
  at::parallel_for(0, N, grain_rows(2 * (H + 2 * KV) * D), rows);
}

bool is_model_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be on the CPU, got ", t.device());
}

void check_index(const at::Tensor& t, int64_t N, const char* name) {
  check_cpu(t, "rope_and_cache", name);
  TORCH_CHECK_VALUE(t.scalar_type() == at::kLong && t.dim() == 1 && t.size(0) == N,
                    "rope_and_cache: ", name, " must be int64 [", N, "], got ", t.scalar_type(),
                    " ", t.sizes());
}

// Every value of an int64 [N] tensor in [0, hi).
void check_range(const at::Tensor& t, int64_t hi, const char* name, const char* what) {
  const int64_t* v = t.data_ptr<int64_t>();
  const int64_t st = t.stride(0);
  for (int64_t n = 0; n < t.size(0); ++n) {
    const int64_t x = v[n * st];
    TORCH_CHECK_VALUE(x >= 0 && x < hi, "rope_and_cache: ", name, "[", n, "] = ", x,
                      " is out of range for ", hi, " ", what);
  }
}

}  // namespace

void add_rms_norm(const at::Tensor& residual, const std::optional<at::Tensor>& delta,
                  const at::Tensor& weight, double eps, const at::Tensor& out) {
  check_cpu(residual, "add_rms_norm", "residual");
  check_cpu(weight, "add_rms_norm", "weight");
  check_cpu(out, "add_rms_norm", "out");
  TORCH_CHECK_VALUE(residual.scalar_type() == at::kFloat && residual.dim() == 2 &&
                        residual.is_contiguous(),
                    "add_rms_norm: residual must be a contiguous float32 [N, H], got ",
                    residual.scalar_type(), " ", residual.sizes(), " strides ", residual.strides());
  const int64_t N = residual.size(0), H = residual.size(1);
  TORCH_CHECK_VALUE(weight.scalar_type() == at::kFloat && weight.dim() == 1 && weight.size(0) == H &&
                        weight.is_contiguous(),
                    "add_rms_norm: weight must be a contiguous float32 [", H, "], got ",
                    weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK_VALUE(is_model_dtype(out.scalar_type()) && out.dim() == 2 && out.size(0) == N &&
                        out.size(1) == H && (out.stride(1) == 1 || H <= 1),
                    "add_rms_norm: out must be a float32 or bfloat16 [", N, ", ", H,
                    "] with a contiguous last dim, got ", out.scalar_type(), " ", out.sizes(),
                    " strides ", out.strides());
  const at::Tensor* d = nullptr;
  if (delta.has_value()) {
    d = &delta.value();
    check_cpu(*d, "add_rms_norm", "delta");
    TORCH_CHECK_VALUE(is_model_dtype(d->scalar_type()) && d->dim() == 2 && d->size(0) == N &&
                          d->size(1) == H && (d->stride(1) == 1 || H <= 1),
                      "add_rms_norm: delta must be a float32 or bfloat16 [", N, ", ", H,
                      "] with a contiguous last dim, got ", d->scalar_type(), " ", d->sizes(),
                      " strides ", d->strides());
  }
  TORCH_CHECK_VALUE(H > 0 || N == 0, "add_rms_norm: hidden size must be positive");
  if (N == 0) return;
  const float e = static_cast<float>(eps);  // torch adds eps to a float32 tensor: cast first
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t os = out.stride(0);
  auto with_out = [&](auto* delta_ptr, int64_t ds) {
    if (out.scalar_type() == at::kFloat)
      add_rms_norm_rows(res, delta_ptr, ds, w, out.data_ptr<float>(), os, N, H, e);
    else
      add_rms_norm_rows(res, delta_ptr, ds, w, out.data_ptr<bf16>(), os, N, H, e);
  };
  if (d == nullptr)
    with_out(static_cast<const float*>(nullptr), 0);
  else if (d->scalar_type() == at::kFloat)
    with_out(static_cast<const float*>(d->data_ptr<float>()), d->stride(0));
  else
    with_out(static_cast<const bf16*>(d->data_ptr<bf16>()), d->stride(0));
}

void silu_mul(const at::Tensor& gate_up, const at::Tensor& out) {
  check_cpu(gate_up, "silu_mul", "gate_up");
  check_cpu(out, "silu_mul", "out");
  const auto dtype = gate_up.scalar_type();
  TORCH_CHECK_VALUE(is_model_dtype(dtype), "silu_mul: unsupported dtype ", dtype,
                    " (float32 or bfloat16)");
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                        (gate_up.stride(1) == 1 || gate_up.size(1) <= 1),
                    "silu_mul: gate_up must be [N, 2I] with a contiguous last dim, got ",
                    gate_up.sizes(), " strides ", gate_up.strides());
  const int64_t N = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK_VALUE(out.scalar_type() == dtype && out.dim() == 2 && out.size(0) == N &&
                        out.size(1) == I && (out.stride(1) == 1 || I <= 1),
                    "silu_mul: out must be ", dtype, " [", N, ", ", I,
                    "] with a contiguous last dim, got ", out.scalar_type(), " ", out.sizes(),
                    " strides ", out.strides());
  if (N == 0 || I == 0) return;
  if (dtype == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(),
                  out.stride(0), N, I);
  else
    silu_mul_rows(gate_up.data_ptr<bf16>(), gate_up.stride(0), out.data_ptr<bf16>(), out.stride(0),
                  N, I);
}

void rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& kv_layer, const at::Tensor& slot_blocks,
                    const at::Tensor& slot_offsets, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim) {
  const int64_t H = num_heads, KV = num_kv_heads, D = head_dim;
  TORCH_CHECK_VALUE(H > 0 && KV > 0 && D > 0 && D % 2 == 0 && D <= kMaxHeadDim,
                    "rope_and_cache: bad head counts / head_dim (", H, ", ", KV, ", ", D,
                    "): all positive, head_dim even and at most ", kMaxHeadDim);
  check_cpu(qkv, "rope_and_cache", "qkv");
  check_cpu(cos, "rope_and_cache", "cos");
  check_cpu(sin, "rope_and_cache", "sin");
  check_cpu(kv_layer, "rope_and_cache", "kv_layer");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK_VALUE(is_model_dtype(dtype), "rope_and_cache: unsupported dtype ", dtype,
                    " (float32 or bfloat16)");
  const int64_t width = (H + 2 * KV) * D;
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.size(1) == width && qkv.stride(1) == 1,
                    "rope_and_cache: qkv must be [N, ", width,
                    "] (num_heads + 2 * num_kv_heads) * head_dim with a contiguous last dim, got ",
                    qkv.sizes(), " strides ", qkv.strides());
  const int64_t N = qkv.size(0);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(1) == D &&
                          t->stride(1) == 1,
                      "rope_and_cache: cos and sin must be float32 [max_pos, ", D,
                      "] with a contiguous last dim, got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK_VALUE(cos.size(0) == sin.size(0), "rope_and_cache: cos and sin lengths differ");
  TORCH_CHECK_VALUE(kv_layer.scalar_type() == dtype, "rope_and_cache: kv_layer dtype ",
                    kv_layer.scalar_type(), " must match qkv's ", dtype);
  TORCH_CHECK_VALUE(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.size(2) == KV &&
                        kv_layer.size(4) == D,
                    "rope_and_cache: kv_layer must be [num_blocks, 2, ", KV, ", block_size, ", D,
                    "], got ", kv_layer.sizes());
  const int64_t bs = kv_layer.size(3);
  TORCH_CHECK_VALUE(kv_layer.stride(4) == 1 && kv_layer.stride(3) == D &&
                        kv_layer.stride(2) == bs * D,
                    "rope_and_cache: kv_layer must be contiguous in its last three dims, strides ",
                    kv_layer.strides());
  check_index(positions, N, "positions");
  check_index(slot_blocks, N, "slot_blocks");
  check_index(slot_offsets, N, "slot_offsets");
  check_range(positions, cos.size(0), "positions", "positions of the cos/sin tables");
  check_range(slot_blocks, kv_layer.size(0), "slot_blocks", "blocks");
  check_range(slot_offsets, bs, "slot_offsets", "slots per block");
  if (N == 0) return;

  RopeParams p;
  p.qkv = qkv.data_ptr();
  p.qkv_stride = qkv.stride(0);
  p.pos = positions.data_ptr<int64_t>();
  p.pos_stride = positions.stride(0);
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.cos_stride = cos.stride(0);
  p.sin_stride = sin.stride(0);
  p.kv = kv_layer.data_ptr();
  p.kv_bstride = kv_layer.stride(0);
  p.kv_kvstride = kv_layer.stride(1);
  p.blocks = slot_blocks.data_ptr<int64_t>();
  p.blocks_stride = slot_blocks.stride(0);
  p.offsets = slot_offsets.data_ptr<int64_t>();
  p.offsets_stride = slot_offsets.stride(0);
  p.H = H;
  p.KV = KV;
  p.D = D;
  p.bs = bs;
  if (dtype == at::kFloat)
    rope_and_cache_rows<float>(p, N);
  else
    rope_and_cache_rows<bf16>(p, N);
}
