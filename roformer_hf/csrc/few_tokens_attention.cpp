// Attention of sequences of few tokens, rotation included, built for AVX-512F (16 floats a vector) or for AVX2 and
// FMA (8): `roformer_hf/few_rows.py` builds it and `few_rows.attention` calls it (a short input's self-attention in
// CPU inference).
//
// For one sentence of 16 tokens a layer's attention is a few hundred thousand multiply-adds: far less work than the
// calls of PyTorch's operators around it (two rotations, SDPA and its reshapes) take to dispatch. Here one call does
// it all for every sequence and head: each key/value head's keys are rotated once and laid out transposed (each
// head dimension's row holds the sequence's keys, a vector's lanes of keys at a time), its values rotated where the
// model rotates them; then for each query of each of its query heads (four queries at once), the rotated query
// against the keys gives a vector of scores at a time, their softmax (in float32, max subtracted), and the weighted
// values, summed in order of the keys. Queries, keys, values and the context are float32 or bf16 (converted on load,
// rounded to nearest even on store); everything between is float32. The (sequence, key/value head) pairs are shared
// out among torch's threads.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include "gelu_avx512.h"  // exp_nonpositive
#else
#include "gelu_avx2.h"  // exp_nonpositive
#endif

namespace {

// The vector operations the kernel is written in, for the instruction set it is built for.
#ifdef __AVX512F__
using V = __m512;
constexpr int kLanes = 16;
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline V load(const uint16_t* p) {  // bf16: the upper half of a float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
inline void store(uint16_t* p, V x) {  // to nearest, ties to even; NaN stays a (quiet) NaN
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
}
inline V zero() { return _mm512_setzero_ps(); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V fmsub(V a, V b, V c) { return _mm512_fmsub_ps(a, b, c); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline float reduce_max(V x) { return _mm512_reduce_max_ps(x); }
inline float reduce_add(V x) { return _mm512_reduce_add_ps(x); }
inline V exp_nonpositive(V y) { return roformer_hf::exp_nonpositive(y); }  // 0 at -inf
// `x`, with -inf in the lanes from `count` on.
inline V first_lanes(V x, int64_t count) {
  return count >= kLanes ? x : _mm512_mask_blend_ps(__mmask16((1u << count) - 1), set1(-INFINITY), x);
}
// Each pair (a, b) of `x` turned by its (cos, sin) in `turn`, both interleaved: (a cos - b sin, a sin + b cos).
inline V turned_pairs(V x, V turn) {
  return _mm512_fmaddsub_ps(x, _mm512_moveldup_ps(turn), mul(_mm512_permute_ps(x, 0xB1), _mm512_movehdup_ps(turn)));
}
// The cos and the sin of `kLanes` pairs, from their 2 * kLanes phases (cos, sin) side by side.
inline void cos_sin(const float* phases, V& cos, V& sin) {
  const V low = load(phases), high = load(phases + kLanes);
  cos = _mm512_permutex2var_ps(low, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), high);
  sin = _mm512_permutex2var_ps(low, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), high);
}
// The kLanes x kLanes floats of `r` transposed: lane l of vector m becomes lane m of vector l.
inline void transpose(V r[kLanes]) {
  V t[kLanes];
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
#else
using V = __m256;
constexpr int kLanes = 8;
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline V load(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
inline void store(uint16_t* p, V x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
                                                 _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                                                 _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline V zero() { return _mm256_setzero_ps(); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V fmsub(V a, V b, V c) { return _mm256_fmsub_ps(a, b, c); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline float reduce_max(V x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_permute_ps(m, 0x4E));
  return _mm_cvtss_f32(_mm_max_ps(m, _mm_permute_ps(m, 0xB1)));
}
inline float reduce_add(V x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_permute_ps(s, 0x4E));
  return _mm_cvtss_f32(_mm_add_ps(s, _mm_permute_ps(s, 0xB1)));
}
inline V exp_nonpositive(V y) { return roformer_hf::exp_nonpositive(y); }  // 0 below -87.3
inline V first_lanes(V x, int64_t count) {
  if (count >= kLanes) return x;
  const V lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_blendv_ps(set1(-INFINITY), x, _mm256_cmp_ps(lane, set1(static_cast<float>(count)), _CMP_LT_OQ));
}
inline V turned_pairs(V x, V turn) {
  return _mm256_fmaddsub_ps(x, _mm256_moveldup_ps(turn), mul(_mm256_permute_ps(x, 0xB1), _mm256_movehdup_ps(turn)));
}
inline void cos_sin(const float* phases, V& cos, V& sin) {
  const V low = load(phases), high = load(phases + kLanes);
  // per 128-bit half: (c0 c1 c4 c5 | c2 c3 c6 c7), then the 64-bit pairs in order
  const auto ordered = [](V x) { return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(x), 0xD8)); };
  cos = ordered(_mm256_shuffle_ps(low, high, _MM_SHUFFLE(2, 0, 2, 0)));
  sin = ordered(_mm256_shuffle_ps(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}
inline void transpose(V r[kLanes]) {
  V t[kLanes], u[kLanes];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}
#endif

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

// One token's head vector `x` (d entries) rotated by the token's `phases` (d/2 pairs of cos, sin), as float32 into
// `y`: each pair (a, b) becomes (a cos - b sin, a sin + b cos). Without phases, `x` as it is.
template <typename T>
inline void rotated(const T* x, const float* phases, int64_t d, bool half, float* y) {
  if (phases == nullptr) {
    for (int64_t c = 0; c < d; c += kLanes) store(y + c, load(x + c));
  } else if (!half) {  // pairs side by side, as the phases' (cos, sin)
    for (int64_t c = 0; c < d; c += kLanes) store(y + c, turned_pairs(load(x + c), load(phases + c)));
  } else {  // pair i is (x[i], x[i + d/2])
    const int64_t h = d / 2;
    for (int64_t c = 0; c < h; c += kLanes) {
      V cos, sin;
      cos_sin(phases + 2 * c, cos, sin);
      const V a = load(x + c), b = load(x + h + c);
      store(y + c, fmsub(a, cos, mul(b, sin)));
      store(y + h + c, fmadd(a, sin, mul(b, cos)));
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

// The scaled scores of R rotated queries (R, d) against the keys (d, width), a vector of keys at a time, into rows
// of `weights` (R, width); the lanes past the n keys -inf. Each query's sums run in two interleaved runs over the
// head dimensions (even and odd), added at the end.
template <int R>
inline void scores(const float* queries, const float* keys, int64_t d, int64_t n, int64_t width, float scaling,
                   float* weights) {
  int64_t b = 0;
#ifndef __AVX512F__
  // With 16 registers, two vectors of keys at a time, one run of sums each: each broadcast query entry serves two
  // products, where one vector's two runs would take a load for every product.
  for (; b + 2 * kLanes <= width; b += 2 * kLanes) {
    V low[R], high[R];
    for (int r = 0; r < R; ++r) low[r] = high[r] = zero();
    for (int64_t t = 0; t < d; ++t) {
      const V k0 = load(keys + t * width + b), k1 = load(keys + t * width + b + kLanes);
      for (int r = 0; r < R; ++r) {
        const V q = set1(queries[r * d + t]);
        low[r] = fmadd(q, k0, low[r]);
        high[r] = fmadd(q, k1, high[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      store(weights + r * width + b, first_lanes(mul(low[r], set1(scaling)), n - b));
      store(weights + r * width + b + kLanes, first_lanes(mul(high[r], set1(scaling)), n - b - kLanes));
    }
  }
#endif
  for (; b < width; b += kLanes) {
    V even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = zero();
    for (int64_t t = 0; t < d; t += 2) {
      const V k0 = load(keys + t * width + b), k1 = load(keys + (t + 1) * width + b);
      for (int r = 0; r < R; ++r) {
        even[r] = fmadd(set1(queries[r * d + t]), k0, even[r]);
        odd[r] = fmadd(set1(queries[r * d + t + 1]), k1, odd[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      store(weights + r * width + b, first_lanes(mul(add(even[r], odd[r]), set1(scaling)), n - b));
  }
}

// A row of scores (width) into the softmax's weights: exp(score - max) over their sum, 0 past the keys.
inline void softmax(float* row, int64_t width) {
  V largest = set1(-INFINITY);
  for (int64_t b = 0; b < width; b += kLanes) largest = max(largest, load(row + b));
  const V top = set1(reduce_max(largest));
  V total = zero();
  for (int64_t b = 0; b < width; b += kLanes) {
    const V e = exp_nonpositive(sub(load(row + b), top));
    total = add(total, e);
    store(row + b, e);
  }
  const V inverse = set1(1.0f / reduce_add(total));
  for (int64_t b = 0; b < width; b += kLanes) store(row + b, mul(load(row + b), inverse));
}

// The vectors of head dimensions `weighted` sums at once: R x kBlock sums, kBlock values and a broadcast weight fit
// the registers (32 with AVX-512, 16 with AVX2).
constexpr int kBlock = kLanes == 16 ? 4 : 2;

// R rows of weights (R, width) times the values (n, d), summed in order of the keys, into R rows of `out` (a row
// every `stride` elements), kBlock vectors of dimensions at a time, then one.
template <int R, typename T>
inline void weighted(const float* weights, const float* values, int64_t d, int64_t n, int64_t width, T* out,
                     int64_t stride) {
  int64_t c = 0;
  for (; c + kBlock * kLanes <= d; c += kBlock * kLanes) {
    V sums[R][kBlock];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < kBlock; ++u) sums[r][u] = zero();
    for (int64_t j = 0; j < n; ++j) {
      const float* value = values + j * d + c;
      V v[kBlock];
      for (int u = 0; u < kBlock; ++u) v[u] = load(value + u * kLanes);
      for (int r = 0; r < R; ++r) {
        const V w = set1(weights[r * width + j]);
        for (int u = 0; u < kBlock; ++u) sums[r][u] = fmadd(w, v[u], sums[r][u]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < kBlock; ++u) store(out + r * stride + c + u * kLanes, sums[r][u]);
  }
  for (; c < d; c += kLanes) {
    V sums[R];
    for (int r = 0; r < R; ++r) sums[r] = zero();
    for (int64_t j = 0; j < n; ++j) {
      const V v = load(values + j * d + c);
      for (int r = 0; r < R; ++r) sums[r] = fmadd(set1(weights[r * width + j]), v, sums[r]);
    }
    for (int r = 0; r < R; ++r) store(out + r * stride + c, sums[r]);
  }
}

// What a thread keeps between calls: its sequence's keys and values, queries, rows of weights.
std::vector<float>& scratch(size_t size) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer;
}

// The tokens [start, start + n) of one sequence attend each other through key/value head g and its query heads.
template <typename T>
void attend_group(const Problem& p, int64_t start, int64_t n, int64_t g) {
  const int64_t d = p.d, width = (n + kLanes - 1) / kLanes * kLanes;  // keys in whole vectors
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
  for (int64_t b = 0; b < width; b += kLanes)
    for (int64_t c = 0; c < d; c += kLanes) {
      V block[kLanes];
      for (int j = 0; j < kLanes; ++j) block[j] = load(rows + (b + j) * d + c);
      transpose(block);
      for (int t = 0; t < kLanes; ++t) store(keys + (c + t) * width + b, block[t]);
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

// The floats a vector of this build holds: the head size must be a multiple of it (of twice it, rotating halves).
extern "C" int few_token_lanes() { return kLanes; }

// Sequence s holds tokens [offsets[s], offsets[s + 1]) of the N = offsets[sequences]; its tokens attend each other,
// every key visible. q: token t's query head h at q + t * q_token + h * q_head (k, v likewise, with kv_heads heads,
// query head h reading key/value head h / (heads / kv_heads)); phases (N, d/2, 2) float32, contiguous, or null;
// out (N, heads, d), contiguous. `bf16`: q, k, v and out hold bf16, else float32. `half`: rotation pairs
// (i, i + d/2), else (2i, 2i + 1); `rotate_value`: values rotate too.
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
