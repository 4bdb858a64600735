// What `few_rows`' kernels on AMX's tiles (`few_rows_bf16_amx.cpp`, `few_rows_int8_vnni.cpp` built with
// ROFORMER_HF_AMX) share: the process's permission to use the tiles, and one tile configuration: tiles 0-2 the sums of
// a panel's three blocks of 16 output features, tile 3 the rows of input, tiles 4-6 the weights of the three blocks,
// every row 64 bytes.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace roformer_hf {

constexpr int kTileRows = 16;  // rows of inputs (and of sums) a tile holds

// AMX's tile configuration, palette 1 (`ldtilecfg`'s 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Configures the calling thread's tiles for `rows` rows of input (1 to `kTileRows`).
inline void configure_tiles(int rows) {
  TileConfig config;
  for (int tile = 0; tile < 7; ++tile) {
    config.rows[tile] = static_cast<uint8_t>(tile < 4 ? rows : kTileRows);
    config.bytes_per_row[tile] = 64;
  }
  _tile_loadconfig(&config);
}

// Asks Linux for this process's permission to use AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA): true
// where granted (or granted before).
inline bool request_tile_data() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

}  // namespace roformer_hf
