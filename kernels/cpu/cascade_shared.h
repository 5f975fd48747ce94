// Cascade decode attention (cascade.cpp): the work a call describes (CascadeParams, the shared
// pass's items) and the shared pass on AVX-512: a group's (member, query head) rows over the K/V it
// shares, packed once per (group, kv head) as paged_prefill.cpp packs them, through prefill_loop.h's
// loop without the causal mask and with an LSE out. Included by cascade.cpp and cascade_amx.h; in
// an anonymous namespace like the rest of the kernel (one translation unit).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define BATON_CASCADE_AVX512 1
#endif

#include "attention_common.h"
#include "prefill_loop.h"

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

#ifdef BATON_CASCADE_AVX512
// ---------------------------------------------------------------------------------------------
// Shared pass: prefill_loop.h's loop without a causal mask and with an LSE out, on the
// (group, kv head)'s shared K/V packed once (QKBF: q.k with vdpbf16ps, T must be bf16; PVBF: P V
// with vdpbf16ps).
template <typename T, int D, bool QKBF, bool PVBF>
struct Shared {
  using Loop = PrefillLoop<T, D, QKBF, PVBF>;
  static constexpr int R = Loop::R;
  static constexpr int64_t kKChunkBytes = Loop::kKChunkBytes;
  static constexpr int64_t kVChunkBytes = Loop::kVChunkBytes;

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
      Loop::template rows<false, true>(p, static_cast<int>(std::min<int64_t>(R, it.r1 - r0)), n_keys,
                                       qrow, {orow, lserow}, kb, vb);
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
#endif  // BATON_CASCADE_AVX512

}  // namespace
