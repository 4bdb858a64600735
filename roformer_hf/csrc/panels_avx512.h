// What `few_rows`' AVX-512 kernels (fp32, bf16, int8) share: the weight's panels of `kTile` output features (three
// vectors of 16), the lanes of a panel's vector that hold output features, the walk over an input's rows `kRows` at a
// time, and the panels shared out among torch's threads.
#pragma once

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace roformer_hf {

constexpr int64_t kTile = 48;  // output features a panel holds: three vectors of 16
constexpr int kRows = 8;       // rows against a panel at once: 24 vectors of sums of AVX-512's 32

// The lanes of a panel's vector `v` that hold output features (the last panel's may hold fewer than 16).
inline __mmask16 columns_mask(int64_t columns, int v) {
  const int64_t left = std::min<int64_t>(16, columns - 16 * v);
  return left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// Calls ``f(std::integral_constant<int, R>())`` with R = `rows` (1 to `kRows`): a constant, so that each count's sums
// are registers of its own.
template <typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 8: f(std::integral_constant<int, 8>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>()); break;
  }
}

// Calls ``rows_at(std::integral_constant<int, R>(), m0, first)`` for each block of up to `kRows` rows of `M`, from
// row m0 (`with_rows`); `first`: the first block, which fetches the panel ahead, where the others read it from the
// caches.
template <typename RowsAt>
inline void row_blocks(int64_t M, RowsAt&& rows_at) {
  for (int64_t m0 = 0; m0 < M; m0 += kRows)
    with_rows(std::min<int64_t>(kRows, M - m0), [&](auto rows) { rows_at(rows, m0, m0 == 0); });
}

// Calls ``panels(first, last)`` on each of `threads` threads of the OpenMP runtime torch runs on, for its share of the
// panels of `N` output features: whole panels, so that a thread's work does not depend on the others'.
template <typename Panels>
inline void share_panels(int64_t N, int threads, Panels&& panels) {
  const int64_t count = (N + kTile - 1) / kTile;
#pragma omp parallel num_threads(threads)
  {
    const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    panels(count * part / parts, count * (part + 1) / parts);
  }
}

}  // namespace roformer_hf
