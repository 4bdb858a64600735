// GELU in its erf form on 8 floats with AVX2 and FMA: what `few_rows`' AVX2 kernels apply to their outputs, and the
// exp the AVX2 build of `few_tokens_attention.cpp` takes. The same approximation as `gelu_avx512.h` (Abramowitz and
// Stegun's 7.1.26 for erfc, exp as 2^n times a degree-6 polynomial; within 4e-7 |x| of the exact value on -12..12),
// with 2^n built in the exponent's bits, as AVX2 has no `vscalefps`.
#pragma once

#include <immintrin.h>

namespace roformer_hf {

// exp(y) for y <= 0: 2^n times a degree-6 polynomial of the remainder (as `gelu_avx512.h`'s), 2^n built in the
// exponent's bits; 0 below -87.3 (where float32's normal numbers end).
inline __m256 exp_nonpositive(__m256 y) {
  const __m256 underflows = _mm256_cmp_ps(y, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  y = _mm256_max_ps(y, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = y - n ln 2, with ln 2 in two parts so that n ln 2 is exact to float32's precision
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), y);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                             _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(underflows, _mm256_mul_ps(p, scale));
}

inline __m256 gelu(__m256 x) {
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 z = _mm256_mul_ps(magnitude, _mm256_set1_ps(0.70710678118654752f));  // |x| / sqrt 2
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), z,
                                                                          _mm256_set1_ps(1.0f)));
  __m256 poly = _mm256_set1_ps(1.061405429f);
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(-1.453152027f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(1.421413741f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(-0.284496736f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(0.254829592f));
  const __m256 minus_z_squared = _mm256_mul_ps(z, _mm256_sub_ps(_mm256_setzero_ps(), z));
  const __m256 erfc = _mm256_mul_ps(_mm256_mul_ps(poly, t), exp_nonpositive(minus_z_squared));
  // x >= 0: x (1 - erfc / 2); x < 0: x erfc / 2
  const __m256 half = _mm256_mul_ps(erfc, _mm256_set1_ps(0.5f));
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 factor = _mm256_blendv_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), half), half, negative);
  return _mm256_mul_ps(x, factor);
}

}  // namespace roformer_hf
