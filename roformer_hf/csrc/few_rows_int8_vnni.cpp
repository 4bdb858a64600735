// y = dequantized(quantized(x) w^T) + bias (+ residual, or ReLU or GELU) for fp32 inputs of few rows and int8
// weights, with AVX-512 VNNI: `roformer_hf/few_rows.py` builds it and `quantization.Int8Linear` calls it, in one call
// where oneDNN's path takes four (the input's range, its quantization, the product, the dequantization).
//
// The input is quantized as `quantization.quantize_activations` does: uint8 with one scale and zero point for the
// whole input, from its range widened to hold 0 (in double precision, as Python computes it), each value multiplied
// by the float reciprocal of the scale and shifted by the zero point in one rounding (a fused multiply-add), rounded
// half to even and clamped, as `torch.quantize_per_tensor` does (fbgemm's kernel). The weight (int8, one scale per
// output feature) lies in panels of `kTile` output features, three vectors wide, each panel's entries in groups of 4
// input features (`few_rows.pack_int8`): one `vpdpbusd` multiplies 4 uint8 inputs, broadcast, by the 4 weights of 16
// output features and adds them to int32 sums, exactly. Up to 8 rows go against a panel at once (24 vectors of sums);
// one row alone keeps four runs of sums (integer sums: their order does not change the result). Each output is then
// ``(sum - zero_point * sum of the feature's weights) * (input scale * weight scale) + bias``, in float.
//
// Built with ROFORMER_HF_AMX (CPUs with amx_int8), inputs of `kTileMinRows` rows and more run on AMX's tiles: 16
// groups of 4 input features hold, for each of a panel's three 16-feature blocks, one tile of weights (16 lines of 64
// bytes, 192 bytes apart); up to 16 quantized rows go against a panel at once, one tile of them and three of weights
// per 64 input features, three `tdpbusd` adding to three tiles of int32 sums; the groups past the last multiple of 16
// are added by `vpdpbusd`, row by row, to the sums stored from the tiles. Integer sums: the same outputs, bit for bit.
#include <immintrin.h>

#include "gelu_avx512.h"
#include "panels_avx512.h"
#ifdef ROFORMER_HF_AMX
#include "amx_tiles.h"
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using roformer_hf::columns_mask;
using roformer_hf::kTile;

constexpr int64_t kGroup = 4;  // input features a `vpdpbusd` sums per output feature
// How far ahead (in bytes) the weight is fetched into the caches: four layers' dense calls in a row took 0.94-0.96x
// the time of 4 KiB's at 8-32 rows on a Zen 5, as 16 KiB did; 24-32 KiB no better.
constexpr int64_t kPrefetch = 8192;

struct Epilogue {
  const int32_t* weight_sums;  // (N): each output feature's sum of weights, for the zero point
  const float* weight_scales;  // (N)
  const float* bias;           // (N) or null
  const float* residual;       // (M, N) or null
  float input_scale;
  int32_t zero_point;
  int activation;  // 0: none, 1: ReLU, 2: GELU (the erf form)
};

// y[offset + lane] from the int32 sums of output features [column, column + 16), for the lanes in `mask`.
inline void store(__m512i sums, const Epilogue& e, float* y, int64_t offset, int64_t column, __mmask16 mask) {
  const __m512i shift = _mm512_mullo_epi32(_mm512_maskz_loadu_epi32(mask, e.weight_sums + column),
                                           _mm512_set1_epi32(e.zero_point));
  const __m512 scale =
      _mm512_mul_ps(_mm512_set1_ps(e.input_scale), _mm512_maskz_loadu_ps(mask, e.weight_scales + column));
  __m512 out = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums, shift)), scale);
  if (e.bias != nullptr) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, e.bias + column));
  if (e.residual != nullptr) out = _mm512_add_ps(out, _mm512_maskz_loadu_ps(mask, e.residual + offset));
  if (e.activation == 1) out = _mm512_max_ps(out, _mm512_setzero_ps());
  if (e.activation == 2) out = roformer_hf::gelu(out);
  _mm512_mask_storeu_ps(y + offset, mask, out);
}

// 16 int32 sums. Kept in this type rather than `__m512i` (8 int64), and with the loops over rows and vectors
// unrolled by pragma, so that GCC keeps panel_rows' 24 of them in registers: it moved them through the stack at every
// step otherwise (3x the time at 8 rows).
typedef int32_t Sums __attribute__((vector_size(64)));

// sum += the products of a's uint8 and w's int8 entries, 4 by 4 (`vpdpbusd`).
inline void add_products(Sums& sum, __m512i a, __m512i w) { sum = Sums(_mm512_dpbusd_epi32(__m512i(sum), a, w)); }

// The panel's three lines `kPrefetch` bytes ahead of `w`, into the caches.
inline void fetch(const int8_t* w) {
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetch);
  for (int line = 0; line < 3; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

inline __m512i broadcast_group(const uint8_t* x) {
  int32_t group;
  std::memcpy(&group, x, sizeof(group));
  return _mm512_set1_epi32(group);
}

// Rows [m0, m0 + R) of the quantized input (`groups` groups of 4 per row) against the panel for output features
// [n0, n0 + kTile). `first`: the first rows against it, which fetch the panel ahead.
template <int R>
void panel_rows(const uint8_t* xq, const int8_t* panel, const Epilogue& e, float* y, int64_t N, int64_t groups,
                int64_t m0, int64_t n0, bool first) {
  Sums sums[R][3] = {};
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = xq + (m0 + r) * groups * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = panel + g * kTile * kGroup;
    if (first) fetch(w);
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i a = broadcast_group(rows[r] + g * kGroup);
      add_products(sums[r][0], a, w0);
      add_products(sums[r][1], a, w1);
      add_products(sums[r][2], a, w2);
    }
  }
  const int64_t columns = std::min(kTile, N - n0);
#pragma GCC unroll 3
  for (int v = 0; v < 3; ++v) {
    const __mmask16 mask = columns_mask(columns, v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store(__m512i(sums[r][v]), e, y, (m0 + r) * N + n0 + 16 * v, n0 + 16 * v, mask);
  }
}

// One row against the panel, in four runs of sums (groups modulo 4), so that its additions do not wait on each other.
void panel_row(const uint8_t* xq, const int8_t* panel, const Epilogue& e, float* y, int64_t N, int64_t groups,
               int64_t n0) {
  Sums runs[4][3] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = panel + g * kTile * kGroup;
    fetch(w);
    const __m512i a = broadcast_group(xq + g * kGroup);
    Sums* run = runs[g % 4];
    add_products(run[0], a, _mm512_loadu_si512(w));
    add_products(run[1], a, _mm512_loadu_si512(w + 64));
    add_products(run[2], a, _mm512_loadu_si512(w + 128));
  }
  const int64_t columns = std::min(kTile, N - n0);
  for (int v = 0; v < 3; ++v) {
    const Sums sum = runs[0][v] + runs[1][v] + runs[2][v] + runs[3][v];
    store(__m512i(sum), e, y, n0 + 16 * v, n0 + 16 * v, columns_mask(columns, v));
  }
}

#ifdef ROFORMER_HF_AMX
using roformer_hf::configure_tiles;
using roformer_hf::kTileRows;

// Fewer rows take `vpdpbusd`: four layers' dense calls of base width in a row took 1.10x its time on the tiles at 1-8
// rows, 0.85x at 16, 0.70-0.75x at 32-64 (an Intel Xeon with AMX)
constexpr int64_t kTileMinRows = 16;
constexpr int64_t kTileGroups = 16;            // groups of 4 input features a tile of inputs holds
constexpr int64_t kLine = kTile * kGroup;      // bytes of a panel's group: 48 features x 4

// Quantized rows [m0, m0 + rows) against the panel for output features [n0, n0 + kTile), on the tiles.
void panel_tiles(const uint8_t* xq, const int8_t* panel, const Epilogue& e, float* y, int64_t N, int64_t groups,
                 int64_t m0, int rows, int64_t n0) {
  const int64_t chunks = groups / kTileGroups, stride = groups * kGroup;
  const int8_t* w = panel;
  const uint8_t* a = xq + m0 * stride;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  for (int64_t c = 0; c < chunks; ++c, w += kLine * kTileGroups, a += kTileGroups * kGroup) {
    _tile_loadd(3, a, stride);
    _tile_loadd(4, w, kLine);
    _tile_loadd(5, w + 64, kLine);
    _tile_loadd(6, w + 128, kLine);
    _tile_dpbusd(0, 3, 4);
    _tile_dpbusd(1, 3, 5);
    _tile_dpbusd(2, 3, 6);
  }
  alignas(64) int32_t sums[kTileRows][kTile];
  _tile_stored(0, &sums[0][0], kTile * 4);
  _tile_stored(1, &sums[0][16], kTile * 4);
  _tile_stored(2, &sums[0][32], kTile * 4);
  const int64_t columns = std::min(kTile, N - n0);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = xq + (m0 + r) * stride;
    Sums sum[3];
    for (int v = 0; v < 3; ++v) sum[v] = Sums(_mm512_load_si512(&sums[r][16 * v]));
    for (int64_t g = chunks * kTileGroups; g < groups; ++g) {  // the groups past the tiles'
      const __m512i group = broadcast_group(row + g * kGroup);
      for (int v = 0; v < 3; ++v) add_products(sum[v], group, _mm512_loadu_si512(panel + g * kLine + 64 * v));
    }
    for (int v = 0; v < 3; ++v)
      store(__m512i(sum[v]), e, y, (m0 + r) * N + n0 + 16 * v, n0 + 16 * v, columns_mask(columns, v));
  }
}

void tile_panels(const uint8_t* xq, const int8_t* w, const Epilogue& e, float* y, int64_t M, int64_t N,
                 int64_t groups, int64_t first, int64_t last) {
  if (first >= last) return;
  int configured = 0;
  for (int64_t p = first; p < last; ++p) {
    const int8_t* panel = w + p * groups * kTile * kGroup;
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      if (rows != configured) {
        configure_tiles(rows);
        configured = rows;
      }
      panel_tiles(xq, panel, e, y, N, groups, m0, rows, p * kTile);
    }
  }
  if (configured) _tile_release();
}
#endif

void vector_panels(const uint8_t* xq, const int8_t* w, const Epilogue& e, float* y, int64_t M, int64_t N,
                   int64_t groups, int64_t first, int64_t last) {
  for (int64_t p = first; p < last; ++p) {
    const int8_t* panel = w + p * groups * kTile * kGroup;
    const int64_t n0 = p * kTile;
    if (M == 1) {
      panel_row(xq, panel, e, y, N, groups, n0);
      continue;
    }
    roformer_hf::row_blocks(M, [&](auto rows, int64_t m0, bool first_rows) {
      panel_rows<decltype(rows)::value>(xq, panel, e, y, N, groups, m0, n0, first_rows);
    });
  }
}

// Panels [first, last) against every quantized row: on the tiles from `kTileMinRows` rows where they are built,
// else with `vpdpbusd`.
void panels(const uint8_t* xq, const int8_t* w, const Epilogue& e, float* y, int64_t M, int64_t N, int64_t groups,
            int64_t first, int64_t last) {
#ifdef ROFORMER_HF_AMX
  if (M >= kTileMinRows) return tile_panels(xq, w, e, y, M, N, groups, first, last);
#endif
  vector_panels(xq, w, e, y, M, N, groups, first, last);
}

// The smallest and largest of x's `count` values; false where they are not finite (or one is NaN).
bool input_range(const float* x, int64_t count, float* low, float* high) {
  if (count == 0) {  // no values (no rows, or no input features): the range of 0 alone
    *low = *high = 0.0f;
    return true;
  }
  __m512 lows = _mm512_set1_ps(INFINITY), highs = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < count; i += 16) {
    const __mmask16 mask = count - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - i)) - 1);
    const __m512 v = _mm512_maskz_loadu_ps(mask, x + i);
    unordered |= _mm512_mask_cmp_ps_mask(mask, v, v, _CMP_UNORD_Q);
    lows = _mm512_mask_min_ps(lows, mask, lows, v);
    highs = _mm512_mask_max_ps(highs, mask, highs, v);
  }
  *low = _mm512_reduce_min_ps(lows);
  *high = _mm512_reduce_max_ps(highs);
  return unordered == 0 && std::isfinite(*low) && std::isfinite(*high);
}

// Row m of x (K values) as uint8 into xq's row of `groups` * 4 bytes, the bytes past K set to the zero point (their
// weights are 0).
void quantize_row(const float* x, uint8_t* xq, int64_t K, int64_t groups, float inverse_scale, int32_t zero_point) {
  const __m512 inverse = _mm512_set1_ps(inverse_scale), zero = _mm512_set1_ps(static_cast<float>(zero_point));
  const __m512i low = _mm512_setzero_si512(), high = _mm512_set1_epi32(255);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (K - k)) - 1);
    const __m512 shifted = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + k), inverse, zero);
    __m512i q = _mm512_cvt_roundps_epi32(shifted, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_epi32(_mm512_max_epi32(q, low), high);
    _mm512_mask_cvtepi32_storeu_epi8(xq + k, mask, q);
  }
  for (int64_t k = K; k < groups * kGroup; ++k) xq[k] = static_cast<uint8_t>(zero_point);
}

}  // namespace

extern "C" int few_row_int8_tile() { return kTile; }

#ifdef ROFORMER_HF_AMX
// 1 where Linux grants this process AMX's tile data (`amx_tiles.h`), 0 where not.
extern "C" int few_row_amx_permission() { return roformer_hf::request_tile_data() ? 1 : 0; }
#endif

// x (M, K) fp32, contiguous; w: the int8 weight (N, K) packed by `few_rows.pack_int8`, `weight_sums` its rows' sums,
// `weight_scales` (N); bias (N) or null; residual (M, N), contiguous, or null; y (M, N). `activation`: applied last,
// 0 none, 1 ReLU, 2 GELU (`gelu_avx512.h`). The panels are shared out among `threads` threads of the OpenMP runtime
// torch runs on. Returns 0, or 1 where x holds a value that is not finite (nothing is written then).
extern "C" int few_row_int8_linear(const float* x, const int8_t* w, const int32_t* weight_sums,
                                   const float* weight_scales, const float* bias, const float* residual, float* y,
                                   int64_t M, int64_t N, int64_t K, int activation, int threads) {
  float low, high;
  if (!input_range(x, M * K, &low, &high)) return 1;
  // `quantization.quantize_activations`: Python's floats are doubles, its round() halves to even as nearbyint does
  const double lowest = std::min<double>(low, 0.0), highest = std::max<double>(high, 0.0);
  const double scale = std::max((highest - lowest) / 255.0, static_cast<double>(FLT_MIN));
  const int32_t zero_point = static_cast<int32_t>(std::min(std::max(std::nearbyint(-lowest / scale), 0.0), 255.0));
  const float inverse_scale = 1.0f / static_cast<float>(scale);  // torch.quantize_per_tensor's float arithmetic
  const int64_t groups = (K + kGroup - 1) / kGroup;
  thread_local std::vector<uint8_t> quantized;  // the calling thread's, kept for its next call
  quantized.resize(static_cast<size_t>(M * groups * kGroup));
  uint8_t* const xq = quantized.data();
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, xq + m * groups * kGroup, K, groups, inverse_scale, zero_point);
  // oneDNN's int8 path rescales by the float product of the two scales, the input's taken as float
  const Epilogue e{weight_sums, weight_scales, bias, residual, static_cast<float>(scale), zero_point, activation};
  roformer_hf::share_panels(N, threads,
                            [&](int64_t first, int64_t last) { panels(xq, w, e, y, M, N, groups, first, last); });
  return 0;
}
