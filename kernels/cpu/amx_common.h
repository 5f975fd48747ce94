// What every kernel on AMX tiles needs: Linux's permission for the tile state and a tile
// configuration (all eight tiles 16 rows x 64 bytes). Included where the build targets AMX-BF16
// (cascade_amx.h, bf16_gemm.cpp); each translation unit gets its own copy (anonymous namespace).

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace {

// Linux hands out AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), once
// per process.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Per thread, before its first tile instruction; _tile_release() after its last.
inline void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace
#endif
