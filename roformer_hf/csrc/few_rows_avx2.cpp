// y = activation(x w^T + bias (+ residual)) in fp32 for inputs of few rows, with AVX2 and FMA: `roformer_hf/few_rows.py` builds
// and calls it on CPUs without AVX-512 (`few_rows_avx512.cpp` on the others).
//
// The rows of x lie in a vector's lanes (x transposed, 16 lanes at a time and the last 8 or fewer in 8) and each
// weight entry is broadcast once against them, so the weight, which a short input's product waits on, streams through
// once in the order it is laid out: tiles of `kTile` output columns, each tile's entries column by column
// (`few_rows.pack`); many rows go in groups that stay in a core's L2 cache. Each output is summed over k in order,
// whatever the number of rows from 2 up, so a row's result does not depend on the rows beside it; one row alone takes
// `row_tiles`. A thread applies the activation to the columns it wrote once a group's are all written, row by row,
// while they are still in its caches.
#include <immintrin.h>
#include <omp.h>

#include "gelu_avx2.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

namespace {

constexpr int64_t kTile = 6;          // output columns a tile holds: `few_rows.TILE`
constexpr int64_t kPrefetch = 1024;   // how far ahead (in floats) the weight is fetched into the caches
// The transposed rows a group of blocks holds: every tile passes over a group while it stays in a core's L2 cache (512
// KiB on a Zen 3), the weight streaming from the L3 once a group. Over all the rows at once, each tile read them from
// the L3 again: 1.32x MKL's time at 1024 rows, 1.48x at 2626, where groups of 64-256 KiB took 0.85-0.88x at 1024 rows
// (384 KiB: 0.96x) and groups of 192 KiB 0.95x at 2626.
constexpr int64_t kGroupBytes = 192 * 1024;

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

// 8 rows against two tiles, the same sums spelled out and kept out of line: written as above and inlined, GCC stored
// the twelve sums to the stack at every step of k (or kept one there), and the product ran at half the rate.
template <>
__attribute__((noinline)) void tile_product<8, 2>(const float* xt, const float* w, int64_t K, float* out) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m256 c6 = c0, c7 = c0, c8 = c0, c9 = c0, c10 = c0, c11 = c0;
  const float* u = w;               // the first tile's entries at step k
  const float* v = w + kTile * K;   // the second's
  for (int64_t k = 0; k < K; ++k, u += kTile, v += kTile) {
    if (((k * kTile) & 15) < kTile) {
      _mm_prefetch(reinterpret_cast<const char*>(u + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + kPrefetch), _MM_HINT_T0);
    }
    const __m256 a = _mm256_loadu_ps(xt + k * 8);
    c0 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(u), c0);
    c1 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(u + 1), c1);
    c2 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(u + 2), c2);
    c3 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(u + 3), c3);
    c4 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(u + 4), c4);
    c5 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(u + 5), c5);
    c6 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(v), c6);
    c7 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(v + 1), c7);
    c8 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(v + 2), c8);
    c9 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(v + 3), c9);
    c10 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(v + 4), c10);
    c11 = _mm256_fmadd_ps(a, _mm256_broadcast_ss(v + 5), c11);
  }
  const __m256 sums[2 * kTile] = {c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11};
  for (int c = 0; c < 2 * kTile; ++c) _mm256_storeu_ps(out + c * 8, sums[c]);
}

// y's rows [m0, m0 + rows) and columns [n0, n0 + columns) from `out` (column j's `Lanes` rows at out[j * Lanes]), plus
// the bias and the residual.
template <int Lanes>
inline void store(const float* out, const float* bias, const float* residual, float* y, int64_t N, int64_t m0,
                  int64_t rows, int64_t n0, int64_t columns) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r;
    for (int64_t j = 0; j < columns; ++j) {
      float value = out[j * Lanes + r];
      if (bias != nullptr) value += bias[n0 + j];
      if (residual != nullptr) value += residual[m * N + n0 + j];
      y[m * N + n0 + j] = value;
    }
  }
}

// Tiles [first, last) of the output, two at a time, against the rows [m0, m0 + 16 * blocks + tail): each tile against
// every block of 16 rows in `xt16` (one tile at a time, 12 vectors of sums), then against the last rows, `tail` of
// them (up to 8), in `xt8` (both tiles at once, 12 vectors of sums too), so that 17-24 rows cost a block and a half,
// not two.
void tiles(const float* xt16, int64_t blocks, const float* xt8, int64_t tail, const float* w, const float* bias,
           const float* residual, float* y, int64_t M, int64_t N, int64_t K, int64_t m0, int64_t first,
           int64_t last) {
  alignas(32) float out[2 * kTile * 8];
  for (int64_t t = first; t < last; t += 2) {
    const int64_t pair = std::min<int64_t>(2, last - t);
    for (int64_t i = t; i < t + pair; ++i) {
      const int64_t n0 = i * kTile, columns = std::min(kTile, N - n0);
      for (int64_t block = 0; block < blocks; ++block) {
        const int64_t row = m0 + block * 16;
        tile_product<16, 1>(xt16 + block * K * 16, w + n0 * K, K, out);
        store<16>(out, bias, residual, y, N, row, std::min<int64_t>(16, M - row), n0, columns);
      }
    }
    if (tail > 0) {
      const int64_t n0 = t * kTile, columns = std::min(pair * kTile, N - n0);
      if (pair == 2) {
        tile_product<8, 2>(xt8, w + n0 * K, K, out);
      } else {
        tile_product<8, 1>(xt8, w + n0 * K, K, out);
      }
      store<8>(out, bias, residual, y, N, m0 + blocks * 16, tail, n0, columns);
    }
  }
}

// One row against tiles [first, last): each tile's entries read as whole vectors, 24 floats (4 steps of k) at a time,
// against the input repeated to the tile's layout (`xr`: x[k] six times in a row), into 3 vectors of sums. Output j
// then adds its four sums (the steps of k that are 0, 1, 2 and 3 modulo 4) in that order, and the steps past the last
// multiple of 4 one by one: an order of its own, the same on any number of threads. With one row in 8 lanes
// (`tile_product`) 7 of them were idle, and on a weight in the caches oneDNN's matrix-vector product was faster.
void row_tiles(const float* xr, const float* x, const float* w, const float* bias, const float* residual, float* y,
               int64_t N, int64_t K, int64_t first, int64_t last) {
  const int64_t whole = K / 4 * 4;
  alignas(32) float sums[4 * kTile];
  for (int64_t t = first; t < last; ++t) {
    const float* tile = w + t * kTile * K;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0;
    for (int64_t k = 0; k < whole; k += 4) {
      const float* u = tile + k * kTile;
      const float* r = xr + k * kTile;
      _mm_prefetch(reinterpret_cast<const char*>(u + kPrefetch), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(u + kPrefetch + 16), _MM_HINT_T0);
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(u), _mm256_loadu_ps(r), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(u + 8), _mm256_loadu_ps(r + 8), s1);
      s2 = _mm256_fmadd_ps(_mm256_loadu_ps(u + 16), _mm256_loadu_ps(r + 16), s2);
    }
    _mm256_store_ps(sums, s0);
    _mm256_store_ps(sums + 8, s1);
    _mm256_store_ps(sums + 16, s2);
    const int64_t n0 = t * kTile, columns = std::min(kTile, N - n0);
    for (int64_t j = 0; j < columns; ++j) {
      float value = sums[j] + sums[kTile + j] + sums[2 * kTile + j] + sums[3 * kTile + j];
      for (int64_t k = whole; k < K; ++k) value = std::fma(x[k], tile[k * kTile + j], value);
      if (bias != nullptr) value += bias[n0 + j];
      if (residual != nullptr) value += residual[n0 + j];
      y[n0 + j] = value;
    }
  }
}

// 8 rows of x (row i at rows[i], or zeros where it is null) at steps [k0, k0 + 8) of k, transposed into 8 vectors:
// out at step k0 + i is column i, 8 rows wide, written at xt[i * lanes].
inline void transpose8x8(const float* const rows[8], int64_t k0, int64_t lanes, float* xt) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = rows[i] != nullptr ? _mm256_loadu_ps(rows[i] + k0) : _mm256_setzero_ps();
  const __m256 a0 = _mm256_unpacklo_ps(r[0], r[1]), a1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 a2 = _mm256_unpacklo_ps(r[2], r[3]), a3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 a4 = _mm256_unpacklo_ps(r[4], r[5]), a5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 a6 = _mm256_unpacklo_ps(r[6], r[7]), a7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
  const __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
  const __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
  const __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
  _mm256_storeu_ps(xt + 0 * lanes, _mm256_permute2f128_ps(b0, b4, 0x20));
  _mm256_storeu_ps(xt + 1 * lanes, _mm256_permute2f128_ps(b1, b5, 0x20));
  _mm256_storeu_ps(xt + 2 * lanes, _mm256_permute2f128_ps(b2, b6, 0x20));
  _mm256_storeu_ps(xt + 3 * lanes, _mm256_permute2f128_ps(b3, b7, 0x20));
  _mm256_storeu_ps(xt + 4 * lanes, _mm256_permute2f128_ps(b0, b4, 0x31));
  _mm256_storeu_ps(xt + 5 * lanes, _mm256_permute2f128_ps(b1, b5, 0x31));
  _mm256_storeu_ps(xt + 6 * lanes, _mm256_permute2f128_ps(b2, b6, 0x31));
  _mm256_storeu_ps(xt + 7 * lanes, _mm256_permute2f128_ps(b3, b7, 0x31));
}

// The rows [m0, m0 + lanes) of x, transposed into `xt` (rows past M zero): 8 rows by 8 steps of k at a time in
// registers, the steps past the last multiple of 8 one by one. Element by element, step by step across the rows (rows
// K floats apart share the L1 cache's sets at K = 3072), it took up to a fifth of a 16-row product's time.
void transpose(const float* x, int64_t M, int64_t K, int64_t m0, int64_t lanes, float* xt) {
  const int64_t whole = K / 8 * 8;
  for (int64_t r0 = 0; r0 < lanes; r0 += 8) {
    const float* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = m0 + r0 + i < M ? x + (m0 + r0 + i) * K : nullptr;
    for (int64_t k0 = 0; k0 < whole; k0 += 8) transpose8x8(rows, k0, lanes, xt + k0 * lanes + r0);
    for (int64_t k = whole; k < K; ++k)
      for (int i = 0; i < 8; ++i) xt[k * lanes + r0 + i] = rows[i] != nullptr ? rows[i][k] : 0.f;
  }
}

// y[m][n] = activation(y[m][n]) for every row m and the columns [first * kTile, last * kTile) that exist (of N):
// 1 ReLU, 2 GELU (`gelu_avx2.h`), 0 none.
void activate(float* y, int64_t m0, int64_t m1, int64_t N, int64_t first, int64_t last, int activation) {
  if (activation == 0) return;
  const int64_t n0 = std::min(N, first * kTile), n1 = std::min(N, last * kTile);
  const auto apply = [activation](__m256 v) {
    return activation == 1 ? _mm256_max_ps(v, _mm256_setzero_ps()) : roformer_hf::gelu(v);
  };
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t m = m0; m < m1; ++m) {
    float* row = y + m * N;
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) _mm256_storeu_ps(row + n, apply(_mm256_loadu_ps(row + n)));
    if (n < n1) {
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n1 - n)), lane);
      _mm256_maskstore_ps(row + n, mask, apply(_mm256_maskload_ps(row + n, mask)));
    }
  }
}

}  // namespace

// The output columns a tile of the packed weight holds (`few_rows.pack` lays the weight out by it).
extern "C" int few_row_tile() { return kTile; }

// x (M, K), contiguous; w: (N, K) packed by `few_rows.pack`; bias (N) or null; residual (M, N), contiguous, or null;
// y (M, N), contiguous. `activation`: applied last, 0 none, 1 ReLU, 2 GELU (`gelu_avx2.h`). The tiles are shared out
// among `threads` threads of the OpenMP runtime torch runs on. `row_panels`: the AVX-512 kernel's, nothing here.
extern "C" void few_row_linear(const float* x, const float* w, const float* bias, const float* residual, float* y,
                               int64_t M, int64_t N, int64_t K, int threads, int activation, int /*row_panels*/) {
  const int64_t count = (N + kTile - 1) / kTile;
  if (M == 1) {
    std::unique_ptr<float[]> xr(new float[K * kTile]);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kTile; ++j) xr[k * kTile + j] = x[k];
#pragma omp parallel num_threads(threads)
    {
      const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
      const int64_t first = count * part / parts, last = count * (part + 1) / parts;
      row_tiles(xr.get(), x, w, bias, residual, y, N, K, first, last);
      activate(y, 0, 1, N, first, last, activation);
    }
    return;
  }
  // Blocks of 16 rows, and the rows after them in 8 lanes where there are 8 or fewer (all of them up to 8 rows).
  const int64_t rest = M % 16, tail = M <= 8 ? M : (rest > 0 && rest <= 8 ? rest : 0);
  const int64_t blocks = (M - tail + 15) / 16;
  // Groups of blocks whose transposed rows stay in a core's L2 cache while every tile passes over them.
  const int64_t block_bytes = 16 * std::max<int64_t>(K, 1) * static_cast<int64_t>(sizeof(float));
  const int64_t group = std::max<int64_t>(1, kGroupBytes / block_bytes);
  std::unique_ptr<float[]> xt(new float[(blocks * 16 + (tail > 0 ? 8 : 0)) * K]);
  const int64_t pairs = (count + 1) / 2;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t block = 0; block <= blocks; ++block) {
      if (block < blocks) {
        transpose(x, M, K, block * 16, 16, xt.get() + block * K * 16);
      } else if (tail > 0) {
        transpose(x, M, K, blocks * 16, 8, xt.get() + blocks * K * 16);
      }
    }
    // Each thread takes whole pairs of tiles, which the rows in 8 lanes take two at a time.
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    const int64_t first = std::min(count, 2 * (pairs * part / parts));
    const int64_t last = std::min(count, 2 * (pairs * (part + 1) / parts));
    // The groups in turn, the rows in 8 lanes with the last.
    for (int64_t start = 0;; start += group) {
      const bool last_group = start + group >= blocks;
      const int64_t in_group = std::min(group, blocks - start), m0 = start * 16;
      tiles(xt.get() + start * K * 16, in_group, xt.get() + blocks * K * 16, last_group ? tail : 0, w, bias, residual,
            y, M, N, K, m0, first, last);
      activate(y, m0, last_group ? M : m0 + in_group * 16, N, first, last, activation);
      if (last_group) break;
    }
  }
}
