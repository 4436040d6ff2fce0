// Register tiles of the CPU decode attention (paged_attention.cpp): scores of up to three query
// rows against four keys, and the probability-weighted sum of value rows into two query rows'
// outputs. Every (query row, key) dot product and every output element is computed in the same
// order whatever the tile it falls in, so a row's result never depends on the rows beside it.
#pragma once

#include "cpu_math.h"

namespace srt_cpu {

// {vsum(a0), vsum(a1), vsum(a2), vsum(a3)}, bit for bit, in vector adds and shuffles: the four
// folded vectors are transposed so that lane c of column i is element i of a_c, and the columns
// added as vsum adds the elements, ((0 + 1) + (2 + 3)).
inline vfloat4 vsum4(vfloat a0, vfloat a1, vfloat a2, vfloat a3) {
  const vfloat4 h0 = fold4(a0), h1 = fold4(a1), h2 = fold4(a2), h3 = fold4(a3);
  const vfloat4 lo01 = __builtin_shufflevector(h0, h1, 0, 4, 1, 5);  // h0[0] h1[0] h0[1] h1[1]
  const vfloat4 hi01 = __builtin_shufflevector(h0, h1, 2, 6, 3, 7);  // h0[2] h1[2] h0[3] h1[3]
  const vfloat4 lo23 = __builtin_shufflevector(h2, h3, 0, 4, 1, 5);
  const vfloat4 hi23 = __builtin_shufflevector(h2, h3, 2, 6, 3, 7);
  const vfloat4 c0 = __builtin_shufflevector(lo01, lo23, 0, 1, 4, 5);  // element 0 of each
  const vfloat4 c1 = __builtin_shufflevector(lo01, lo23, 2, 3, 6, 7);
  const vfloat4 c2 = __builtin_shufflevector(hi01, hi23, 0, 1, 4, 5);
  const vfloat4 c3 = __builtin_shufflevector(hi01, hi23, 2, 3, 6, 7);
  return (c0 + c1) + (c2 + c3);
}

// out[r][j + c] = q[r] . k[c] for R query rows and C keys (C = 4, or 1 for the last keys of a
// block). R x C accumulators: independent FMA chains, each key vector loaded once per R rows.
template <int R, int C>
inline void score_tile(const float* const* q, const float* const* k, float* const* out, int64_t j, int64_t dim) {
  vfloat acc[R][C] = {};
  const int64_t vec_dim = dim / kLanes * kLanes;
  for (int64_t d = 0; d < vec_dim; d += kLanes) {
    vfloat qv[R];
    for (int r = 0; r < R; ++r) qv[r] = vload(q[r] + d);
    for (int c = 0; c < C; ++c) {
      const vfloat kv = vload(k[c] + d);
      for (int r = 0; r < R; ++r) acc[r][c] += qv[r] * kv;
    }
  }
  for (int r = 0; r < R; ++r) {
    float dots[C];
    if constexpr (C == 4) {
      const vfloat4 s = vsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
      std::memcpy(dots, &s, sizeof(dots));
    } else {
      for (int c = 0; c < C; ++c) dots[c] = vsum(acc[r][c]);
    }
    for (int c = 0; c < C; ++c) {
      for (int64_t d = vec_dim; d < dim; ++d) dots[c] += q[r][d] * k[c][d];
      out[r][j + c] = dots[c];
    }
  }
}

// Scores of `rows` query rows against keys [0, n), three rows and four keys at a time.
inline void score_rows(const float* const* q, const float* const* k, float* const* out, int64_t rows, int64_t n,
                       int64_t dim) {
  int64_t r = 0;
  auto keys = [&](auto tile4, auto tile1) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) tile4(q + r, k + j, out + r, j, dim);
    for (; j < n; ++j) tile1(q + r, k + j, out + r, j, dim);
  };
  for (; r + 3 <= rows; r += 3) keys(score_tile<3, 4>, score_tile<3, 1>);
  for (; r + 2 <= rows; r += 2) keys(score_tile<2, 4>, score_tile<2, 1>);
  for (; r < rows; ++r) keys(score_tile<1, 4>, score_tile<1, 1>);
}

// acc[r][d0, d0 + V * kLanes) += sum_j p[r][j] * v[j][...] for R rows: R x V accumulators kept
// in registers across the keys, each value vector loaded once per R rows.
template <int R, int V>
inline void value_tile(const float* const* p, const float* const* v, float* const* acc, int64_t n, int64_t d0) {
  vfloat a[R][V];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) a[r][c] = vload(acc[r] + d0 + c * kLanes);
  for (int64_t j = 0; j < n; ++j) {
    vfloat vv[V];
    for (int c = 0; c < V; ++c) vv[c] = vload(v[j] + d0 + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const vfloat pj = vbroadcast(p[r][j]);
      for (int c = 0; c < V; ++c) a[r][c] += pj * vv[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < V; ++c) vstore(acc[r] + d0 + c * kLanes, a[r][c]);
}

// acc[r] += sum_j p[r][j] * v[j] for `rows` rows over keys [0, n): two rows and four vectors of
// the head dim at a time, then single vectors, then a scalar tail.
template <int R>
inline void value_rows_of(const float* const* p, const float* const* v, float* const* acc, int64_t n, int64_t dim) {
  int64_t d0 = 0;
  for (; d0 + 4 * kLanes <= dim; d0 += 4 * kLanes) value_tile<R, 4>(p, v, acc, n, d0);
  for (; d0 + kLanes <= dim; d0 += kLanes) value_tile<R, 1>(p, v, acc, n, d0);
  for (; d0 < dim; ++d0) {
    for (int r = 0; r < R; ++r) {
      float a = acc[r][d0];
      for (int64_t j = 0; j < n; ++j) a += p[r][j] * v[j][d0];
      acc[r][d0] = a;
    }
  }
}

inline void value_rows(const float* const* p, const float* const* v, float* const* acc, int64_t rows, int64_t n,
                       int64_t dim) {
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) value_rows_of<2>(p + r, v, acc + r, n, dim);
  for (; r < rows; ++r) value_rows_of<1>(p + r, v, acc + r, n, dim);
}

}  // namespace srt_cpu
