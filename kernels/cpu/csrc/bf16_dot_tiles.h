// Decode attention scores on bf16 K rows with AVX512-BF16 (paged_attention.cpp's bf16 path): a
// block of keys is transposed by pairs of the head dim, so a 32-bit lane holds one key's two
// neighbouring elements, and `vdpbf16ps` multiplies sixteen keys by a broadcast pair of the
// query and adds both products in fp32. The K rows are read where they lie in the pool (bf16, no
// widened copy), and the transpose moves half the bytes of an fp32 one.
//
// Every score is the same chain of pair products over the head dim whatever the tile it falls
// in, so a row's result never depends on the rows beside it.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SRT_CPU_BF16_DOT 1

#include <immintrin.h>

#include <cstdint>

#include "attention_tiles.h"

namespace srt_cpu {

// A bf16 pair as one 32-bit lane.
typedef uint32_t bf16_pair;

// 16 x 16 32-bit transpose of rows[0..15] (one zmm each): out[i] lane l = rows[l] lane i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Each 128-bit lane q of r[4i + c] now holds element 4q + c of rows 4i..4i+3: gather the four
  // 128-bit lanes of one element from the four row groups.
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88);       // lanes 0, 2 of each
    const __m512i b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);       // lanes 1, 3 of each
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(a, e, 0x88);       // element c      (128-bit lane 0 of every row group)
    t[8 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);   // element 8 + c  (lane 2)
    t[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);   // element 4 + c  (lane 1)
    t[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);  // element 12 + c (lane 3)
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// The block's n key rows (bf16, one kv head each, `dim` a multiple of 32) as pairs transposed
// into kt [dim / 2][kBlockTokens]: kt[p][j] = key j's elements 2p and 2p + 1; zero past n.
inline void transpose_key_pairs(const c10::BFloat16* const* keys, int64_t n, int64_t dim, bf16_pair* kt) {
  const int64_t pairs = dim / 2;
  for (int64_t j0 = 0; j0 < kBlockTokens; j0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i r[16];
      for (int64_t l = 0; l < 16; ++l) {
        r[l] = j0 + l < n ? _mm512_loadu_si512(keys[j0 + l] + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (p0 + i) * kBlockTokens + j0, r[i]);
    }
  }
}

// out[r][0, kBlockTokens) = scale * (q[r] . key j) for R query rows (bf16 pairs, unscaled):
// 2R accumulators (the block's two halves of sixteen keys), each one chain over the pairs.
template <int R>
inline void score_tile_bf16(const bf16_pair* const* q, const bf16_pair* kt, float* const* out, int64_t pairs,
                            float scale) {
  static_assert(kBlockTokens == 32, "two vectors of sixteen keys");
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * kBlockTokens);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * kBlockTokens + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qp);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qp);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[r][0], s));
    _mm512_storeu_ps(out[r] + 16, _mm512_mul_ps(acc[r][1], s));
  }
}

// Scores of `rows` query rows against a pair-transposed block, four rows at a time.
inline void score_rows_bf16(const bf16_pair* const* q, const bf16_pair* kt, float* const* out, int64_t rows,
                            int64_t pairs, float scale) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) score_tile_bf16<4>(q + r, kt, out + r, pairs, scale);
  if (rows - r == 3) score_tile_bf16<3>(q + r, kt, out + r, pairs, scale);
  if (rows - r == 2) score_tile_bf16<2>(q + r, kt, out + r, pairs, scale);
  if (rows - r == 1) score_tile_bf16<1>(q + r, kt, out + r, pairs, scale);
}

}  // namespace srt_cpu

#endif
