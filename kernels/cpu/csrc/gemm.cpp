// Linear layers over weights packed into column panels, for CPUs where oneDNN's small-row
// (decode) matmuls leave half the arithmetic unused (AVX2-only CPUs; see srt/layers/cpu_weight_packing.py).
//
// Layout: a weight [N, K] becomes panels [P = ceil(N / kPanel), K, kPanel]: panel p holds output
// columns [p * kPanel, (p + 1) * kPanel) with one contiguous row of kPanel weights per k (zeros past
// N). A decode step then streams every weight byte once, in address order, which the hardware
// prefetcher and the software prefetch below keep ahead of the arithmetic.
//
// Micro-kernel: kRows rows of x times one panel, 2 * kRows vector accumulators, one FMA per weight
// vector per row (the weights are loaded once per k and reused by every row of the tile). K runs
// in chunks of kChunk so that all row tiles of a chunk reuse its weights from L1 before the next
// chunk is read, which spreads the memory traffic evenly over the arithmetic. fp32 or bf16
// weights (bf16 widened in registers: half the bytes read), fp32 accumulation, one rounding of
// the output to its dtype.
//
// bf16 panels store each k row's kPanel weights as kLanes pairs: 32-bit word j holds column j in
// its low half and column j + kLanes in its high half. A bf16 is the upper half of an fp32, so the
// two weight vectors of a row are the words shifted left by 16 and the words with the low half
// masked: one load and two integer ops, where widening columns in order took two zero-extending
// loads and two shifts. On the Zen 3 EPYC (AVX2) bf16 panels at 6-200 rows became 1.05-1.49x
// faster over SmolLM2's and llama-26m's layers, faster than fp32 panels up to 24 rows and within
// 8% of them up to 200.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>

#include "cpu_math.h"

namespace {

using srt_cpu::kLanes;
using srt_cpu::vbroadcast;
using srt_cpu::vfloat;
using srt_cpu::vload;
using srt_cpu::vstore;

constexpr int64_t kPanel = 2 * kLanes;  // output columns per panel: two vectors
constexpr int kRows = kLanes == 16 ? 12 : 6;  // rows per micro-tile: 2 * kRows accumulators + 2 weight vectors + 1 broadcast
constexpr int64_t kChunk = 64;          // k rows per chunk (64 x kPanel fp32 = 4 KiB on AVX2)
// Rows of x per task, a multiple of kRows: a prefill's row tiles share each chunk read. With 48
// rows, prefill-sized matmuls ran at 60-70% of oneDNN's speed; with 96 (a chunk of x, 24 KiB,
// stays in L1) a SmolLM2 prefill runs at about 95% of it (192: 93%).
constexpr int64_t kRowBlock = 96;
constexpr int64_t kPrefetchRows = kChunk;  // the first row tile of a chunk prefetches the next chunk
constexpr int64_t kUnpackPanels = 8;       // panels per block (per task) of unpack_weight_panels
// Up to this many rows a bf16 chunk is widened in registers by every row tile; above it once
// into an fp32 copy the tiles share. Zen 3 (AVX2), llama-26m's layers: in registers 4.6 against
// 5.6 ms at 16 rows, 6.4 against 6.1 at 24, 10.5 against 9.9 at 48. AVX-512 keeps the earlier
// two tiles (not measured there).
constexpr int64_t kWidenInRegistersRows = kLanes == 16 ? 2 * kRows : 3 * kRows;

// One k row of a bf16 panel (kLanes pairs, see the top) as its two fp32 weight vectors.
inline void widen_pairs(const c10::BFloat16* w, vfloat& lo_cols, vfloat& hi_cols) {
  srt_cpu::vuint words;
  std::memcpy(&words, w, sizeof(words));
  const srt_cpu::vuint lo = words << 16, hi = words & 0xFFFF0000u;
  std::memcpy(&lo_cols, &lo, sizeof(lo_cols));
  std::memcpy(&hi_cols, &hi, sizeof(hi_cols));
}

// One k row of a panel as its two fp32 weight vectors.
inline void load_row(const float* w, vfloat& b0, vfloat& b1) {
  b0 = vload(w);
  b1 = vload(w + kLanes);
}
inline void load_row(const c10::BFloat16* w, vfloat& b0, vfloat& b1) { widen_pairs(w, b0, b1); }

// c[MB, kPanel] (+)= x[MB, :n] @ w[:n, :] (w: n rows of kPanel); c holds the partial sums between chunks.
// kPrefetch is a template argument: as a run-time flag tested in the k loop it made the tiles over
// an L1 copy (bf16 at 24 and 96 rows) 10-12% slower.
template <typename W, int MB, bool kPrefetch>
inline void tile(const float* x, int64_t ldx, const W* w_rows, int64_t n, float* c, bool first) {
  vfloat lo[MB], hi[MB];
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i) {
    lo[i] = first ? vfloat{} : vload(c + i * kPanel);
    hi[i] = first ? vfloat{} : vload(c + i * kPanel + kLanes);
  }
  for (int64_t k = 0; k < n; ++k) {
    const W* w = w_rows + k * kPanel;
    if constexpr (kPrefetch) __builtin_prefetch(w + kPrefetchRows * kPanel, 0, 3);
    vfloat b0, b1;
    load_row(w, b0, b1);
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i) {
      const vfloat a = vbroadcast(x[i * ldx + k]);
      lo[i] += a * b0;
      hi[i] += a * b1;
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MB; ++i) {
    vstore(c + i * kPanel, lo[i]);
    vstore(c + i * kPanel + kLanes, hi[i]);
  }
}

template <typename W, bool kPrefetch>
inline void tile_rows(int rows, const float* x, int64_t ldx, const W* w_rows, int64_t n, float* c, bool first) {
  switch (rows) {
    case 12: return tile<W, 12, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 11: return tile<W, 11, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 10: return tile<W, 10, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 9: return tile<W, 9, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 8: return tile<W, 8, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 7: return tile<W, 7, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 6: return tile<W, 6, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 5: return tile<W, 5, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 4: return tile<W, 4, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 3: return tile<W, 3, kPrefetch>(x, ldx, w_rows, n, c, first);
    case 2: return tile<W, 2, kPrefetch>(x, ldx, w_rows, n, c, first);
    default: return tile<W, 1, kPrefetch>(x, ldx, w_rows, n, c, first);
  }
}

// The row tiles of one chunk: each reads the chunk's weights, the first from memory (prefetching
// ahead), the others from L1.
template <typename W>
inline void chunk_tiles(const float* x, int64_t rows, int64_t K, const W* w_rows, int64_t n, float* c, bool first,
                        bool prefetch = true) {
  for (int64_t m = 0; m < rows; m += kRows) {
    const int tile_rows_m = static_cast<int>(std::min<int64_t>(kRows, rows - m));
    if (prefetch && m == 0) {
      tile_rows<W, true>(tile_rows_m, x, K, w_rows, n, c, first);
    } else {
      tile_rows<W, false>(tile_rows_m, x + m * K, K, w_rows, n, c + m * kPanel, first);
    }
  }
}

// bf16 weights: a decode's few row tiles widen them in registers (half the bytes read); more
// tiles (a prefill) share one widened fp32 copy of the chunk instead of widening it per tile.
inline void chunk_tiles_bf16(const float* x, int64_t rows, int64_t K, const c10::BFloat16* w_rows, int64_t n, float* c,
                             bool first) {
  if (rows <= kWidenInRegistersRows) return chunk_tiles(x, rows, K, w_rows, n, c, first);
  alignas(64) float wide[kChunk * kPanel];
  for (int64_t i = 0; i < n * kPanel; i += kPanel) {
    __builtin_prefetch(w_rows + i + kPrefetchRows * kPanel, 0, 3);
    vfloat b0, b1;
    load_row(w_rows + i, b0, b1);
    vstore(wide + i, b0);
    vstore(wide + i + kLanes, b1);
  }
  chunk_tiles<float>(x, rows, K, wide, n, c, first, /*prefetch=*/false);  // the copy is in L1
}

// y[rows, panel's columns] = x[rows, :] @ panel (+ bias), rounded once to O.
template <typename W, typename O>
void panel_block(const float* x, int64_t rows, int64_t K, const W* panel, const float* bias, O* y, int64_t ldy,
                 int64_t cols) {
  alignas(64) float c[kRowBlock * kPanel];
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t n = std::min(kChunk, K - k0);
    if constexpr (std::is_same_v<W, c10::BFloat16>) {
      chunk_tiles_bf16(x + k0, rows, K, panel + k0 * kPanel, n, c, k0 == 0);
    } else {
      chunk_tiles<W>(x + k0, rows, K, panel + k0 * kPanel, n, c, k0 == 0);
    }
  }
  for (int64_t m = 0; m < rows; ++m) {
    float* row = c + m * kPanel;
    if (bias != nullptr) {
      for (int64_t j = 0; j < cols; ++j) row[j] += bias[j];
    }
    O* out = y + m * ldy;
    if (cols == kPanel) {
      vstore(out, vload(row));
      vstore(out + kLanes, vload(row + kLanes));
    } else {
      for (int64_t j = 0; j < cols; ++j) out[j] = srt_cpu::from_float<O>(row[j]);
    }
  }
}

template <typename W, typename O>
void run(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  // Row blocks of equal size (at most kRowBlock, a multiple of kRows where possible).
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t per_block = std::min(kRowBlock, ((M + blocks - 1) / blocks + kRows - 1) / kRows * kRows);
  const float* xa = x.data_ptr<float>();
  const W* wa = packed.data_ptr<W>();
  O* ya = y.data_ptr<O>();
  // Task i: row block i / P, panel i % P; a thread's contiguous range walks the panels in order.
  at::parallel_for(0, blocks * P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m0 = (i / P) * per_block, p = i % P;
      if (m0 >= M) continue;
      const int64_t rows = std::min(per_block, M - m0), col0 = p * kPanel;
      panel_block<W, O>(xa + m0 * K, rows, K, wa + p * K * kPanel, bias == nullptr ? nullptr : bias + col0,
                        ya + m0 * N + col0, N, std::min(kPanel, N - col0));
    }
  });
}

at::Tensor convert_weight_packed(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "convert_weight_packed: weight must be [N, K], got ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "convert_weight_packed: fp32 or bf16 weights, got ", weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  // [N, K] -> zero-pad to [P * kPanel, K] -> [P, kPanel, K] -> [P, K, kPanel].
  at::Tensor padded = at::constant_pad_nd(weight, {0, 0, 0, P * kPanel - N});
  at::Tensor panels = padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
  if (weight.scalar_type() == at::kFloat) return panels;
  // bf16: columns (j, j + kLanes) side by side, j < kLanes.
  return panels.view({P, K, 2, kLanes}).transpose(2, 3).contiguous().view({P, K, kPanel});
}

// Panels [start, start + count) laid back out as one dense fp32 [K, count * kPanel] matrix (bf16
// widened), for BLAS on prefill-sized inputs. A task takes kUnpackPanels panels: it reads them as
// that many sequential streams and writes one contiguous run of each slab row, which took 45-64 ms
// for SmolLM2's 120 weights where torch's strided copy of the permuted view took 79-96 ms.
at::Tensor unpack_weight_panels(const at::Tensor& packed, int64_t start, int64_t count) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "unpack_weight_panels: packed must be convert_weight_packed's [P, K, ", kPanel, "], got ",
              packed.sizes());
  TORCH_CHECK(start >= 0 && count > 0 && start + count <= packed.size(0), "unpack_weight_panels: panels [", start,
              ", ", start + count, ") outside [0, ", packed.size(0), ")");
  const int64_t K = packed.size(1), cols = count * kPanel;
  at::Tensor dense = at::empty({K, cols}, packed.options().dtype(at::kFloat));
  float* out = dense.data_ptr<float>();
  auto copy = [&](auto* src) {
    // Blocks of kUnpackPanels panels: their rows are read as that many sequential streams and
    // written as one contiguous run per slab row.
    const int64_t blocks = (count + kUnpackPanels - 1) / kUnpackPanels;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t p0 = b * kUnpackPanels, p1 = std::min(count, p0 + kUnpackPanels);
        for (int64_t k = 0; k < K; ++k) {
          float* row = out + k * cols;
          for (int64_t p = p0; p < p1; ++p) {
            vfloat b0, b1;
            load_row(src + ((start + p) * K + k) * kPanel, b0, b1);
            vstore(row + p * kPanel, b0);
            vstore(row + p * kPanel + kLanes, b1);
          }
        }
      }
    });
  };
  if (packed.scalar_type() == at::kBFloat16) {
    copy(packed.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(packed.scalar_type() == at::kFloat, "unpack_weight_panels: fp32 or bf16 panels");
    copy(packed.data_ptr<float>());
  }
  return dense;
}

at::Tensor weight_packed_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t out_features, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.dim() == 2, "weight_packed_linear: x must be [M, K], got ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "weight_packed_linear: packed must be convert_weight_packed's [P, K, ", kPanel, "], got ",
              packed.sizes());
  TORCH_CHECK(packed.size(1) == x.size(1), "weight_packed_linear: x has ", x.size(1), " features, the weight ",
              packed.size(1));
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel && out_features <= packed.size(0) * kPanel,
              "weight_packed_linear: out_features ", out_features, " does not fit ", packed.size(0), " panels");
  const at::ScalarType out_type = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_type == at::kFloat || out_type == at::kBFloat16, "weight_packed_linear: fp32 or bf16 output");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == out_features, "weight_packed_linear: bias has ", bias->numel(), " values");
    bf = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(out_type));
  if (x.size(0) == 0) return y;
  const bool w16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK(w16 || packed.scalar_type() == at::kFloat, "weight_packed_linear: fp32 or bf16 weights");
  if (w16 && out_type == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16>(xf, packed, b, y, out_features);
  } else if (w16) {
    run<c10::BFloat16, float>(xf, packed, b, y, out_features);
  } else if (out_type == at::kBFloat16) {
    run<float, c10::BFloat16>(xf, packed, b, y, out_features);
  } else {
    run<float, float>(xf, packed, b, y, out_features);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("convert_weight_packed(Tensor weight) -> Tensor");
  m.def("unpack_weight_panels(Tensor packed, int start, int count) -> Tensor");
  m.def("weight_packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, ScalarType? out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("convert_weight_packed", &convert_weight_packed);
  m.impl("unpack_weight_panels", &unpack_weight_panels);
  m.impl("weight_packed_linear", &weight_packed_linear);
}
