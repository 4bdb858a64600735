// y = x w^T + bias (+ residual) in fp32 for inputs of few rows, with AVX2 and FMA: `roformer_hf/few_rows.py` builds
// and calls it.
//
// The rows of x lie in a vector's lanes (x transposed, 8 or 16 lanes at a time) and each weight entry is broadcast
// once against them, so the weight, which a short input's product waits on, streams through once in the order it is
// laid out: tiles of `kTile` output columns, each tile's entries column by column (`few_rows.pack`). Each output is
// summed over k in order, whatever the number of rows, so a row's result does not depend on the rows beside it.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <memory>

namespace {

constexpr int64_t kTile = 6;          // output columns a tile holds: `few_rows.TILE`
constexpr int64_t kPrefetch = 1024;   // how far ahead (in floats) the weight is fetched into the caches

// `Tiles` adjacent tiles of the packed weight `w` against one block of `Lanes` rows of the transposed input `xt`
// (`Lanes` floats a step of k): out[t * kTile + j][lane].
template <int Lanes, int Tiles>
inline void tile_product(const float* xt, const float* w, int64_t K, float* out) {
  constexpr int kVectors = Lanes / 8;
  __m256 sums[Tiles * kTile][kVectors];
  for (auto& column : sums)
    for (auto& sum : column) sum = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    if (((k * kTile) & 15) < kTile)  // once a cache line of each tile's stream
      for (int t = 0; t < Tiles; ++t)
        _mm_prefetch(reinterpret_cast<const char*>(w + t * kTile * K + k * kTile + kPrefetch), _MM_HINT_T0);
    __m256 a[kVectors];
    for (int v = 0; v < kVectors; ++v) a[v] = _mm256_loadu_ps(xt + k * Lanes + 8 * v);
    for (int t = 0; t < Tiles; ++t)
      for (int j = 0; j < kTile; ++j) {
        const __m256 b = _mm256_broadcast_ss(w + t * kTile * K + k * kTile + j);
        for (int v = 0; v < kVectors; ++v) sums[t * kTile + j][v] = _mm256_fmadd_ps(a[v], b, sums[t * kTile + j][v]);
      }
  }
  for (int c = 0; c < Tiles * kTile; ++c)
    for (int v = 0; v < kVectors; ++v) _mm256_storeu_ps(out + c * Lanes + 8 * v, sums[c][v]);
}

// Tiles [first, last) of the output, every block of rows: 16 lanes one tile at a time, 8 lanes two tiles at a time
// (each way 12 vectors of sums).
template <int Lanes>
void tiles(const float* xt, const float* w, const float* bias, const float* residual, float* y, int64_t M, int64_t N,
           int64_t K, int64_t first, int64_t last) {
  constexpr int Tiles = Lanes == 8 ? 2 : 1;
  alignas(32) float out[Tiles * kTile * Lanes];
  const int64_t blocks = (M + Lanes - 1) / Lanes;
  for (int64_t t = first; t < last; t += Tiles) {
    const bool whole = t + Tiles <= last;
    const int64_t n0 = t * kTile, columns = std::min<int64_t>((whole ? Tiles : 1) * kTile, N - n0);
    for (int64_t block = 0; block < blocks; ++block) {
      const float* x_block = xt + block * K * Lanes;
      if (whole) {
        tile_product<Lanes, Tiles>(x_block, w + n0 * K, K, out);
      } else {
        tile_product<Lanes, 1>(x_block, w + n0 * K, K, out);
      }
      const int64_t rows = std::min<int64_t>(Lanes, M - block * Lanes);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t m = block * Lanes + r;
        for (int64_t j = 0; j < columns; ++j) {
          float value = out[j * Lanes + r];
          if (bias != nullptr) value += bias[n0 + j];
          if (residual != nullptr) value += residual[m * N + n0 + j];
          y[m * N + n0 + j] = value;
        }
      }
    }
    if (!whole) t += 1 - Tiles;  // one tile done, not `Tiles`
  }
}

}  // namespace

// x (M, K), contiguous; w: (N, K) packed by `few_rows.pack`; bias (N) or null; residual (M, N), contiguous, or null;
// y (M, N), contiguous. The tiles are shared out among `threads` threads of the OpenMP runtime torch runs on.
extern "C" void few_row_linear(const float* x, const float* w, const float* bias, const float* residual, float* y,
                               int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t lanes = M <= 8 ? 8 : 16, blocks = (M + lanes - 1) / lanes;
  std::unique_ptr<float[]> xt(new float[blocks * K * lanes]);
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t r = 0; r < lanes; ++r) {
        const int64_t m = block * lanes + r;
        xt[(block * K + k) * lanes + r] = m < M ? x[m * K + k] : 0.f;
      }
  const int64_t count = (N + kTile - 1) / kTile;
#pragma omp parallel num_threads(threads)
  {
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    const int64_t first = count * part / parts, last = count * (part + 1) / parts;
    if (lanes == 8) {
      tiles<8>(xt.get(), w, bias, residual, y, M, N, K, first, last);
    } else {
      tiles<16>(xt.get(), w, bias, residual, y, M, N, K, first, last);
    }
  }
}
