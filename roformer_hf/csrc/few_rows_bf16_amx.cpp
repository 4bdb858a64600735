// y = activation(x w^T + bias (+ residual)) in bf16 for inputs of a few dozen rows, with AMX's bf16 tiles:
// `roformer_hf/few_rows.py` builds it and `fused` calls it on CPUs with amx_bf16.
//
// The weight lies as `few_rows_bf16_avx512.cpp` reads it (`few_rows.pack_bf16`): panels of `kTile` output features, in
// pairs of input features, so that the 16 pairs of 32 input features hold, for each of a panel's three 16-feature
// blocks, one AMX tile of weights (16 lines of 64 bytes, 192 bytes apart). Up to 16 rows go against a panel at once:
// per 32 input features, one tile of the rows' inputs and three of weights, three `tdpbf16ps` adding their pairs of
// products to three tiles of float32 sums. The weight streams from memory in the order it lies, which the CPU's own
// prefetching follows (fetching it ahead in software, 2-16 KiB, changed nothing on an Intel Xeon with AMX); the next 16
// rows against a panel read it from the caches. Input features past the last multiple of 32 are added by `vdpbf16ps`,
// row by row, to the sums stored from the tiles; then the epilogue as in the AVX-512 kernel (`bf16_avx512.h`). A row's
// result does not depend on the rows beside it.
#include <immintrin.h>

#include "amx_tiles.h"
#include "bf16_avx512.h"
#include "panels_avx512.h"

#include <algorithm>
#include <cstdint>

namespace {

using roformer_hf::add_products;
using roformer_hf::configure_tiles;
using roformer_hf::kTileRows;
using roformer_hf::broadcast_pair;
using roformer_hf::columns_mask;
using roformer_hf::Epilogue;
using roformer_hf::kTile;
using roformer_hf::store;
using roformer_hf::Sums;

constexpr int64_t kChunk = 32;       // input features one tile of inputs holds: 16 pairs
constexpr int64_t kLine = kTile * 2 * 2;  // bytes of a panel's pair of input features: 48 features x 2 x bf16

// Rows [m0, m0 + rows) of x against the panel for output features [n0, n0 + kTile).
void panel_rows(const uint16_t* x, const uint16_t* panel, const Epilogue& e, uint16_t* y, int64_t N, int64_t K,
                int64_t m0, int rows, int64_t n0) {
  const int64_t chunks = K / kChunk;
  const char* w = reinterpret_cast<const char*>(panel);
  const uint16_t* a = x + m0 * K;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t c = 0; c < chunks; ++c, w += kLine * (kChunk / 2), a += kChunk) {
    _tile_loadd(3, a, K * 2);
    _tile_loadd(4, w, kLine);
    _tile_loadd(5, w + 64, kLine);
    _tile_loadd(6, w + 128, kLine);
    _tile_dpbf16ps(0, 3, 4);
    _tile_dpbf16ps(1, 3, 5);
    _tile_dpbf16ps(2, 3, 6);
  }
  alignas(64) float sums[kTileRows][kTile];
  _tile_stored(0, &sums[0][0], kTile * 4);
  _tile_stored(1, &sums[0][16], kTile * 4);
  _tile_stored(2, &sums[0][32], kTile * 4);
  const int64_t pairs = (K + 1) / 2, columns = std::min(kTile, N - n0);
  for (int r = 0; r < rows; ++r) {
    const uint16_t* row = x + (m0 + r) * K;
    Sums sum[3];
    for (int v = 0; v < 3; ++v) sum[v] = Sums(_mm512_load_ps(&sums[r][16 * v]));
    for (int64_t p = chunks * kChunk / 2; p < pairs; ++p) {  // the input features past the tiles'
      const char* tail = reinterpret_cast<const char*>(panel) + p * kLine;
      const __m512i pair = broadcast_pair(row, 2 * p, 2 * p + 1 == K);
      for (int v = 0; v < 3; ++v) add_products(sum[v], pair, _mm512_loadu_si512(tail + 64 * v));
    }
    for (int v = 0; v < 3; ++v)
      store(sum[v], e, y, (m0 + r) * N + n0 + 16 * v, n0 + 16 * v, columns_mask(columns, v));
  }
}

void panels(const uint16_t* x, const uint16_t* w, const Epilogue& e, uint16_t* y, int64_t M, int64_t N, int64_t K,
            int64_t first, int64_t last) {
  if (first >= last) return;
  const int64_t pairs = (K + 1) / 2;
  int configured = 0;
  for (int64_t p = first; p < last; ++p) {
    const uint16_t* panel = w + p * pairs * kTile * 2;
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      if (rows != configured) {
        configure_tiles(rows);
        configured = rows;
      }
      panel_rows(x, panel, e, y, N, K, m0, rows, p * kTile);
    }
  }
  _tile_release();
}

}  // namespace

extern "C" int few_row_bf16_tile() { return kTile; }

// 1 where Linux grants this process AMX's tile data (`amx_tiles.h`), 0 where not.
extern "C" int few_row_amx_permission() { return roformer_hf::request_tile_data() ? 1 : 0; }

// As `few_row_bf16_linear` (`few_rows_bf16_avx512.cpp`), on the same packed weight, for M >= 1 rows; the caller has
// `few_row_amx_permission`.
extern "C" void few_row_bf16_linear(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                        const uint16_t* residual, uint16_t* y, int64_t M, int64_t N, int64_t K,
                                        int activation, int threads) {
  const Epilogue e{bias, residual, activation};
  roformer_hf::share_panels(N, threads, [&](int64_t first, int64_t last) { panels(x, w, e, y, M, N, K, first, last); });
}
