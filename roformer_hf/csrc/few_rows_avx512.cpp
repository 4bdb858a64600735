// y = activation(x w^T + bias (+ residual)) in fp32 for inputs of few rows, with AVX-512: `roformer_hf/few_rows.py`
// builds and calls it on CPUs with AVX-512F (`few_rows_avx2.cpp` on the others).
//
// The weight lies in panels of `kTile` output columns, three vectors wide, each panel's entries column-block by
// column-block along k (`few_rows.pack`), so a step of k reads three whole vectors of it. Each input entry is
// broadcast against them, up to 8 rows at a time (24 vectors of sums), so no lane idles whatever the number of rows,
// and each step costs 3 loads of the weight and up to 8 broadcasts for up to 24 FMAs. More rows go in passes of up
// to 8; from 12 rows over blocks of the panel, while the next block streams from memory (`walk_panel`). Each output is
// summed over k in order, whatever the number of rows from 2 up, as in the AVX2 kernel: the same bits in either, and a
// row's result does not depend on the rows beside it. One row alone sums k in four interleaved runs (k modulo 4), so
// that its FMAs do not wait on each other; or, where the caller asks (`row_panels`), goes against four panels at once,
// each output summed over k in order (the bits it has beside other rows), so that four streams of the weight come from
// memory at once (one row took 0.82x the time that way, four layers' dense calls in a row on an Intel Xeon with AMX).
#include <immintrin.h>

#include "gelu_avx512.h"
#include "panels_avx512.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using roformer_hf::columns_mask;
using roformer_hf::kTile;

constexpr int64_t kPrefetch = 1024;  // how far ahead (in floats) the weight is fetched into the caches

// From `kBlockedRows` rows, passes go over blocks of `kBlock` steps of k (48 KiB of a panel) at a time.
constexpr int64_t kBlockedRows = 12, kBlock = 256;

constexpr int64_t kPanelsAtOnce = 4;  // panels one row goes against at once, where the caller asks (`row_panels`)

// One pass of rows [m0, m0 + kRows at most) over steps [k0, k1) of a panel (`walk_panel`).
struct Pass {
  int64_t m0, k0, k1, K;
  bool fetch;           // fetch the steps ahead as it reads them: the weight comes from memory
  const char* ahead;    // else its share of the weight the next passes read, to fetch as it goes
  int64_t ahead_steps;  // the steps that fetch it
  int per_step;         // the lines of 64 bytes each of them fetches

  bool starts() const { return k0 == 0; }   // no sums to carry in
  bool finishes() const { return k1 == K; }  // the sums are the outputs'
};

// Calls ``rows_at(std::integral_constant<int, R>(), m0, index)`` for each of the fewest blocks of at most `kRows` of
// `M` rows, of sizes as even as whole rows allow (a pass of a few rows after full ones cannot hide a block's fetch).
template <typename RowsAt>
inline void even_row_blocks(int64_t M, RowsAt&& rows_at) {
  const int64_t blocks = (M + roformer_hf::kRows - 1) / roformer_hf::kRows;
  for (int64_t index = 0, m0 = 0; index < blocks; ++index) {
    const int64_t rows = M / blocks + (index < M % blocks);
    roformer_hf::with_rows(rows, [&](auto constant) { rows_at(constant, m0, index); });
    m0 += rows;
  }
}

// Calls ``pass(std::integral_constant<int, R>(), Pass)`` for each pass of `M` rows over the panel at `panel`. Fewer
// than `kBlockedRows` rows: passes of `kRows` over the whole panel, the first fetching it ahead as it reads it from
// memory, the others reading it from the caches. More: passes over blocks of `kBlock` steps, as few as `kRows` rows
// allow and of even sizes (`even_row_blocks`), each carrying its rows' sums from the block before (`Pass::starts`,
// `Pass::finishes`) while it fetches its share of the next block (after a panel's last, the next panel's first), so
// that memory streams the weight while the passes compute: the passes over the whole panel left it idle during all but
// the first. Four layers' dense calls in a row took 0.82-0.87x that time at 16-24 rows on a Zen 5, 0.91-0.93x at 13
// and 32-33, 0.97-0.98x at 12 and 64, but 1.01-1.10x at 9-11 rows (`benchmarks/RESULTS.md`). Each output is still
// summed over k in order. `first`: the thread's first panel, whose first block nothing fetched; `more`: another panel
// of the thread's follows.
template <typename PassAt>
inline void walk_panel(int64_t M, int64_t K, const float* panel, bool first, bool more, PassAt&& pass) {
  using roformer_hf::kRows;
  if (M < kBlockedRows || K == 0) {  // (without input features, one pass stores the bias)
    roformer_hf::row_blocks(M, [&](auto rows, int64_t m0, bool first_rows) {
      pass(rows, Pass{m0, 0, K, K, first_rows, nullptr, 0, 0});
    });
    return;
  }
  // A step of the next block is 3 lines: 2 at each step of two passes, or 1 at each step of the first three.
  const int per_step = M <= 2 * kRows ? 2 : 1;
  for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
    const int64_t k1 = std::min(K, k0 + kBlock);
    const int64_t next = k1 < K ? std::min(kBlock, K - k1) : more ? std::min(kBlock, K) : 0;  // its steps
    const char* const ahead = reinterpret_cast<const char*>(panel + k1 * kTile);
    even_row_blocks(M, [&](auto rows, int64_t m0, int64_t index) {
      const int64_t fetched = index * (k1 - k0) * per_step;  // by the passes before
      const int64_t left = std::max<int64_t>(0, 3 * next - fetched);
      pass(rows, Pass{m0, k0, k1, K, first && k0 == 0 && m0 == 0, ahead + 64 * fetched,
                      std::min(k1 - k0, (left + per_step - 1) / per_step), per_step});
    });
  }
}

// Calls ``step(k)`` for the pass's steps from its first up to `end`, fetching its share of the weight ahead.
template <typename Step>
inline void pass_steps(const Pass& pass, int64_t end, Step&& step) {
  int64_t k = pass.k0;
  const char* ahead = pass.ahead;
  const int64_t fetching = std::min(end, pass.k0 + pass.ahead_steps);
  if (pass.per_step == 2) {
    for (; k < fetching; ++k, ahead += 128) {
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      step(k);
    }
  } else {
    for (; k < fetching; ++k, ahead += 64) {
      _mm_prefetch(ahead, _MM_HINT_T0);
      step(k);
    }
  }
  for (; k < end; ++k) step(k);
}

// The calling thread's buffer of at least `count` floats, kept for its next call: the sums the passes carry.
inline float* carried_sums(int64_t count) {
  thread_local std::vector<float> sums;
  if (sums.size() < static_cast<size_t>(count)) sums.resize(static_cast<size_t>(count));
  return sums.data();
}

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

// Rows [m0, m0 + R) of x against steps [k0, k1) of the panel at `panel` (output columns [n0, n0 + kTile)), as `pass`
// says (`walk_panel`), their sums carried in `carried` (kTile per row) from and to the passes over the other steps.
template <int R>
void panel_rows(const float* x, const float* panel, const Epilogue& e, float* y, int64_t N, int64_t K, int64_t n0,
                Pass pass, float* carried) {
  const int64_t m0 = pass.m0;
  __m512 sums[R][3];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 3; ++v)
      sums[r][v] = pass.starts() ? _mm512_setzero_ps() : _mm512_loadu_ps(carried + (m0 + r) * kTile + 16 * v);
  const float* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = x + (m0 + r) * K;
  const bool fetching = pass.fetch;
  pass_steps(pass, pass.k1, [&](int64_t k) {
    const float* w = panel + k * kTile;
    if (fetching) fetch(w);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16), w2 = _mm512_loadu_ps(w + 32);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(rows[r][k]);
      sums[r][0] = _mm512_fmadd_ps(w0, a, sums[r][0]);
      sums[r][1] = _mm512_fmadd_ps(w1, a, sums[r][1]);
      sums[r][2] = _mm512_fmadd_ps(w2, a, sums[r][2]);
    }
  });
  if (!pass.finishes()) {
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 3; ++v) _mm512_storeu_ps(carried + (m0 + r) * kTile + 16 * v, sums[r][v]);
    return;
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

// One row against P panels from `panel` on: each output summed over k in order, as from two rows up.
template <int P>
void panels_row(const float* x, const float* panel, const Epilogue& e, float* y, int64_t N, int64_t K, int64_t n0) {
  __m512 sums[P][3];
  for (auto& sum : sums)
    for (auto& vector : sum) vector = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 a = _mm512_set1_ps(x[k]);
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const float* w = panel + p * K * kTile + k * kTile;
      fetch(w);
      sums[p][0] = _mm512_fmadd_ps(_mm512_loadu_ps(w), a, sums[p][0]);
      sums[p][1] = _mm512_fmadd_ps(_mm512_loadu_ps(w + 16), a, sums[p][1]);
      sums[p][2] = _mm512_fmadd_ps(_mm512_loadu_ps(w + 32), a, sums[p][2]);
    }
  }
  for (int p = 0; p < P; ++p) {
    const int64_t start = n0 + p * kTile, columns = std::min(kTile, N - start);
    for (int v = 0; v < 3; ++v) store(sums[p][v], e, y, start + 16 * v, start + 16 * v, columns_mask(columns, v));
  }
}

// Panels [first, last) against every row of x (`walk_panel`); one row against `kPanelsAtOnce` at once where
// `row_panels`.
void panels(const float* x, const float* w, const Epilogue& e, float* y, int64_t M, int64_t N,
            int64_t K, int64_t first, int64_t last, bool row_panels) {
  float* const carried = M >= kBlockedRows ? carried_sums(M * kTile) : nullptr;
  for (int64_t p = first; p < last; ++p) {
    const float* panel = w + p * K * kTile;
    const int64_t n0 = p * kTile;
    if (M == 1 && row_panels) {
      const int64_t count = std::min(kPanelsAtOnce, last - p);
      switch (count) {
        case 4: panels_row<4>(x, panel, e, y, N, K, n0); break;
        case 3: panels_row<3>(x, panel, e, y, N, K, n0); break;
        case 2: panels_row<2>(x, panel, e, y, N, K, n0); break;
        default: panels_row<1>(x, panel, e, y, N, K, n0); break;
      }
      p += count - 1;
      continue;
    }
    if (M == 1) {
      panel_row(x, panel, e, y, N, K, n0);
      continue;
    }
    walk_panel(M, K, panel, p == first, p + 1 < last, [&](auto rows, Pass pass) {
      panel_rows<decltype(rows)::value>(x, panel, e, y, N, K, n0, pass, carried);
    });
  }
}

}  // namespace

// The output columns a panel of the packed weight holds (`few_rows.pack` lays the weight out by it).
extern "C" int few_row_tile() { return kTile; }

// x (M, K), contiguous; w: (N, K) packed by `few_rows.pack`; bias (N) or null; residual (M, N), contiguous, or null;
// y (M, N), contiguous. `activation`: applied last, 0 none, 1 ReLU, 2 GELU (`gelu_avx512.h`). `row_panels`: 1 where
// one row goes against `kPanelsAtOnce` panels at once. The panels are shared out among `threads` threads of the
// OpenMP runtime torch runs on.
extern "C" void few_row_linear(const float* x, const float* w, const float* bias, const float* residual, float* y,
                               int64_t M, int64_t N, int64_t K, int threads, int activation, int row_panels) {
  const Epilogue e{bias, residual, activation};
  roformer_hf::share_panels(N, threads, [&](int64_t first, int64_t last) {
    panels(x, w, e, y, M, N, K, first, last, row_panels != 0);
  });
}

