// fp32 linear layers at decode sizes over the dense row-major weight [N, K] (the checkpoint's own
// layout), for AVX-512 CPUs where oneDNN's packed fp32 matmuls of a few rows spend most of their
// time outside the arithmetic (README, "Dense fp32 linears"). Prefill-sized inputs go to BLAS on
// the same dense weight (srt/layers/cpu_weight_packing.py), so one copy of each weight serves both.
//
// Every output is a dot product of an x row and a weight row, both contiguous. A tile takes four
// x rows and four weight rows: sixteen FMA chains (one per output) over K in vectors of sixteen,
// eight loads per sixteen FMAs, then sum_lanes16 turns the sixteen lane vectors into the tile's
// sixteen outputs. A task owns a run of whole weight rows, so each thread reads its part of the
// weight once, front to back; the x row tiles after the first read the four weight rows from L1.
// The split is static (one contiguous share per thread): handing out 16-row tasks one at a time
// interleaved the threads' reads, and a llama-26m decode step took 18-22 ms against 14.6-14.8.
// An output goes through the same operations whatever rows or columns share its tile (missing
// rows and columns of a tile repeat a valid one and are not stored), so a row's result does not
// depend on the batch around it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "cpu_math.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t kTile = 4;          // x rows and weight rows per tile
constexpr int64_t kBlocksPerTask = 8;  // at::parallel_for's grain: at least this many row blocks a thread
constexpr int64_t kPrefetchBlocks = 2;  // the first row tile of a block prefetches the block this far ahead

// The tile's sixteen dot products over K: lane 4 * r + c of the result is x row r . weight row c.
template <bool kPrefetch>
inline __m512 dot_tile(const float* const xr[kTile], const float* const wr[kTile], int64_t K) {
  __m512 a[16];  // a[4 * c + r]: sum_lanes16 puts it in lane 4 * r + c
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 w[kTile], x[kTile];
    if constexpr (kPrefetch) {  // the next block's rows (the next kTile * K weights), a line per row and step
#pragma GCC unroll 4
      for (int c = 0; c < kTile; ++c) _mm_prefetch(reinterpret_cast<const char*>(wr[c] + kPrefetchBlocks * kTile * K + k), _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int c = 0; c < kTile; ++c) w[c] = _mm512_loadu_ps(wr[c] + k);
#pragma GCC unroll 4
    for (int r = 0; r < kTile; ++r) x[r] = _mm512_loadu_ps(xr[r] + k);
#pragma GCC unroll 4
    for (int c = 0; c < kTile; ++c) {
#pragma GCC unroll 4
      for (int r = 0; r < kTile; ++r) a[4 * c + r] = _mm512_fmadd_ps(x[r], w[c], a[4 * c + r]);
    }
  }
  if (k < K) {  // the last K % 16 features; the lanes past K load as zeros
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 w[kTile], x[kTile];
    for (int c = 0; c < kTile; ++c) w[c] = _mm512_maskz_loadu_ps(tail, wr[c] + k);
    for (int r = 0; r < kTile; ++r) x[r] = _mm512_maskz_loadu_ps(tail, xr[r] + k);
#pragma GCC unroll 4
    for (int c = 0; c < kTile; ++c) {
#pragma GCC unroll 4
      for (int r = 0; r < kTile; ++r) a[4 * c + r] = _mm512_fmadd_ps(x[r], w[c], a[4 * c + r]);
    }
  }
  return srt_cpu::sum_lanes16(a);
}

// y rows [0, M), columns [n0, n0 + cols) of one weight row block.
inline void row_block(const float* x, int64_t M, int64_t K, const float* w, int64_t n0, int64_t cols,
                      const float* bias, float* y, int64_t N) {
  const float* wr[kTile];
  for (int64_t c = 0; c < kTile; ++c) wr[c] = w + (n0 + (c < cols ? c : 0)) * K;
  float add[16] = {};
  if (bias != nullptr) {
    for (int64_t i = 0; i < 16; ++i) add[i] = bias[n0 + std::min(i % kTile, cols - 1)];
  }
  const __m512 b = _mm512_loadu_ps(add);
  for (int64_t m0 = 0; m0 < M; m0 += kTile) {
    const int64_t rows = std::min(kTile, M - m0);
    const float* xr[kTile];
    for (int64_t r = 0; r < kTile; ++r) xr[r] = x + (m0 + (r < rows ? r : 0)) * K;
    float out[16];
    __m512 s = m0 == 0 ? dot_tile<true>(xr, wr, K) : dot_tile<false>(xr, wr, K);
    if (bias != nullptr) s = _mm512_add_ps(s, b);
    if (cols == kTile) {
      for (int64_t r = 0; r < rows; ++r) _mm_storeu_ps(y + (m0 + r) * N + n0, _mm512_castps512_ps128(
          _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * r), _mm512_set_epi32(
              15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)), s)));
      continue;
    }
    _mm512_storeu_ps(out, s);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) y[(m0 + r) * N + n0 + c] = out[r * kTile + c];
    }
  }
}
#endif

bool dense_linear_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(dense_linear_available(), "dense_linear: this build has no AVX-512 (use torch's linear)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "dense_linear: x must be an fp32 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "dense_linear: weight must be a contiguous fp32 [N, K], got ", weight.scalar_type(), " ",
              weight.sizes(), weight.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(x.size(1) == weight.size(1), "dense_linear: x has ", x.size(1), " features, the weight ",
              weight.size(1));
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "dense_linear: CPU tensors only, got x on ",
              x.device(), " and the weight on ", weight.device());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->scalar_type() == at::kFloat,
                "dense_linear: bias must be fp32 with ", N, " values, got ", bias->scalar_type(), " with ",
                bias->numel());
    b = bias->contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(b.expand({M, N})) : y.zero_();
  const at::Tensor xc = x.contiguous();
  const float* xa = xc.data_ptr<float>();
  const float* wa = weight.data_ptr<float>();
  const float* ba = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* ya = y.data_ptr<float>();
  const int64_t blocks = (N + kTile - 1) / kTile;
  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      row_block(xa, M, K, wa, i * kTile, std::min(kTile, N - i * kTile), ba, ya, N);
    }
  });
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("dense_linear_available() -> bool", &dense_linear_available);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) { m.impl("dense_linear", &dense_linear); }
