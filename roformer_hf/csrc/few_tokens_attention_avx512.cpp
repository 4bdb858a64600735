// Attention of sequences of few tokens, rotation included, with AVX-512F: `roformer_hf/few_rows.py` builds it and
// `few_rows.attention` calls it (a short input's self-attention on CPUs with AVX-512).
//
// For one sentence of 16 tokens a layer's attention is a few hundred thousand multiply-adds: far less work than the
// calls of PyTorch's operators around it (two rotations, SDPA and its reshapes) take to dispatch. Here one call does
// it all for every sequence and head: each key/value head's keys are rotated once and laid out transposed (each
// head dimension's row holds the sequence's keys, 16 to a vector), its values rotated where the model rotates them;
// then for each query of each of its query heads, the rotated query against the keys gives 16 scores a vector, their
// softmax (in float32, max subtracted, `exp_nonpositive`), and the weighted values, summed in order of the keys and
// divided by the weights' sum last. Queries, keys, values and the context are float32 or bf16 (converted on load,
// rounded to nearest even on store); everything between is float32. The (sequence, key/value head) pairs are shared
// out among torch's threads.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "gelu_avx512.h"

namespace {

using roformer_hf::exp_nonpositive;

// Where the tokens of one of q, k, v lie: token t's head h at base + t * token + h * head (in elements).
struct Operand {
  const void* base;
  int64_t token, head;
};

struct Problem {
  Operand q, k, v;
  const float* phases;  // (N, d/2, 2): each token's pairs' (cos, sin), or null: nothing rotates
  void* out;            // (N, heads, d), contiguous
  int64_t heads, kv_heads, d;
  float scaling;
  bool half;           // pairs (i, i + d/2), else (2i, 2i + 1)
  bool rotate_value;   // values rotate too
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16: the upper half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) {  // to nearest, ties to even; NaN stays a (quiet) NaN
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}

// One token's head vector `x` (d entries) rotated by the token's `phases` (d/2 pairs of cos, sin), as float32 into
// `y`: each pair (a, b) becomes (a cos - b sin, a sin + b cos). Without phases, `x` as it is.
template <typename T>
inline void rotated(const T* x, const float* phases, int64_t d, bool half, float* y) {
  if (phases == nullptr) {
    for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(y + c, load16(x + c));
  } else if (!half) {  // pairs side by side, as the phases' (cos, sin)
    for (int64_t c = 0; c < d; c += 16) {
      const __m512 v = load16(x + c), turn = _mm512_loadu_ps(phases + c);
      const __m512 swapped = _mm512_permute_ps(v, 0xB1);  // (b, a) of each pair
      _mm512_storeu_ps(y + c, _mm512_fmaddsub_ps(v, _mm512_moveldup_ps(turn),
                                                 _mm512_mul_ps(swapped, _mm512_movehdup_ps(turn))));
    }
  } else {  // pair i is (x[i], x[i + d/2]): 16 pairs' cos and sin gathered from 32 phases
    const __m512i cos_at = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i sin_at = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const int64_t h = d / 2;
    for (int64_t c = 0; c < h; c += 16) {
      const __m512 low = _mm512_loadu_ps(phases + 2 * c), high = _mm512_loadu_ps(phases + 2 * c + 16);
      const __m512 cos = _mm512_permutex2var_ps(low, cos_at, high), sin = _mm512_permutex2var_ps(low, sin_at, high);
      const __m512 a = load16(x + c), b = load16(x + h + c);
      _mm512_storeu_ps(y + c, _mm512_fmsub_ps(a, cos, _mm512_mul_ps(b, sin)));
      _mm512_storeu_ps(y + h + c, _mm512_fmadd_ps(a, sin, _mm512_mul_ps(b, cos)));
    }
  }
}

constexpr int kQueries = 4;  // queries against the keys at once

// Calls ``f(std::integral_constant<int, R>())`` with R = `count` (1 to `kQueries`).
template <typename F>
inline void with_queries(int64_t count, F&& f) {
  switch (count) {
    case 4: f(std::integral_constant<int, 4>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    default: f(std::integral_constant<int, 1>()); break;
  }
}

// The scaled scores of R rotated queries (R, d) against the keys (d, width), 16 keys at a time, into rows of
// `weights` (R, width); the lanes past the n keys -inf. Each query's sums run in two interleaved runs over the head
// dimensions (even and odd), added at the end.
template <int R>
inline void scores(const float* queries, const float* keys, int64_t d, int64_t n, int64_t width, float scaling,
                   float* weights) {
  for (int64_t b = 0; b < width; b += 16) {
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < d; t += 2) {
      const __m512 k0 = _mm512_loadu_ps(keys + t * width + b), k1 = _mm512_loadu_ps(keys + (t + 1) * width + b);
      for (int r = 0; r < R; ++r) {
        even[r] = _mm512_fmadd_ps(_mm512_set1_ps(queries[r * d + t]), k0, even[r]);
        odd[r] = _mm512_fmadd_ps(_mm512_set1_ps(queries[r * d + t + 1]), k1, odd[r]);
      }
    }
    const __mmask16 keys_here = n - b >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - b)) - 1);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), _mm512_set1_ps(scaling));
      _mm512_storeu_ps(weights + r * width + b, _mm512_mask_blend_ps(keys_here, _mm512_set1_ps(-INFINITY), s));
    }
  }
}

// A row of scores (width) into its softmax's numerators, exp(score - max), 0 past the keys; returns their sum.
inline void softmax(float* row, int64_t width) {
  __m512 largest = _mm512_set1_ps(-INFINITY);
  for (int64_t b = 0; b < width; b += 16) largest = _mm512_max_ps(largest, _mm512_loadu_ps(row + b));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(largest));
  __m512 total = _mm512_setzero_ps();
  for (int64_t b = 0; b < width; b += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + b), top));
    total = _mm512_add_ps(total, e);
    _mm512_storeu_ps(row + b, e);
  }
  // the numerators' sum, kept in the row's first lane past the keys would be overwritten: divide now
  const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
  for (int64_t b = 0; b < width; b += 16) _mm512_storeu_ps(row + b, _mm512_mul_ps(_mm512_loadu_ps(row + b), inverse));
}

// R rows of weights (R, width) times the values (n, d), summed in order of the keys, into R rows of `out` (a row
// every `stride` elements), 64 dimensions at a time (four vectors of sums a query), then 16.
template <int R, typename T>
inline void weighted(const float* weights, const float* values, int64_t d, int64_t n, int64_t width, T* out,
                     int64_t stride) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {
    __m512 sums[R][4];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) sums[r][u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const float* value = values + j * d + c;
      const __m512 v0 = _mm512_loadu_ps(value), v1 = _mm512_loadu_ps(value + 16), v2 = _mm512_loadu_ps(value + 32),
                   v3 = _mm512_loadu_ps(value + 48);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(weights[r * width + j]);
        sums[r][0] = _mm512_fmadd_ps(w, v0, sums[r][0]);
        sums[r][1] = _mm512_fmadd_ps(w, v1, sums[r][1]);
        sums[r][2] = _mm512_fmadd_ps(w, v2, sums[r][2]);
        sums[r][3] = _mm512_fmadd_ps(w, v3, sums[r][3]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < 4; ++u) store16(out + r * stride + c + 16 * u, sums[r][u]);
  }
  for (; c < d; c += 16) {
    __m512 sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m512 v = _mm512_loadu_ps(values + j * d + c);
      for (int r = 0; r < R; ++r) sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(weights[r * width + j]), v, sums[r]);
    }
    for (int r = 0; r < R; ++r) store16(out + r * stride + c, sums[r]);
  }
}

// The 16 x 16 floats of `r` transposed: lane l of vector m becomes lane m of vector l.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      t[8 * i + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0x88);
      t[8 * i + 4 + k] = _mm512_shuffle_f32x4(r[8 * i + k], r[8 * i + 4 + k], 0xDD);
    }
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], 0xDD);
  }
}
// What a thread keeps between calls: its sequence's keys transposed, its values, one query, one row of scores.
std::vector<float>& scratch(size_t size) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer;
}

// The tokens [start, start + n) of one sequence attend each other through key/value head g and its query heads.
template <typename T>
void attend_group(const Problem& p, int64_t start, int64_t n, int64_t g) {
  const int64_t d = p.d, width = (n + 15) / 16 * 16;  // keys in whole vectors, the last one's extra lanes zero
  std::vector<float>& buffer = scratch(static_cast<size_t>((3 * d + kQueries) * width + kQueries * d));
  float* const keys = buffer.data();  // (d, width): row t holds every key's dimension t
  float* const values = keys + d * width;  // (n, d)
  float* const rows = values + d * width;  // (width, d): the rotated keys, before they are laid out by dimension
  float* const queries = rows + d * width;  // (kQueries, d)
  float* const weights = queries + kQueries * d;  // (kQueries, width)
  const T* const k = static_cast<const T*>(p.k.base) + g * p.k.head;
  const T* const v = static_cast<const T*>(p.v.base) + g * p.v.head;
  for (int64_t j = 0; j < n; ++j) {
    const float* phases = p.phases == nullptr ? nullptr : p.phases + (start + j) * d;
    rotated(k + (start + j) * p.k.token, phases, d, p.half, rows + j * d);
    rotated(v + (start + j) * p.v.token, p.rotate_value ? phases : nullptr, d, p.half, values + j * d);
  }
  std::fill(rows + n * d, rows + width * d, 0.0f);
  for (int64_t b = 0; b < width; b += 16)
    for (int64_t c = 0; c < d; c += 16) {
      __m512 block[16];
      for (int j = 0; j < 16; ++j) block[j] = _mm512_loadu_ps(rows + (b + j) * d + c);
      transpose16(block);
      for (int t = 0; t < 16; ++t) _mm512_storeu_ps(keys + (c + t) * width + b, block[t]);
    }

  const int64_t groups = p.heads / p.kv_heads;
  for (int64_t h = g * groups; h < (g + 1) * groups; ++h) {
    const T* const q = static_cast<const T*>(p.q.base) + h * p.q.head;
    T* const out = static_cast<T*>(p.out) + h * d;
    for (int64_t i = 0; i < n; i += kQueries) {
      with_queries(std::min<int64_t>(kQueries, n - i), [&](auto count) {
        constexpr int R = decltype(count)::value;
        for (int r = 0; r < R; ++r) {
          const int64_t token = start + i + r;
          rotated(q + token * p.q.token, p.phases == nullptr ? nullptr : p.phases + token * d, d, p.half,
                  queries + r * d);
        }
        scores<R>(queries, keys, d, n, width, p.scaling, weights);
        for (int r = 0; r < R; ++r) softmax(weights + r * width, width);
        weighted<R>(weights, values, d, n, width, out + (start + i) * p.heads * d, p.heads * d);
      });
    }
  }
}

template <typename T>
void attend_all(const Problem& p, const int64_t* offsets, int64_t sequences, int threads) {
  const int64_t items = sequences * p.kv_heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t s = item / p.kv_heads, g = item % p.kv_heads;
    const int64_t n = offsets[s + 1] - offsets[s];
    if (n > 0) attend_group<T>(p, offsets[s], n, g);
  }
}

}  // namespace

// Sequence s holds tokens [offsets[s], offsets[s + 1]) of the N = offsets[sequences]; its tokens attend each other,
// every key visible. q: token t's query head h at q + t * q_token + h * q_head (k, v likewise, with kv_heads heads,
// query head h reading key/value head h / (heads / kv_heads)); phases (N, d/2, 2) float32, contiguous, or null;
// out (N, heads, d), contiguous. `bf16`: q, k, v and out hold bf16, else float32. `half`: rotation pairs
// (i, i + d/2), else (2i, 2i + 1); `rotate_value`: values rotate too. d: a multiple of 16 (32 with `half`).
extern "C" void few_token_attention(const void* q, int64_t q_token, int64_t q_head, const void* k, int64_t k_token,
                                    int64_t k_head, const void* v, int64_t v_token, int64_t v_head,
                                    const float* phases, void* out, const int64_t* offsets, int64_t sequences,
                                    int64_t heads, int64_t kv_heads, int64_t d, float scaling, int half,
                                    int rotate_value, int bf16, int threads) {
  const Problem p{{q, q_token, q_head}, {k, k_token, k_head}, {v, v_token, v_head}, phases, out, heads, kv_heads, d,
                  scaling, half != 0, rotate_value != 0};
  if (bf16)
    attend_all<uint16_t>(p, offsets, sequences, threads);
  else
    attend_all<float>(p, offsets, sequences, threads);
}
