// A step's decoder layers in one call: the Llama layer of common/model/llama.py (add + RMS norm,
// QKV projection, RoPE and cache write, paged attention, output projection, add + RMS norm,
// gate/up projection, SiLU x up, down projection), layer after layer, calling the same kernels in
// the same order as the Python layer does, so the outputs are bit for bit the Python layers'
// (tests/model/test_llama_layers.py).
//
// What it saves: the Python layer makes ~10 calls through torch and pybind a layer (~0.1 ms of
// dispatch: 3-5 ms of a 30-layer step, a third of a batch-1 token), and allocates every
// intermediate anew; at 64 rows and more those are fresh pages to fault in each time (a 64-row
// gate/up output is 384 KB, a 2,048-row one 12 MB). Here the step pays one call, and the layers
// share one set of buffers.
//
// The step's rows are laid out as attention.py lays them: [decode rows | prefill chunks | padding].
// The decode rows (the first num_decode) go through paged decode attention, the prefill chunks
// (query_start_loc) through paged prefill attention, and the padding rows' attention output is
// zero (their K/V go where slot_blocks sends them). llama.py sends the steps whose shape this
// covers: bf16 projections packed for bf16_gemm, no cascade groups, and a bf16 KV cache or a
// quantized one without prefill chunks (a quantized cache's prefill dequantizes blocks in Python).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>  // not ATen/ATen.h: every operator's header, 12 s of each compile
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <vector>

#include "ops.h"  // the kernels it calls (their own translation units)

namespace {

// Reads the weights' bytes into the caches, a 64-byte line at a time, until `done`: each tensor's
// two halves at once (a GEMM's two threads each stream one half, dynamic_for.h), the tensors in
// turn. Changes nothing; the GEMM that follows finds the lines read in L2 or L3, not in DRAM.
void warm(std::initializer_list<const at::Tensor*> weights, const std::atomic<bool>& done) {
  constexpr int64_t kLine = 64, kCheck = 64;  // lines between looks at `done` (4 KB)
  uint64_t sink = 0;
  for (const at::Tensor* w : weights) {
    const auto* bytes = static_cast<const volatile uint8_t*>(w->data_ptr());
    const int64_t half = w->nbytes() / 2;
    for (int64_t at = 0; at < half; at += kLine * kCheck) {
      if (done.load(std::memory_order_relaxed)) return;
      for (int64_t i = at; i < std::min(at + kLine * kCheck, half); i += kLine)
        sink += bytes[i] + bytes[half + i];
    }
  }
  asm volatile("" : : "r"(sink));  // the loads stay
}

}  // namespace

// Layer i's weights: [input norm, qkv, o, post-attention norm, gate_up, down] at 6 i .. 6 i + 5 (the
// norms fp32 [hidden], the projections bf16_gemm-packed). Returns the last layer's output (the
// delta the final norm adds); residual ([N, hidden] fp32) is updated in place, as the layers do.
// prefill_block_tables / prefill_context_lens / query_start_loc: attention.py's prefill metadata
// (no prefill chunk: prefill_context_lens is empty).
at::Tensor llama_layers(const at::Tensor& residual, const std::optional<at::Tensor>& delta,
                        const std::vector<at::Tensor>& weights, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                        const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                        int64_t num_decode, const at::Tensor& decode_block_tables,
                        const at::Tensor& decode_context_lens, const at::Tensor& prefill_block_tables,
                        const at::Tensor& prefill_context_lens, const at::Tensor& query_start_loc,
                        int64_t num_padding, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t intermediate, double eps, double scale,
                        bool quantized_kv) {
  TORCH_CHECK_VALUE(residual.dim() == 2 && residual.scalar_type() == at::kFloat,
                    "llama_layers: residual must be [N, hidden] fp32");
  TORCH_CHECK_VALUE(kv_cache.dim() == 6, "llama_layers: kv_cache must be [blocks, layers, 2, KV, bs, D]");
  const int64_t layers = kv_cache.size(1);
  TORCH_CHECK_VALUE(static_cast<int64_t>(weights.size()) == 6 * layers,
                    "llama_layers: 6 weights a layer, got ", weights.size(), " for ", layers, " layers");
  const int64_t n = residual.size(0), hidden = residual.size(1);
  TORCH_CHECK_VALUE(0 <= num_decode && 0 <= num_padding && num_decode + num_padding <= n,
                    "llama_layers: num_decode + num_padding must be within the step's ", n, " rows");
  const bool prefill = prefill_context_lens.numel() > 0;
  TORCH_CHECK_VALUE(!(prefill && quantized_kv), "llama_layers: no prefill chunk over a quantized cache");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const auto opts = residual.options().dtype(at::kBFloat16);
  // The buffers every layer reuses (the Python layer allocates them anew; the values are the same:
  // each layer writes every element it reads).
  at::Tensor h = at::empty({n, hidden}, opts);
  at::Tensor qkv = at::empty({n, q_size + 2 * kv_size}, opts);
  at::Tensor attn = at::empty({n, num_heads, head_dim}, opts);
  at::Tensor o = at::empty({n, hidden}, opts);
  at::Tensor gate_up = at::empty({n, 2 * intermediate}, opts);  // used only where AMX is not
  at::Tensor act = at::empty({n, intermediate}, opts);
  at::Tensor out = at::empty({n, hidden}, opts);  // each layer's output, read by the next one's first op
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({n, num_heads, head_dim});
  const at::Tensor q_decode = q.narrow(0, 0, num_decode);
  const at::Tensor attn_decode = attn.narrow(0, 0, num_decode);
  if (num_padding > 0) attn.narrow(0, n - num_padding, num_padding).zero_();  // no kernel writes them
  // Decode rows alone whose attention runs on one thread (batch 1 and other small steps): the other
  // threads would only wait through it (a third of batch-1's samples on 2 cores, Zen 3).
  const at::Tensor lens = decode_context_lens.contiguous();
  const bool overlap = !prefill && num_decode > 0 && at::get_num_threads() > 1 &&
                       !at::in_parallel_region() && lens.scalar_type() == at::kInt &&
                       decode_attention_is_serial(lens.data_ptr<int32_t>(), lens.numel(), num_kv_heads);
  std::optional<at::Tensor> prev = delta;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + 6 * i;
    const at::Tensor kv_layer = kv_cache.select(1, i);
    const at::Tensor k_cache = kv_layer.select(1, 0), v_cache = kv_layer.select(1, 1);
    add_rms_norm(residual, prev, w[0], eps, h);
    bf16_gemm(h, w[1], qkv);
    auto attend = [&] {
      if (quantized_kv) {
        rope_and_cache_quant(qkv, positions, cos, sin, kv_layer, slot_blocks, slot_offsets,
                             num_heads, num_kv_heads, head_dim);
        if (num_decode > 0)
          paged_decode_attention_quant(attn_decode, q_decode, k_cache, v_cache, decode_block_tables,
                                       decode_context_lens, scale);
      } else {
        rope_and_cache(qkv, positions, cos, sin, kv_layer, slot_blocks, slot_offsets, num_heads,
                       num_kv_heads, head_dim);
        if (num_decode > 0)
          paged_decode_attention(attn_decode, q_decode, k_cache, v_cache, decode_block_tables,
                                 decode_context_lens, scale);
        if (prefill)
          paged_prefill_attention(attn, q, k_cache, v_cache, prefill_block_tables,
                                  prefill_context_lens, query_start_loc, scale);
      }
    };
    if (overlap) {
      // Attention on one thread, as it would run anyway; another reads the next two projections'
      // weights meanwhile, where it would wait for the o projection's region. Same results.
      std::atomic<bool> done{false};
      at::parallel_for(0, 2, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t part = lo; part < hi; ++part) {
          if (part == 0) {
            attend();
            done.store(true, std::memory_order_relaxed);
          } else {
            warm({&w[2], &w[4]}, done);
          }
        }
      });
    } else {
      attend();
    }
    bf16_gemm(attn.view({n, q_size}), w[2], o);
    add_rms_norm(residual, o, w[3], eps, h);
    bf16_gemm_silu_mul(h, w[4], act, gate_up);
    bf16_gemm(act, w[5], out);
    prev = out;
  }
  return prev.has_value() ? *prev : at::Tensor();
}
