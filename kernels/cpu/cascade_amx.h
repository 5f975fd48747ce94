// Cascade decode attention's shared pass on AMX tiles (bf16, D = 64), where the kernels are built
// for a CPU with AMX-BF16 (cascade.cpp's pick_shared takes it when Linux grants the tile state).
// In an anonymous namespace, included by cascade.cpp: one translation unit, as before the split.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_common.h"
#include "amx_rows.h"
#include "cascade_shared.h"

namespace {

#if defined(BATON_CASCADE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define BATON_CASCADE_AMX 1
// ---------------------------------------------------------------------------------------------
// Shared pass on AMX tiles (bf16, D = 64): the group's rows 16 at a time through amx_rows.h's
// loop (no causal mask, out in fp32 with its log-sum-exp), over the K/V that Shared<bf16, 64, true,
// true> packs: its chunks are the tiles' VNNI layouts already.

struct SharedAmx {
  using S = Shared<c10::BFloat16, 64, true, true>;
  static constexpr int D = 64, M = 16;

  static void item(const CascadeParams& p, const SharedItem& it, S::PackState& ps) {
    S::pack(p, it, ps);
    const uint8_t* kb = ps.kbuf->data()->bytes;
    const uint8_t* vb = ps.vbuf->data()->bytes;
    const int64_t n_keys = static_cast<int64_t>(p.group_blocks[it.g]) * p.bs;
    const auto* q = static_cast<const c10::BFloat16*>(p.q);
    for (int64_t r0 = it.r0; r0 < it.r1; r0 += M) {
      const c10::BFloat16* qrow[M];
      float* orow[M];
      float* lserow[M];
      const int n_valid = static_cast<int>(std::min<int64_t>(M, it.r1 - r0));
      for (int r = 0; r < n_valid; ++r) {
        const int64_t i = r0 + r;
        const int64_t b = item_row(p, it, i), h = it.kh * p.G + i % p.G;
        qrow[r] = q + b * p.q_bstride + h * p.q_hstride;
        orow[r] = p.state_o + (b * p.H + h) * D;
        lserow[r] = p.state_lse + b * p.H + h;
      }
      AmxRows<false, true>::rows(p.scale, n_valid, n_keys, qrow, {orow, lserow}, kb, vb);
    }
  }

  static void range(const CascadeParams& p, const std::vector<SharedItem>& items, int64_t lo,
                    int64_t hi) {
    thread_local std::vector<CacheLine> kbuf, vbuf;
    S::PackState ps;
    ps.kbuf = &kbuf;
    ps.vbuf = &vbuf;
    amx_configure();
    for (int64_t i = lo; i < hi; ++i) item(p, items[i], ps);
    _tile_release();
  }
};
#endif  // AMX

}  // namespace
