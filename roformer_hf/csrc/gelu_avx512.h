// GELU in its erf form, gelu(x) = x / 2 * (1 + erf(x / sqrt 2)) (transformers' "gelu", RoFormer's), on 16 floats
// with AVX-512F: what `few_rows`' AVX-512 kernels apply to their sums before storing them.
//
// erf is Abramowitz and Stegun's 7.1.26, erfc(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2) with
// t = 1 / (1 + p z) for z >= 0, within 1.5e-7 of erfc: GELU within 7.5e-8 |x| of the exact value, and with float32's
// rounding of each step within 2.9e-7 |x| (4.2e-7 at most on -12..12, measured against float64's erfc), a few of
// float32's steps. Both signs go through erfc, so that GELU's small negative values are not the difference of two
// numbers near 1. exp is 2^n times a degree-6 polynomial of the remainder, scaled by `vscalefps`.
#pragma once

#include <immintrin.h>

namespace roformer_hf {

// exp(y) for y <= 0 (down to where it underflows to 0).
inline __m512 exp_nonpositive(__m512 y) {
  y = _mm512_max_ps(y, _mm512_set1_ps(-104.0f));  // exp(-104) is below float32's smallest subnormal
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = y - n ln 2, with ln 2 in two parts so that n ln 2 is exact to float32's precision
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), y);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 gelu(__m512 x) {
  const __m512 z = _mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(0.70710678118654752f));  // |x| / sqrt 2
  const __m512 t = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_set1_ps(0.3275911f), z,
                                                                          _mm512_set1_ps(1.0f)));
  __m512 poly = _mm512_set1_ps(1.061405429f);
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-1.453152027f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(1.421413741f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(-0.284496736f));
  poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(0.254829592f));
  const __m512 minus_z_squared = _mm512_mul_ps(z, _mm512_sub_ps(_mm512_setzero_ps(), z));
  const __m512 erfc = _mm512_mul_ps(_mm512_mul_ps(poly, t), exp_nonpositive(minus_z_squared));
  // x >= 0: x (1 - erfc / 2); x < 0: x erfc / 2
  const __m512 half = _mm512_mul_ps(erfc, _mm512_set1_ps(0.5f));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 factor = _mm512_mask_blend_ps(negative, _mm512_sub_ps(_mm512_set1_ps(1.0f), half), half);
  return _mm512_mul_ps(x, factor);
}

}  // namespace roformer_hf
