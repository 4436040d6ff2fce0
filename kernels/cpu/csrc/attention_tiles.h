// Register tiles of the CPU decode and extend attention (paged_attention.cpp,
// extend_attention.cpp): a block of keys transposed so that keys are lanes, query rows scored
// against it, and the probability-weighted sum of value rows into the query rows' outputs. Every
// (query row, key) score and every output element is computed in the same order whatever the
// tile it falls in, so a row's result never depends on the rows beside it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_math.h"

namespace srt_cpu {

// Keys scored together before one rescale of the running outputs (both ops).
constexpr int64_t kBlockTokens = 32;
constexpr int64_t kKeyVectors = kBlockTokens / kLanes;
static_assert(kBlockTokens % kLanes == 0 && kBlockTokens % 8 == 0, "a block's scores are whole vectors");

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v8 load8(const c10::BFloat16* p) {
  typedef uint16_t h8 __attribute__((vector_size(8 * sizeof(uint16_t))));
  typedef uint32_t u8 __attribute__((vector_size(8 * sizeof(uint32_t))));
  h8 bits;
  std::memcpy(&bits, p, sizeof(bits));
  const u8 wide = __builtin_convertvector(bits, u8) << 16;  // bf16 is the upper half of an fp32
  v8 v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

// Elements [d, d + 8) of eight key rows, transposed: out[i * kBlockTokens + c] = src[c][d + i].
template <typename kv_t>
inline void transpose8(const kv_t* const* src, int64_t d, float* out) {
  v8 r[8];
  for (int i = 0; i < 8; ++i) r[i] = load8(src[i] + d);
  v8 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    const v8 &lo0 = t[4 * i], &hi0 = t[4 * i + 1], &lo1 = t[4 * i + 2], &hi1 = t[4 * i + 3];
    u[4 * i] = __builtin_shufflevector(lo0, lo1, 0, 1, 8, 9, 4, 5, 12, 13);
    u[4 * i + 1] = __builtin_shufflevector(lo0, lo1, 2, 3, 10, 11, 6, 7, 14, 15);
    u[4 * i + 2] = __builtin_shufflevector(hi0, hi1, 0, 1, 8, 9, 4, 5, 12, 13);
    u[4 * i + 3] = __builtin_shufflevector(hi0, hi1, 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int e = 0; e < 4; ++e) {
    const v8 low = __builtin_shufflevector(u[e], u[4 + e], 0, 1, 2, 3, 8, 9, 10, 11);
    const v8 high = __builtin_shufflevector(u[e], u[4 + e], 4, 5, 6, 7, 12, 13, 14, 15);
    std::memcpy(out + e * kBlockTokens, &low, sizeof(low));
    std::memcpy(out + (e + 4) * kBlockTokens, &high, sizeof(high));
  }
}

// The block's n key rows (one kv head each) transposed into kt [dim][kBlockTokens], fp32, zero
// past the n keys: a key is then a lane, and scoring needs no horizontal sums.
template <typename kv_t>
inline void transpose_keys(const kv_t* const* keys, int64_t n, int64_t dim, float* kt) {
  const int64_t whole_keys = n / 8 * 8, whole_dims = dim / 8 * 8;
  for (int64_t j = 0; j < whole_keys; j += 8) {
    for (int64_t d = 0; d < whole_dims; d += 8) transpose8(keys + j, d, kt + d * kBlockTokens + j);
    for (int64_t d = whole_dims; d < dim; ++d)
      for (int i = 0; i < 8; ++i) kt[d * kBlockTokens + j + i] = to_float(keys[j + i][d]);
  }
  for (int64_t j = whole_keys; j < n; ++j)
    for (int64_t d = 0; d < dim; ++d) kt[d * kBlockTokens + j] = to_float(keys[j][d]);
  if (n < kBlockTokens) {
    for (int64_t d = 0; d < dim; ++d) std::fill(kt + d * kBlockTokens + n, kt + (d + 1) * kBlockTokens, 0.0f);
  }
}

// out[r][c0 * kLanes, (c0 + C) * kLanes) = q[r] . kt[:, j] for R query rows: R x C accumulators
// stay in registers over the head dim; each step loads C key vectors and broadcasts R query
// elements. Every score is one FMA chain over d = 0, 1, ..., so it has the same bits in every
// tile shape: a row's result never depends on the rows beside it.
template <int R, int C>
inline void score_tile(const float* const* q, const float* kt, float* const* out, int64_t c0, int64_t dim) {
  vfloat acc[R][C] = {};
  for (int64_t d = 0; d < dim; ++d) {
    vfloat kv[C];
    for (int c = 0; c < C; ++c) kv[c] = vload(kt + d * kBlockTokens + (c0 + c) * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vfloat qd = vbroadcast(q[r][d]);
      for (int c = 0; c < C; ++c) acc[r][c] += qd * kv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) vstore(out[r] + (c0 + c) * kLanes, acc[r][c]);
}

// Scores of `rows` query rows against a transposed block (all kBlockTokens lanes; lanes past
// the block's keys score 0): 12 rows x 2 key vectors where vectors have 16 lanes (24 of the 32
// registers), then 6 rows x 2 (12 accumulators, the shape of an AVX2 GEMM micro-kernel), the
// rows left over 3 or fewer at a time against every key vector.
inline void score_rows(const float* const* q, const float* kt, float* const* out, int64_t rows, int64_t dim) {
  constexpr int C = kKeyVectors >= 2 ? 2 : 1;
  static_assert(kKeyVectors % C == 0, "whole tiles of key vectors");
  int64_t r = 0;
  if constexpr (kLanes == 16) {
    for (; r + 12 <= rows; r += 12)
      for (int64_t c0 = 0; c0 < kKeyVectors; c0 += C) score_tile<12, C>(q + r, kt, out + r, c0, dim);
  }
  for (; r + 6 <= rows; r += 6)
    for (int64_t c0 = 0; c0 < kKeyVectors; c0 += C) score_tile<6, C>(q + r, kt, out + r, c0, dim);
  constexpr int All = kKeyVectors > 4 ? 4 : static_cast<int>(kKeyVectors);
  auto rest = [&](auto tile, int64_t height) {
    for (int64_t c0 = 0; c0 < kKeyVectors; c0 += All) tile(q + r, kt, out + r, c0, dim);
    r += height;
  };
  if (rows - r >= 3) rest(score_tile<3, All>, 3);
  if (rows - r == 2) rest(score_tile<2, All>, 2);
  if (rows - r == 1) rest(score_tile<1, All>, 1);
}

#if defined(__AVX512F__)
#define SRT_CPU_DIRECT_SCORES 1
constexpr int64_t kDirectScoreDim = 16;  // score_rows_direct's head dim: whole vectors
constexpr bool kDirectScoresBf16 = true;  // also for bf16 K rows (widened as they are read)

// Scores of `rows` query rows against the block's n key rows where they lie in the pool: no
// transposed copy of the block, which cost several times the products themselves when a kv
// head has only a few query rows (decode). Per row and sixteen keys: sixteen independent FMA
// chains over the head dim's vectors (one per key, so the chains overlap in the pipeline), then
// sum_lanes16. Lanes past n score 0. `dim` a multiple of 16.
template <typename kv_t>
inline void score_rows_direct(const float* const* q, const kv_t* const* keys, float* const* out, int64_t rows,
                              int64_t n, int64_t dim) {
  static_assert(kBlockTokens % 16 == 0, "whole groups of sixteen keys");
  for (int64_t j0 = 0; j0 < kBlockTokens; j0 += 16) {
    if (j0 >= n) {
      for (int64_t r = 0; r < rows; ++r) _mm512_storeu_ps(out[r] + j0, _mm512_setzero_ps());
      continue;
    }
    // Key i of the chains is lane 4 * (i % 4) + i / 4 of sum_lanes16's result; a key past n
    // reads key 0's row (any valid row) and its lane is cleared below.
    const kv_t* k[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t j = j0 + 4 * (i % 4) + i / 4;
      k[i] = keys[j < n ? j : 0];
    }
    const __mmask16 valid = n - j0 >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - j0)) - 1);
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q[r];
      __m512 a[16];
      const __m512 q0 = _mm512_loadu_ps(qr);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) a[i] = _mm512_mul_ps(q0, (__m512)vload(k[i]));
      for (int64_t d = 16; d < dim; d += 16) {
        const __m512 qd = _mm512_loadu_ps(qr + d);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(qd, (__m512)vload(k[i] + d), a[i]);
      }
      _mm512_storeu_ps(out[r] + j0, _mm512_maskz_mov_ps(valid, sum_lanes16(a)));
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SRT_CPU_DIRECT_SCORES 1
constexpr int64_t kDirectScoreDim = 8;
// bf16 K rows too, through score_keys4: each K vector is widened once for three query rows. (One
// widening per query row, as in the fp32 form, made the op 1.6x slower than the transposed block
// with a shared prefix's query rows, 16 requests x 2.) Either way the choice must not depend on
// the rows of a task, so that a request's bits do not depend on the requests that share its prefix.
constexpr bool kDirectScoresBf16 = true;

// Lane i = the sum of a[i]'s eight lanes (three rounds of pairwise adds, the same for every row).
inline __m256 sum_lanes8(const __m256 a[8]) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  // Lanes 0-3: the sums of a[0..3]'s (h0123) or a[4..7]'s (h4567) low halves, lanes 4-7 of their high halves.
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// R <= 3 query rows against four bf16 keys k[0..3] (scores to out[r][j, j + 4)): each K vector
// widened once for the R rows, 4 x R accumulators. A score's lane l sums q[d] * k[d] over the
// head dim's d = l (mod 8) in order, then the lanes are added as sum_lanes8 adds them: the same
// bits whatever R and whatever keys or rows are beside it.
template <int R>
inline void score_keys4(const float* const* q, const c10::BFloat16* const* k, float* const* out, int64_t j,
                        int64_t dim) {
  __m256 a[R][4];
  for (int64_t d = 0; d < dim; d += 8) {
    __m256 kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = (__m256)vload(k[i] + d);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 qd = _mm256_loadu_ps(q[r] + d);
      for (int i = 0; i < 4; ++i) a[r][i] = d == 0 ? _mm256_mul_ps(qd, kv[i]) : _mm256_fmadd_ps(qd, kv[i], a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
    _mm_storeu_ps(out[r] + j, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
}

// bf16 K rows: four keys at a time, the query rows three at a time. On the Zen 3 (AVX2) with
// SmolLM2's shapes (3 query rows a kv head), the op against the transposed block: 1.22-1.31x at
// 16 x 410 tokens, 1.08-1.11x with two groups of 8 requests sharing their first 346 slots.
inline void score_rows_direct(const float* const* q, const c10::BFloat16* const* keys, float* const* out,
                              int64_t rows, int64_t n, int64_t dim) {
  static_assert(kBlockTokens % 4 == 0, "whole groups of four keys");
  for (int64_t j = 0; j < kBlockTokens; j += 4) {
    if (j >= n) {
      for (int64_t r = 0; r < rows; ++r) _mm_storeu_ps(out[r] + j, _mm_setzero_ps());
      continue;
    }
    const c10::BFloat16* k[4];
    for (int i = 0; i < 4; ++i) k[i] = keys[j + i < n ? j + i : 0];  // past n: any valid row, cleared below
    int64_t r = 0;
    for (; r + 3 <= rows; r += 3) score_keys4<3>(q + r, k, out + r, j, dim);
    if (rows - r == 2) score_keys4<2>(q + r, k, out + r, j, dim);
    if (rows - r == 1) score_keys4<1>(q + r, k, out + r, j, dim);
    for (int64_t row = 0; n - j < 4 && row < rows; ++row) std::fill(out[row] + n, out[row] + j + 4, 0.0f);
  }
}

// AVX2 form of the above for fp32 K rows: per row and eight keys, eight independent FMA chains
// over the head dim's 8-lane vectors, then sum_lanes8 (the same bits as score_keys4's). Where a
// kv head has two query rows (decode), the transposed copy of each block cost more than the
// products; score_keys4's shape was 0.96-0.98x this one for fp32. Lanes past n score 0. `dim` a
// multiple of 8.
inline void score_rows_direct(const float* const* q, const float* const* keys, float* const* out, int64_t rows,
                              int64_t n, int64_t dim) {
  static_assert(kBlockTokens % 8 == 0, "whole groups of eight keys");
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j0 = 0; j0 < kBlockTokens; j0 += 8) {
    if (j0 >= n) {
      for (int64_t r = 0; r < rows; ++r) _mm256_storeu_ps(out[r] + j0, _mm256_setzero_ps());
      continue;
    }
    const float* k[8];
    for (int i = 0; i < 8; ++i) k[i] = keys[j0 + i < n ? j0 + i : 0];  // past n: any valid row, cleared below
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j0)), lane));
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q[r];
      __m256 a[8];
      const __m256 q0 = _mm256_loadu_ps(qr);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(q0, (__m256)vload(k[i]));
      for (int64_t d = 8; d < dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(qr + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qd, (__m256)vload(k[i] + d), a[i]);
      }
      _mm256_storeu_ps(out[r] + j0, _mm256_and_ps(valid, sum_lanes8(a)));
    }
  }
}
#endif

// Online softmax of one row over a block whose first `limit` keys it may see: fold them into
// the running max and sum, rescale the running output, leave the probabilities in the scores
// (zero for the keys it may not see).
inline void softmax_block(float* sc, float* acc, float& row_max, float& row_sum, int64_t limit, int64_t dim) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  if (limit < kBlockTokens) std::fill(sc + limit, sc + kBlockTokens, minus_inf);
  vfloat top = vload(sc);
  for (int64_t c = 1; c < kKeyVectors; ++c) {
    const vfloat x = vload(sc + c * kLanes);
    top = x > top ? x : top;
  }
  const float block_max = vmax(top);
  const float new_max = std::max(row_max, block_max);
  const float alpha = std::exp(row_max - new_max);  // 0 on the first block (max is -inf)
  const vfloat shift = vbroadcast(new_max);
  vfloat total{};
  for (int64_t c = 0; c < kKeyVectors; ++c) {
    vfloat p = vexp(vload(sc + c * kLanes) - shift);
    if (c * kLanes + kLanes > limit) {
      // vexp clamps its input, so a key the row may not see gets e^-87, not 0: zero it.
      for (int64_t l = std::max<int64_t>(0, limit - c * kLanes); l < kLanes; ++l) p[l] = 0.0f;
    }
    vstore(sc + c * kLanes, p);
    total += p;
  }
  row_sum = row_sum * alpha + vsum(total);
  row_max = new_max;
  if (alpha != 1.0f) {
    const vfloat a = vbroadcast(alpha);
    int64_t d = 0;
    for (; d + kLanes <= dim; d += kLanes) vstore(acc + d, vload(acc + d) * a);
    for (; d < dim; ++d) acc[d] *= alpha;
  }
}

// acc[r][d0, d0 + V * kLanes) += sum_j p[r][j] * v[j][...] for R rows: R x V accumulators kept
// in registers across the keys, each value vector loaded (bf16 rows: widened) once per R rows.
template <int R, int V, typename v_t>
inline void value_tile(const float* const* p, const v_t* const* v, float* const* acc, int64_t n, int64_t d0) {
  vfloat a[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) a[r][c] = vload(acc[r] + d0 + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    vfloat vv[V];
    for (int c = 0; c < V; ++c) vv[c] = vload(v[j] + d0 + c * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vfloat pj = vbroadcast(p[r][j]);
      for (int c = 0; c < V; ++c) a[r][c] += pj * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) vstore(acc[r] + d0 + c * kLanes, a[r][c]);
}

// acc[r] += sum_j p[r][j] * v[j] for `rows` rows over keys [0, n): R rows and four vectors of
// the head dim at a time, then single vectors, then a scalar tail.
template <int R, typename v_t>
inline void value_rows_of(const float* const* p, const v_t* const* v, float* const* acc, int64_t n, int64_t dim) {
  // Vectors of the head dim per tile: four, or two where R x 4 accumulators, four values and a
  // broadcast would not fit AVX2's 16 registers.
  constexpr int W = kLanes == 8 && R * 4 + 5 > 16 ? 2 : 4;
  int64_t d0 = 0;
  for (; d0 + W * kLanes <= dim; d0 += W * kLanes) value_tile<R, W, v_t>(p, v, acc, n, d0);
  for (; d0 + kLanes <= dim; d0 += kLanes) value_tile<R, 1, v_t>(p, v, acc, n, d0);
  for (; d0 < dim; ++d0) {
    for (int r = 0; r < R; ++r) {
      float a = acc[r][d0];
      for (int64_t j = 0; j < n; ++j) a += p[r][j] * to_float(v[j][d0]);
      acc[r][d0] = a;
    }
  }
}

template <typename v_t>
inline void value_rows(const float* const* p, const v_t* const* v, float* const* acc, int64_t rows, int64_t n,
                       int64_t dim) {
  int64_t r = 0;
  if constexpr (kLanes == 16) {  // 4 x 4 accumulators: each value vector loaded once per 4 rows
    for (; r + 4 <= rows; r += 4) value_rows_of<4>(p + r, v, acc + r, n, dim);
  }
  if constexpr (kLanes == 8) {  // a group of three (SmolLM2): the op 1.13-1.16x with bf16 V, 1.03x fp32
    for (; r + 3 <= rows; r += 3) value_rows_of<3>(p + r, v, acc + r, n, dim);
  }
  for (; r + 2 <= rows; r += 2) value_rows_of<2>(p + r, v, acc + r, n, dim);
  for (; r < rows; ++r) value_rows_of<1>(p + r, v, acc + r, n, dim);
}

}  // namespace srt_cpu
