// bf16 linear layers on AMX tiles (Intel Xeon 4th generation and later), for CPUs where oneDNN's
// AMX matmul has a fixed cost far above the arithmetic at decode sizes: on the Xeon with AMX of
// README ("AMX linears"), a 16 x 256 x 1536 matmul took oneDNN 128-313 us (its own verbose log),
// some 30 times what that arithmetic takes one core's tiles.
//
// Layout: a weight [N, K] (N a multiple of 16, K of 32) becomes tiles [N / 16][K / 32][16][16][2]:
// tile (n, k) is the B operand of one TDPBF16PS for output columns [16n, 16n + 16) and inputs
// [32k, 32k + 32), its row p holding, for each of the 16 columns, the weights of inputs 32k + 2p
// and 32k + 2p + 1 (the pairs the instruction multiplies). One tile is 1 KiB, contiguous.
//
// Kernel: a task takes kRowTiles x 16 rows of x and kColTiles x 16 output columns; for each 32-wide
// step of K it loads the rows' A tiles and the columns' B tiles and accumulates kRowTiles x
// kColTiles fp32 C tiles: 2 x 2 (2 A + 2 B + 4 C tiles, the 8 tile registers) above 16 rows,
// 1 x 4 (1 A, 2 B loaded twice, 4 C) at decode sizes. Rows past M read a zeroed copy; the C tiles go through a float buffer to the output
// (bias added there, one rounding to bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define SRT_CPU_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileRows = 16;  // rows of x (and of C) per tile
constexpr int64_t kTileCols = 16;  // output columns per tile
constexpr int64_t kTileK = 32;     // inputs per tile step (16 bf16 pairs)
constexpr int64_t kTileElems = kTileCols * kTileK;

// Whether this process may run AMX instructions: Linux hands the tile state out on request
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); asked once.
bool amx_usable() {
#if defined(SRT_CPU_AMX)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

at::Tensor convert_weight_amx(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "convert_weight_amx: weight must be a bf16 [N, K], got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kTileCols == 0 && K % kTileK == 0, "convert_weight_amx: N must be a multiple of ", kTileCols,
              " and K of ", kTileK, ", got ", N, " x ", K);
  // [N, K] -> [N/16, 16, K/32, 16, 2] -> [N/16, K/32, 16 (pairs), 16 (cols), 2].
  return weight.contiguous().view({N / kTileCols, kTileCols, K / kTileK, kTileK / 2, 2}).permute({0, 2, 3, 1, 4})
      .contiguous();
}

#if defined(SRT_CPU_AMX)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0..3: C (16 x 16 fp32); 4, 5: A (16 rows x 32 bf16); 6, 7: B (16 pairs x 16 columns).
void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// C tiles of kRowTiles x kColTiles over all of K; A rows from `a` (lda elements apart), B tiles
// of column block n at w + n * K / 32 * kTileElems.
template <int kRowTiles, int kColTiles>
void tile_block(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* w, int64_t K, float* c, int64_t ldc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t steps = K / kTileK, b_stride = 64, a_stride = lda * 2;
  for (int64_t k = 0; k < steps; ++k) {
    const c10::BFloat16* bk = w + k * kTileElems;
    _tile_loadd(4, a + k * kTileK, a_stride);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a + kTileRows * lda + k * kTileK, a_stride);
      _tile_loadd(6, bk, b_stride);
      _tile_loadd(7, bk + steps * kTileElems, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    } else {
      static_assert(kColTiles == 4, "one row tile against four column tiles");
      _tile_loadd(6, bk, b_stride);
      _tile_loadd(7, bk + steps * kTileElems, b_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, bk + 2 * steps * kTileElems, b_stride);
      _tile_loadd(7, bk + 3 * steps * kTileElems, b_stride);
      _tile_dpbf16ps(2, 4, 6);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  const int64_t c_stride = ldc * 4;
  if constexpr (kRowTiles == 2) {
    _tile_stored(0, c, c_stride);
    _tile_stored(1, c + kTileCols, c_stride);
    _tile_stored(2, c + kTileRows * ldc, c_stride);
    _tile_stored(3, c + kTileRows * ldc + kTileCols, c_stride);
  } else {
    _tile_stored(0, c, c_stride);
    _tile_stored(1, c + kTileCols, c_stride);
    _tile_stored(2, c + 2 * kTileCols, c_stride);
    _tile_stored(3, c + 3 * kTileCols, c_stride);
  }
}

// Rows of C (cols a multiple of 16, so of the vector width) to the output, bias added, one rounding.
template <typename O>
void write_rows(const float* c, int64_t ldc, int64_t rows, int64_t cols, const float* bias, O* y, int64_t ldy) {
  using srt_cpu::kLanes;
  for (int64_t m = 0; m < rows; ++m) {
    const float* src = c + m * ldc;
    O* dst = y + m * ldy;
    for (int64_t j = 0; j < cols; j += kLanes) {
      srt_cpu::vfloat v = srt_cpu::vload(src + j);
      if (bias != nullptr) v += srt_cpu::vload(bias + j);
      srt_cpu::vstore(dst + j, v);
    }
  }
}

template <typename O>
void run(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1);
  const bool decode = M <= kTileRows;
  const int64_t rows_per_task = decode ? kTileRows : 2 * kTileRows;
  const int64_t cols_per_task = decode ? 4 * kTileCols : 2 * kTileCols;
  const int64_t row_tasks = (M + rows_per_task - 1) / rows_per_task;
  const int64_t col_tasks = (N + cols_per_task - 1) / cols_per_task;
  // The last row task's rows, padded with zero rows to a whole task, so every A tile load stays
  // inside its buffer.
  const at::Tensor xc = x.contiguous();
  const int64_t tail_m0 = (row_tasks - 1) * rows_per_task;
  at::Tensor tail = xc;
  if (M - tail_m0 < rows_per_task) {
    tail = at::zeros({rows_per_task, K}, x.options());
    tail.narrow(0, 0, M - tail_m0).copy_(xc.narrow(0, tail_m0, M - tail_m0));
  }
  const c10::BFloat16* xa = xc.data_ptr<c10::BFloat16>();
  const c10::BFloat16* xt = tail.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wa = packed.data_ptr<c10::BFloat16>();
  O* ya = y.data_ptr<O>();
  const int64_t steps = K / kTileK;
  at::parallel_for(0, row_tasks * col_tasks, 1, [&](int64_t begin, int64_t end) {
    load_tile_config();
    alignas(64) float c[2 * kTileRows * 4 * kTileCols];
    for (int64_t t = begin; t < end; ++t) {
      // Task t: column task t % col_tasks of row task t / col_tasks (a thread's range walks columns).
      const int64_t m0 = (t / col_tasks) * rows_per_task, n0 = (t % col_tasks) * cols_per_task;
      const int64_t cols = std::min(cols_per_task, N - n0);
      const int64_t ldc = cols_per_task;
      const c10::BFloat16* w = wa + (n0 / kTileCols) * steps * kTileElems;
      const c10::BFloat16* a = m0 == tail_m0 && tail.data_ptr() != xc.data_ptr() ? xt : xa + m0 * K;
      if (cols < cols_per_task) {
        // The last columns: fewer than a task's tiles; run column tile by column tile.
        for (int64_t j = 0; j < cols; j += kTileCols) {
          const c10::BFloat16* wj = w + (j / kTileCols) * steps * kTileElems;
          for (int64_t r = 0; r < rows_per_task; r += kTileRows) {
            _tile_zero(0);
            for (int64_t k = 0; k < steps; ++k) {
              _tile_loadd(4, a + r * K + k * kTileK, K * 2);
              _tile_loadd(6, wj + k * kTileElems, 64);
              _tile_dpbf16ps(0, 4, 6);
            }
            _tile_stored(0, c + r * ldc + j, ldc * 4);
          }
        }
      } else if (decode) {
        tile_block<1, 4>(a, K, w, K, c, ldc);
      } else {
        tile_block<2, 2>(a, K, w, K, c, ldc);
      }
      write_rows<O>(c, ldc, std::min(rows_per_task, M - m0), cols, bias == nullptr ? nullptr : bias + n0,
                    ya + m0 * N + n0, N);
    }
    _tile_release();
  });
}
#endif

bool amx_linear_available() { return amx_usable(); }

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(amx_usable(), "amx_linear: this build or CPU has no AMX tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: x must be a bf16 [M, K], got ",
              x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == kTileK / 2 && packed.size(3) == kTileCols && packed.size(4) == 2,
              "amx_linear: packed must be convert_weight_amx's [N/16, K/32, 16, 16, 2], got ", packed.sizes());
  TORCH_CHECK(packed.size(1) * kTileK == x.size(1), "amx_linear: x has ", x.size(1), " features, the weight ",
              packed.size(1) * kTileK);
  const int64_t N = packed.size(0) * kTileCols;
  const at::ScalarType out_type = out_dtype.value_or(at::kBFloat16);
  TORCH_CHECK(out_type == at::kFloat || out_type == at::kBFloat16, "amx_linear: fp32 or bf16 output");
  at::Tensor bf;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N, "amx_linear: bias has ", bias->numel(), " values for ", N, " outputs");
    bf = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(out_type));
  if (x.size(0) == 0) return y;
#if defined(SRT_CPU_AMX)
  const float* b = bias.has_value() ? bf.data_ptr<float>() : nullptr;
  if (out_type == at::kBFloat16) {
    run<c10::BFloat16>(x, packed, b, y);
  } else {
    run<float>(x, packed, b, y);
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("convert_weight_amx(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, ScalarType? out_dtype) -> Tensor");
  m.def("amx_linear_available() -> bool", &amx_linear_available);
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("convert_weight_amx", &convert_weight_amx);
  m.impl("amx_linear", &amx_linear);
}
