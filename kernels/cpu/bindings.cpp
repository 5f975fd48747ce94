// Python bindings of the CPU kernel extension: every kernels/cpu/*.cpp is compiled into one module
// (see baton.kernels.cpu_ops.load). The kernels themselves include no pybind headers.
//
// Errors: kernels validate their inputs with TORCH_CHECK_VALUE, which torch's exception
// translation raises as ValueError.

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("llama_layers", &llama_layers,
        "Every Llama decoder layer of a step in one call (the Python layer's kernels, in its order)",
        py::arg("residual"), py::arg("delta"), py::arg("weights"), py::arg("positions"), py::arg("cos"),
        py::arg("sin"), py::arg("kv_cache"), py::arg("slot_blocks"), py::arg("slot_offsets"),
        py::arg("num_decode"), py::arg("decode_block_tables"), py::arg("decode_context_lens"),
        py::arg("prefill_block_tables"), py::arg("prefill_context_lens"), py::arg("query_start_loc"),
        py::arg("num_padding"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("intermediate"), py::arg("eps"), py::arg("scale"), py::arg("quantized_kv"),
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_and_cache_quant", &rope_and_cache_quant,
        "rope_and_cache into a quantized cache: rotate q and k in place, quantize k and v rows",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv_layer"),
        py::arg("slot_blocks"), py::arg("slot_offsets"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant,
        "Paged decode attention over a quantized KV cache (int8/fp8 rows with bf16 scales)",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_blocks", &dequantize_blocks,
        "Blocks of a quantized layer cache, dequantized into a dense model-dtype cache",
        py::arg("out"), py::arg("cache"), py::arg("block_ids"), py::call_guard<py::gil_scoped_release>());
  m.def("kv_int8_integer_kernel", &kv_int8_integer_kernel,
        "Whether int8 KV decode attention runs on integer dot products for this group and head_dim",
        py::arg("group"), py::arg("head_dim"));
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged decode attention over a block-major KV cache, written into out",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal paged prefill attention of each sequence's new tokens over its paged KV cache",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("query_start_loc"),
        py::arg("scale"), py::call_guard<py::gil_scoped_release>());
  m.def("cascade_decode_attention", &cascade_decode_attention,
        "Paged decode attention with each group's shared prefix blocks attended once for the group",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_tables"), py::arg("context_lens"), py::arg("group_rows"),
        py::arg("group_starts"), py::arg("group_blocks"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("has_avx512", &has_avx512, "Whether the AVX-512 path was compiled in");
  m.def("bf16_gemm_available", &bf16_gemm_available,
        "Whether bf16_gemm was compiled in: AVX512-BF16 (AMX too where the build has it), or AVX2's fp32 FMAs");
  m.def("has_avx512_bf16", &has_avx512_bf16, "Whether the build targets a CPU with AVX512-BF16 (vdpbf16ps)");
  m.def("has_amx_bf16", &has_amx_bf16, "Whether the build targets a CPU with AMX-BF16 tiles");
  m.def("bf16_dot_peak_gflops", &bf16_dot_peak_gflops,
        "GFLOP/s of independent vdpbf16ps chains on every thread (0 without AVX512-BF16)",
        py::arg("rounds"));
  m.def("bf16_gemm", &bf16_gemm, "out = x @ W.T in bf16 (fp32 sums) with W packed by bf16_gemm_pack",
        py::arg("x"), py::arg("packed"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_gemm_silu_mul", &bf16_gemm_silu_mul,
        "out [M, I] = silu(gate) * up of x @ W.T, W a [gate; up] product packed by bf16_gemm_pack: "
        "the bits of bf16_gemm then silu_mul, without the [M, 2I] product in memory on AMX",
        py::arg("x"), py::arg("packed"), py::arg("out"), py::arg("scratch") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm_available", &int8_gemm_available, "Whether int8_gemm's VNNI kernel was compiled in");
  m.def("int8_gemm", &int8_gemm,
        "W8A8 out = quant(x) @ W.T with W packed by int8_gemm_pack, both scales applied, one call",
        py::arg("x"), py::arg("packed"), py::arg("col_sums"), py::arg("col_scales"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_quantize_rows", &int8_quantize_rows,
        "Dynamic per-row symmetric int8: codes = round(x / scale), scale = amax(|x|) / qmax; uint8 codes + qmax + 1",
        py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("qmax") = 127,
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_scale_rows", &int8_scale_rows, "out = acc * row_scales[:, None] (fp32 acc to bf16/fp32)",
        py::arg("acc"), py::arg("row_scales"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("int8_scale_output", &int8_scale_output,
        "out = acc * row_scales[:, None] * col_scales (an int32 product back to bf16/fp32)",
        py::arg("acc"), py::arg("row_scales"), py::arg("col_scales"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("fp8_widen", &fp8_widen, "out = codes (float8_e4m3fn) in out's dtype (bf16/fp32)",
        py::arg("codes"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm,
        "residual += delta (fp32, in place); out = rms_norm(residual) * weight in out's dtype",
        py::arg("residual"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("out"),
        py::call_guard<py::gil_scoped_release>());
  m.def("row_topk", &row_topk,
        "out[r] = indices of row r's out.size(1) largest values, largest first, ties in index order",
        py::arg("x"), py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "out = silu(gate_up[:, :I]) * gate_up[:, I:]", py::arg("gate_up"),
        py::arg("out"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_and_cache", &rope_and_cache,
        "Rotate q and k of a fused qkv in place (rotate-half RoPE), write k and v to the paged cache",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("kv_layer"),
        py::arg("slot_blocks"), py::arg("slot_offsets"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::call_guard<py::gil_scoped_release>());
}
