// What `few_rows`' bf16 kernels (`few_rows_bf16_avx512.cpp`, `few_rows_bf16_amx.cpp`) share: float32 sums of pairs of
// bf16 products (`vdpbf16ps`), an input pair broadcast, and the epilogue that adds the bias and the residual, applies
// the activation and rounds the result to bf16 (to nearest, ties to even), as oneDNN's bf16 kernel does with its
// post-ops.
#pragma once

#include <immintrin.h>

#include "gelu_avx512.h"

#include <cstdint>
#include <cstring>

namespace roformer_hf {

// 16 float32 sums, kept in this type and with the loops over rows unrolled by pragma so that GCC keeps panel_rows'
// 24 of them in registers (as in `few_rows_int8_vnni.cpp`).
typedef float Sums __attribute__((vector_size(64)));

// sum += a's pairs of bf16 times w's, pair by pair (`vdpbf16ps`).
inline void add_products(Sums& sum, __m512i a, __m512i w) {
  sum = Sums(_mm512_dpbf16_ps(__m512(sum), (__m512bh)a, (__m512bh)w));
}

// Inputs k and k + 1 of a row, as one 32-bit pair broadcast to every lane; `alone`: input k is the row's last, of an
// odd count, and pairs with 0 (its weights' pair is 0 too, but a value read past the row could be a NaN).
inline __m512i broadcast_pair(const uint16_t* row, int64_t k, bool alone) {
  uint32_t pair = row[k];
  if (!alone) std::memcpy(&pair, row + k, sizeof(pair));
  return _mm512_set1_epi32(static_cast<int32_t>(pair));
}

// bf16 entries as float32: their bits in the upper half.
inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

struct Epilogue {
  const uint16_t* bias;      // (N) or null
  const uint16_t* residual;  // (M, N) or null
  int activation;            // 0: none, 1: ReLU, 2: GELU (the erf form)
};

// y[offset + lane] = round_bf16(activation(sum + bias + residual)) for the lanes in `mask`.
inline void store(Sums sums, const Epilogue& e, uint16_t* y, int64_t offset, int64_t column, __mmask16 mask) {
  __m512 out = __m512(sums);
  if (e.bias != nullptr) out = _mm512_add_ps(out, widen(_mm256_maskz_loadu_epi16(mask, e.bias + column)));
  if (e.residual != nullptr) out = _mm512_add_ps(out, widen(_mm256_maskz_loadu_epi16(mask, e.residual + offset)));
  if (e.activation == 1) out = _mm512_max_ps(out, _mm512_setzero_ps());
  if (e.activation == 2) out = roformer_hf::gelu(out);
  _mm256_mask_storeu_epi16(y + offset, mask, (__m256i)_mm512_cvtneps_pbh(out));
}

}  // namespace roformer_hf
