// y = activation(dequantized(quantized(x) w^T) + bias (+ residual)) for fp32 inputs of few rows and int8 weights, with
// AVX2: `roformer_hf/few_rows.py` builds it where the CPU has no AVX-512 VNNI and `quantization.Int8Linear` calls it,
// in one call where fbgemm's path takes three (the input's range, the quantized product, the activation or residual).
//
// The input is quantized as in `few_rows_int8_vnni.cpp` (and `quantization.quantize_activations`): uint8, one scale
// and zero point for the whole input, each value multiplied by the float reciprocal of the scale and shifted by the
// zero point in one rounding, rounded half to even and clamped. The weight lies as `few_rows.pack_int8` lays it out
// for the VNNI kernel: panels of `kTile` output features, each panel's entries in groups of 4 input features. A
// vector holds 8 output features' groups: ``vpmaddubsw`` multiplies 4 uint8 inputs, broadcast, by them and adds
// neighbours (input features 2i and 2i + 1) into int16, ``vpmaddwd`` by ones adds the two int16 of each feature into
// an int32 sum. The int16 sums are exact only for weights whose neighbours of the same sign add to at most 128 in
// magnitude (255 x 128 fits an int16): `quantization.Int8Linear`'s `saturation_safe` scales, which the caller must
// have. Each panel is worked through in two halves of 24 output features (3 vectors), 3 rows at a time: 9 vectors of
// sums, 3 of weights, a broadcast input, a product and the ones fill AVX2's 16 registers. Each output is then
// ``(sum - zero_point * sum of the feature's weights) * (input scale * weight scale) + bias``, in float.
#include <immintrin.h>

#include "gelu_avx2.h"
#include "panels_avx512.h"  // kTile, share_panels: plain C++ and OpenMP, no AVX-512 instruction

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using roformer_hf::kTile;

constexpr int64_t kGroup = 4;    // input features a vector holds per output feature
constexpr int64_t kHalf = 24;    // output features a pass over a panel sums: 3 vectors of 8
constexpr int kRows = 3;         // rows at once
constexpr int64_t kPrefetch = 4096;  // how far ahead (bytes) the first rows fetch the weight

struct Epilogue {
  const int32_t* weight_sums;  // (N)
  const float* weight_scales;  // (N)
  const float* bias;           // (N) or null
  const float* residual;       // (M, N) or null
  float input_scale;
  int32_t zero_point;
  int activation;  // 0: none, 1: ReLU, 2: GELU (the erf form, `gelu_avx2.h`)
};

// The lanes of a vector of 8 output features from `column` that exist (of `N`), as a maskstore's mask.
inline __m256i lanes_before(int64_t column, int64_t N) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(8, N - column))), lane);
}

// y[offset .. offset + 8) from the int32 sums of output features [column, column + 8), those before N.
inline void store(__m256i sums, const Epilogue& e, float* y, int64_t offset, int64_t column, int64_t N) {
  const bool whole = column + 8 <= N;
  const __m256i mask = lanes_before(column, N);
  const auto load_ps = [&](const float* p) { return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, mask); };
  const __m256i weight_sums = whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(e.weight_sums + column))
                                    : _mm256_maskload_epi32(e.weight_sums + column, mask);
  const __m256i shift = _mm256_mullo_epi32(weight_sums, _mm256_set1_epi32(e.zero_point));
  const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(e.input_scale), load_ps(e.weight_scales + column));
  __m256 out = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sums, shift)), scale);
  if (e.bias != nullptr) out = _mm256_add_ps(out, load_ps(e.bias + column));
  if (e.residual != nullptr) out = _mm256_add_ps(out, load_ps(e.residual + offset));
  if (e.activation == 1) out = _mm256_max_ps(out, _mm256_setzero_ps());
  if (e.activation == 2) out = roformer_hf::gelu(out);
  if (whole)
    _mm256_storeu_ps(y + offset, out);
  else
    _mm256_maskstore_ps(y + offset, mask, out);
}

// 8 int32 sums. Kept in this type rather than `__m256i` (4 int64), with the loops over rows and vectors unrolled by
// pragma, so that GCC keeps half_rows' 9 of them in registers: it moved three through the stack at every step and
// copied the others between registers otherwise.
typedef int32_t Sums __attribute__((vector_size(32)));

// sum += the products of a's uint8 and w's int8 entries, 4 by 4: neighbours into int16, then pairs of those into int32.
inline void add_products(Sums& sum, __m256i a, __m256i w, __m256i ones) {
  sum += Sums(_mm256_madd_epi16(_mm256_maddubs_epi16(a, w), ones));
}

inline __m256i broadcast_group(const uint8_t* x) {
  int32_t group;
  std::memcpy(&group, x, sizeof(group));
  return _mm256_set1_epi32(group);
}

// Rows [m0, m0 + R) of the quantized input against output features [n0 + half * kHalf, + kHalf) of the panel.
template <int R>
void half_rows(const uint8_t* xq, const int8_t* panel, const Epilogue& e, float* y, int64_t N, int64_t groups,
               int64_t m0, int64_t n0, int half, bool first) {
  const __m256i ones = _mm256_set1_epi16(1);
  Sums sums[R][3] = {};
  const uint8_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = xq + (m0 + r) * groups * kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = panel + g * kTile * kGroup + half * kHalf * kGroup;
    if (first) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetch, _MM_HINT_T0);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    const __m256i w2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64));
#pragma GCC unroll 3
    for (int r = 0; r < R; ++r) {
      const __m256i a = broadcast_group(rows[r] + g * kGroup);
      add_products(sums[r][0], a, w0, ones);
      add_products(sums[r][1], a, w1, ones);
      add_products(sums[r][2], a, w2, ones);
    }
  }
  const int64_t column = n0 + half * kHalf;
#pragma GCC unroll 3
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int v = 0; v < 3; ++v)
      if (column + 8 * v < N) store(__m256i(sums[r][v]), e, y, (m0 + r) * N + column + 8 * v, column + 8 * v, N);
}

void panels(const uint8_t* xq, const int8_t* w, const Epilogue& e, float* y, int64_t M, int64_t N, int64_t groups,
            int64_t first, int64_t last) {
  for (int64_t p = first; p < last; ++p) {
    const int8_t* panel = w + p * groups * kTile * kGroup;
    const int64_t n0 = p * kTile;
    for (int half = 0; half < 2 && n0 + half * kHalf < N; ++half)
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const bool fetch = m0 == 0 && half == 0;
        switch (std::min<int64_t>(kRows, M - m0)) {
          case 3: half_rows<3>(xq, panel, e, y, N, groups, m0, n0, half, fetch); break;
          case 2: half_rows<2>(xq, panel, e, y, N, groups, m0, n0, half, fetch); break;
          default: half_rows<1>(xq, panel, e, y, N, groups, m0, n0, half, fetch); break;
        }
      }
  }
}

// The smallest and largest of x's `count` values; false where they are not finite (or one is NaN).
bool input_range(const float* x, int64_t count, float* low, float* high) {
  if (count == 0) {
    *low = *high = 0.0f;
    return true;
  }
  __m256 lows = _mm256_set1_ps(INFINITY), highs = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    lows = _mm256_min_ps(lows, v);
    highs = _mm256_max_ps(highs, v);
  }
  float l[8], h[8];
  _mm256_storeu_ps(l, lows);
  _mm256_storeu_ps(h, highs);
  bool nan = _mm256_movemask_ps(unordered) != 0;
  float lowest = l[0], highest = h[0];
  for (int j = 1; j < 8; ++j) {
    lowest = std::min(lowest, l[j]);
    highest = std::max(highest, h[j]);
  }
  for (; i < count; ++i) {
    nan |= std::isnan(x[i]);
    lowest = std::min(lowest, x[i]);
    highest = std::max(highest, x[i]);
  }
  *low = lowest;
  *high = highest;
  return !nan && std::isfinite(lowest) && std::isfinite(highest);
}

// Row of x (K values) as uint8 into xq's row of `groups` * 4 bytes, the bytes past K set to the zero point.
void quantize_row(const float* x, uint8_t* xq, int64_t K, int64_t groups, float inverse_scale, int32_t zero_point) {
  const __m256 inverse = _mm256_set1_ps(inverse_scale), zero = _mm256_set1_ps(static_cast<float>(zero_point));
  const __m256i low = _mm256_setzero_si256(), high = _mm256_set1_epi32(255);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    // rounded to nearest, ties to even (the default rounding mode), as fbgemm's kernel rounds
    __m256i q = _mm256_cvtps_epi32(_mm256_fmadd_ps(_mm256_loadu_ps(x + k), inverse, zero));
    q = _mm256_min_epi32(_mm256_max_epi32(q, low), high);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(xq + k), _mm_packus_epi16(words, words));
  }
  for (; k < K; ++k) {
    const float shifted = std::nearbyint(std::fmaf(x[k], inverse_scale, static_cast<float>(zero_point)));
    xq[k] = static_cast<uint8_t>(std::min(std::max(shifted, 0.0f), 255.0f));
  }
  for (; k < groups * kGroup; ++k) xq[k] = static_cast<uint8_t>(zero_point);
}

}  // namespace

extern "C" int few_row_int8_tile() { return kTile; }

// As `few_rows_int8_vnni.cpp`'s: x (M, K) fp32, contiguous; w packed by `few_rows.pack_int8` (saturation-safe
// scales), `weight_sums`, `weight_scales` (N); bias (N) or null; residual (M, N) or null; y (M, N). `activation`: 0
// none, 1 ReLU, 2 GELU. Returns 0, or 1 where x holds a value that is not finite (nothing written).
extern "C" int few_row_int8_linear(const float* x, const int8_t* w, const int32_t* weight_sums,
                                   const float* weight_scales, const float* bias, const float* residual, float* y,
                                   int64_t M, int64_t N, int64_t K, int activation, int threads) {
  float low, high;
  if (!input_range(x, M * K, &low, &high)) return 1;
  const double lowest = std::min<double>(low, 0.0), highest = std::max<double>(high, 0.0);
  const double scale = std::max((highest - lowest) / 255.0, static_cast<double>(FLT_MIN));
  const int32_t zero_point = static_cast<int32_t>(std::min(std::max(std::nearbyint(-lowest / scale), 0.0), 255.0));
  const float inverse_scale = 1.0f / static_cast<float>(scale);
  const int64_t groups = (K + kGroup - 1) / kGroup;
  thread_local std::vector<uint8_t> quantized;
  quantized.resize(static_cast<size_t>(M * groups * kGroup));
  uint8_t* const xq = quantized.data();
  for (int64_t m = 0; m < M; ++m)
    quantize_row(x + m * K, xq + m * groups * kGroup, K, groups, inverse_scale, zero_point);
  const Epilogue e{weight_sums, weight_scales, bias, residual, static_cast<float>(scale), zero_point, activation};
  roformer_hf::share_panels(N, threads,
                            [&](int64_t first, int64_t last) { panels(xq, w, e, y, M, N, groups, first, last); });
  return 0;
}
