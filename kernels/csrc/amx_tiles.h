// AMX tile state shared by the kernels that use it: the process's permission to hold tile
// data (Linux hands it out per process, on request) and one tile configuration.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace kvrelay {

// True once the kernel has granted this process AMX tile state (arch_prctl); asked once.
inline bool amx_permitted() {
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

#if defined(__AMX_TILE__)
// All 8 tiles 16 rows of 64 bytes (fp32 16 x 16, or bf16 16 x 32), on the calling thread.
inline void configure_full_tiles() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int tile = 0; tile < 8; ++tile) {
    config.rows[tile] = 16;
    config.colsb[tile] = 64;
  }
  // ldtilecfg reads the 64 bytes through its operand: GCC 12's _tile_loadconfig builtin does not
  // tell the optimizer so, which then dropped the stores of rows and colsb above as dead (a
  // palette with no tile configured: SIGILL at the first tile instruction).
  asm volatile("ldtilecfg %0" : : "m"(config) : "memory");
}
#endif  // __AMX_TILE__

}  // namespace kvrelay
