// y = activation(x w^T + bias (+ residual)) in bf16 for inputs of few rows, with AVX-512 bf16:
// `roformer_hf/few_rows.py` builds it and `fused` calls it on CPUs with avx512_bf16.
//
// The weight lies as the fp32 AVX-512 kernel's does, in panels of `kTile` output features, three vectors wide, but
// in pairs of input features (`few_rows.pack_bf16`): one `vdpbf16ps` multiplies a pair of inputs, broadcast, by the
// pair of weights of 16 output features and adds both products to float32 sums. Up to 8 rows go against a panel at
// once (24 vectors of sums); one row alone keeps four runs of sums, added at the end. The bias and the residual are
// added to the float32 sums, then the activation (ReLU, or GELU: `gelu_avx512.h`), and the result is rounded to bf16
// (to nearest, ties to even), as oneDNN's bf16 kernel does with its post-ops.
#include <immintrin.h>

#include "bf16_avx512.h"
#include "panels_avx512.h"

#include <algorithm>
#include <cstdint>

namespace {

using roformer_hf::add_products;
using roformer_hf::broadcast_pair;
using roformer_hf::columns_mask;
using roformer_hf::Epilogue;
using roformer_hf::kTile;
using roformer_hf::store;
using roformer_hf::Sums;

constexpr int64_t kPrefetch = 8192;  // how far ahead (in bytes) the weight is fetched into the caches

// Rows [m0, m0 + R) of x against the panel for output features [n0, n0 + kTile). `first`: the first rows against
// it, which fetch the panel ahead.
template <int R>
void panel_rows(const uint16_t* x, const uint16_t* panel, const Epilogue& e, uint16_t* y,
                int64_t N, int64_t K, int64_t m0, int64_t n0, bool first) {
  Sums sums[R][3] = {};
  const uint16_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + (m0 + r) * K;
  const auto step = [&](int64_t p, bool alone) {
    const char* w = reinterpret_cast<const char*>(panel + p * kTile * 2);
    if (first)
      for (int line = 0; line < 3; ++line) _mm_prefetch(w + kPrefetch + 64 * line, _MM_HINT_T0);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i a = broadcast_pair(rows[r], 2 * p, alone);
      add_products(sums[r][0], a, w0);
      add_products(sums[r][1], a, w1);
      add_products(sums[r][2], a, w2);
    }
  };
  for (int64_t p = 0; p < K / 2; ++p) step(p, false);
  if (K % 2) step(K / 2, true);
  const int64_t columns = std::min(kTile, N - n0);
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) {
    const __mmask16 mask = columns_mask(columns, v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store(sums[r][v], e, y, (m0 + r) * N + n0 + 16 * v, n0 + 16 * v, mask);
  }
}

// One row against the panel, in four runs of sums (pairs modulo 4), so that its additions do not wait on each other.
void panel_row(const uint16_t* x, const uint16_t* panel, const Epilogue& e, uint16_t* y,
               int64_t N, int64_t K, int64_t n0) {
  Sums runs[4][3] = {};
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const char* w = reinterpret_cast<const char*>(panel + p * kTile * 2);
    for (int line = 0; line < 3; ++line) _mm_prefetch(w + kPrefetch + 64 * line, _MM_HINT_T0);
    const __m512i a = broadcast_pair(x, 2 * p, 2 * p + 1 == K);
    Sums* run = runs[p % 4];
    add_products(run[0], a, _mm512_loadu_si512(w));
    add_products(run[1], a, _mm512_loadu_si512(w + 64));
    add_products(run[2], a, _mm512_loadu_si512(w + 128));
  }
  const int64_t columns = std::min(kTile, N - n0);
  for (int v = 0; v < 3; ++v)
    store((runs[0][v] + runs[1][v]) + (runs[2][v] + runs[3][v]), e, y, n0 + 16 * v, n0 + 16 * v,
          columns_mask(columns, v));
}

void panels(const uint16_t* x, const uint16_t* w, const Epilogue& e, uint16_t* y,
            int64_t M, int64_t N, int64_t K, int64_t first, int64_t last) {
  const int64_t pairs = (K + 1) / 2;
  for (int64_t p = first; p < last; ++p) {
    const uint16_t* panel = w + p * pairs * kTile * 2;
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

extern "C" int few_row_bf16_tile() { return kTile; }

// x (M, K) bf16, contiguous; w: the weight (N, K) packed by `few_rows.pack_bf16`; bias (N) or null; residual (M, N),
// contiguous, or null; y (M, N); all bf16. `activation`: applied last, 0 none, 1 ReLU, 2 GELU (`gelu_avx512.h`).
// The panels are shared out among `threads` threads of the OpenMP runtime
// torch runs on.
extern "C" void few_row_bf16_linear(const uint16_t* x, const uint16_t* w, const uint16_t* bias,
                                    const uint16_t* residual, uint16_t* y, int64_t M, int64_t N, int64_t K,
                                    int activation, int threads) {
  const Epilogue e{bias, residual, activation};
  roformer_hf::share_panels(N, threads, [&](int64_t first, int64_t last) { panels(x, w, e, y, M, N, K, first, last); });
}
