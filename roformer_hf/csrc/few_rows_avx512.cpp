// y = activation(x w^T + bias (+ residual)) in fp32 for inputs of few rows, with AVX-512: `roformer_hf/few_rows.py`
// builds and calls it on CPUs with AVX-512F (`few_rows_avx2.cpp` on the others).
//
// The weight lies in panels of `kTile` output columns, three vectors wide, each panel's entries column-block by
// column-block along k (`few_rows.pack`), so a step of k reads three whole vectors of it. Each input entry is
// broadcast against them, up to 8 rows at a time (24 vectors of sums), so no lane idles whatever the number of rows,
// and each step costs 3 loads of the weight and up to 8 broadcasts for up to 24 FMAs. The panel streams from memory
// for the first 8 rows and from the caches for the next. Each output is summed over k in order, whatever the number
// of rows from 2 up, as in the AVX2 kernel: the same bits in either, and a row's result does not depend on the rows
// beside it. One row alone sums k in four interleaved runs (k modulo 4), so that its FMAs do not wait on each other.
#include <immintrin.h>

#include "gelu_avx512.h"
#include "panels_avx512.h"

#include <algorithm>
#include <cstdint>

namespace {

using roformer_hf::columns_mask;
using roformer_hf::kTile;

constexpr int64_t kPrefetch = 1024;  // how far ahead (in floats) the weight is fetched into the caches

struct Epilogue {
  const float* bias;      // (N) or null
  const float* residual;  // (M, N) or null
  int activation;         // 0: none, 1: ReLU, 2: GELU (the erf form)
};

// y[m][n0 + 16 v + lane] = activation(sum + bias + residual) for the lanes in `mask`.
inline void store(__m512 sum, const Epilogue& e, float* y, int64_t offset, int64_t column, __mmask16 mask) {
  if (e.bias != nullptr) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, e.bias + column));
  if (e.residual != nullptr) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, e.residual + offset));
  if (e.activation == 1) sum = _mm512_max_ps(sum, _mm512_setzero_ps());
  if (e.activation == 2) sum = roformer_hf::gelu(sum);
  _mm512_mask_storeu_ps(y + offset, mask, sum);
}

inline void fetch(const float* w) {
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + 16), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch + 32), _MM_HINT_T0);
}

// Rows [m0, m0 + R) of x against the panel at `panel` (output columns [n0, n0 + kTile)). `first`: the first rows
// against it, which fetch the panel ahead.
template <int R>
void panel_rows(const float* x, const float* panel, const Epilogue& e, float* y, int64_t N,
                int64_t K, int64_t m0, int64_t n0, bool first) {
  __m512 sums[R][3];
  for (auto& row : sums)
    for (auto& sum : row) sum = _mm512_setzero_ps();
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + (m0 + r) * K;
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kTile;
    if (first) fetch(w);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(rows[r][k]);
      sums[r][0] = _mm512_fmadd_ps(w0, a, sums[r][0]);
      sums[r][1] = _mm512_fmadd_ps(w1, a, sums[r][1]);
      sums[r][2] = _mm512_fmadd_ps(w2, a, sums[r][2]);
    }
  }
  const int64_t columns = std::min(kTile, N - n0);
  for (int v = 0; v < 3; ++v) {
    const __mmask16 mask = columns_mask(columns, v);
    for (int r = 0; r < R; ++r) store(sums[r][v], e, y, (m0 + r) * N + n0 + 16 * v, n0 + 16 * v, mask);
  }
}

// One row against the panel: k in four interleaved runs of sums, added in order at the end, then the steps past the
// last multiple of 4 one by one.
void panel_row(const float* x, const float* panel, const Epilogue& e, float* y, int64_t N,
               int64_t K, int64_t n0) {
  __m512 runs[4][3];
  for (auto& run : runs)
    for (auto& sum : run) sum = _mm512_setzero_ps();
  const int64_t whole = K / 4 * 4;
  for (int64_t k = 0; k < whole; k += 4) {
    for (int i = 0; i < 4; ++i) {
      const float* w = panel + (k + i) * kTile;
      fetch(w);
      const __m512 a = _mm512_set1_ps(x[k + i]);
      runs[i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(w), a, runs[i][0]);
      runs[i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), a, runs[i][1]);
      runs[i][2] = _mm512_fmadd_ps(_mm512_loadu_ps(w + 32), a, runs[i][2]);
    }
  }
  const int64_t columns = std::min(kTile, N - n0);
  for (int v = 0; v < 3; ++v) {
    __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(runs[0][v], runs[1][v]), runs[2][v]), runs[3][v]);
    for (int64_t k = whole; k < K; ++k)
      sum = _mm512_fmadd_ps(_mm512_loadu_ps(panel + k * kTile + 16 * v), _mm512_set1_ps(x[k]), sum);
    store(sum, e, y, n0 + 16 * v, n0 + 16 * v, columns_mask(columns, v));
  }
}

// Panels [first, last) against every row of x, `kRows` rows at a time.
void panels(const float* x, const float* w, const Epilogue& e, float* y, int64_t M, int64_t N,
            int64_t K, int64_t first, int64_t last) {
  for (int64_t p = first; p < last; ++p) {
    const float* panel = w + p * K * kTile;
    const int64_t n0 = p * kTile;
    if (M == 1) {
      panel_row(x, panel, e, y, N, K, n0);
      continue;
    }
    roformer_hf::row_blocks(M, [&](auto rows, int64_t m0, bool first_rows) {
      panel_rows<decltype(rows)::value>(x, panel, e, y, N, K, m0, n0, first_rows);
    });
  }
}

}  // namespace

// The output columns a panel of the packed weight holds (`few_rows.pack` lays the weight out by it).
extern "C" int few_row_tile() { return kTile; }

// x (M, K), contiguous; w: (N, K) packed by `few_rows.pack`; bias (N) or null; residual (M, N), contiguous, or null;
// y (M, N), contiguous. `activation`: applied last, 0 none, 1 ReLU, 2 GELU (`gelu_avx512.h`). The panels are shared
// out among `threads` threads of the OpenMP runtime torch runs on.
extern "C" void few_row_linear_activated(const float* x, const float* w, const float* bias, const float* residual,
                                         float* y, int64_t M, int64_t N, int64_t K, int threads, int activation) {
  const Epilogue e{bias, residual, activation};
  roformer_hf::share_panels(N, threads, [&](int64_t first, int64_t last) { panels(x, w, e, y, M, N, K, first, last); });
}

// `few_row_linear_activated` without an activation: the AVX2 kernel's call.
extern "C" void few_row_linear(const float* x, const float* w, const float* bias, const float* residual, float* y,
                               int64_t M, int64_t N, int64_t K, int threads) {
  few_row_linear_activated(x, w, bias, residual, y, M, N, K, threads, 0);
}
