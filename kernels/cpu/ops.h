// The extension's entry points, declared once: bindings.cpp binds them to Python, and
// llama_layers.cpp calls them from C++. Each is defined in the .cpp file its comment names, which
// includes this header: a definition that drifts from its declaration fails to compile.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

// paged_attention.cpp
void paged_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                            at::Tensor block_tables, at::Tensor context_lens, double scale);
bool has_avx512();
// Whether decode attention over these context lengths runs on the calling thread alone (too few key
// rows for a parallel region to pay); paged_decode_attention_quant (kv_quant.cpp) follows it too.
bool decode_attention_is_serial(const int32_t* lens, int64_t batch, int64_t kv_heads);

// paged_prefill.cpp
void paged_prefill_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                             at::Tensor block_tables, at::Tensor context_lens,
                             at::Tensor query_start_loc, double scale);

// cascade.cpp
void cascade_decode_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                              at::Tensor block_tables, at::Tensor context_lens,
                              at::Tensor group_rows, at::Tensor group_starts,
                              at::Tensor group_blocks, double scale);

// row_topk.cpp
void row_topk(const at::Tensor& x, const at::Tensor& out);
// fused_ops.cpp
void add_rms_norm(const at::Tensor& residual, const std::optional<at::Tensor>& delta,
                  const at::Tensor& weight, double eps, const at::Tensor& out);
void silu_mul(const at::Tensor& gate_up, const at::Tensor& out);
void rope_and_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                    const at::Tensor& sin, const at::Tensor& kv_layer, const at::Tensor& slot_blocks,
                    const at::Tensor& slot_offsets, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim);

// kv_quant.cpp
void rope_and_cache_quant(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& kv_layer,
                          const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
void paged_decode_attention_quant(at::Tensor out, at::Tensor q, at::Tensor k_cache,
                                  at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, double scale);
void dequantize_blocks(at::Tensor out, at::Tensor cache, at::Tensor block_ids);
bool kv_int8_integer_kernel(int64_t group, int64_t head_dim);

// int8_quant.cpp
void int8_quantize_rows(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t qmax);
void int8_scale_rows(const at::Tensor& acc, const at::Tensor& row_scales, const at::Tensor& out);
void int8_scale_output(const at::Tensor& acc, const at::Tensor& row_scales,
                       const at::Tensor& col_scales, const at::Tensor& out);
void fp8_widen(const at::Tensor& codes, const at::Tensor& out);
bool int8_gemm_available();
void int8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& col_sums,
               const at::Tensor& col_scales, const at::Tensor& out);

// bf16_gemm.cpp
bool bf16_gemm_available();
bool has_avx512_bf16();
bool has_amx_bf16();
double bf16_dot_peak_gflops(int64_t rounds);
void bf16_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& out);
// scratch: room for the [M, 2I] product where the two kernels run in turn (none: allocated).
void bf16_gemm_silu_mul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& out,
                        const std::optional<at::Tensor>& scratch);

// llama_layers.cpp
at::Tensor llama_layers(const at::Tensor& residual, const std::optional<at::Tensor>& delta,
                        const std::vector<at::Tensor>& weights, const at::Tensor& positions,
                        const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                        const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                        int64_t num_decode, const at::Tensor& decode_block_tables,
                        const at::Tensor& decode_context_lens, const at::Tensor& prefill_block_tables,
                        const at::Tensor& prefill_context_lens, const at::Tensor& query_start_loc,
                        int64_t num_padding, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, int64_t intermediate, double eps, double scale,
                        bool quantized_kv);
