// Fused element-wise ops of a decoder layer on the CPU: RMSNorm (with the residual add), SiLU-and-mul
// and neox-style RoPE. Each replaces several torch ops that each read and wrote the whole
// activation (a prefill's gate/up output is tokens x 2 x intermediate), with one pass per row.
// They round where the torch ops they replace round (every torch op on bf16 stores bf16), so
// results equal the torch path up to the order of the RMS sum.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_math.h"

namespace {

using srt_cpu::kLanes;
using srt_cpu::load_row;
using srt_cpu::round_row;
using srt_cpu::store_row;
using srt_cpu::vfloat;
using srt_cpu::vload;
using srt_cpu::vstore;

// Rows of work per parallel chunk: enough that a chunk outweighs the hand-off.
constexpr int64_t kGrainRows = 4;

// Call `fn` with a value of the element type: float or c10::BFloat16 (check_rows allows no other).
template <typename Fn>
void dispatch_float_bf16(at::ScalarType type, const Fn& fn) {
  if (type == at::kBFloat16) {
    fn(c10::BFloat16());
  } else {
    fn(0.0f);
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows, got ", t.sizes());
}

// ----------------------------------------------------------------------------------------- RMSNorm
// out = weight * T(x * rsqrt(mean(x^2) + eps)), the normalisation in fp32; with a residual, x is
// first T(x + residual) and is also returned as the new residual.
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t rows,
                   int64_t hidden, int64_t x_s0, int64_t r_s0, double eps) {
  std::vector<float> w(hidden);
  load_row(weight, w.data(), hidden);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden), other(hidden);
    for (int64_t i = begin; i < end; ++i) {
      load_row(x + i * x_s0, row.data(), hidden);
      if (residual != nullptr) {
        load_row(residual + i * r_s0, other.data(), hidden);
        for (int64_t d = 0; d < hidden; ++d) row[d] += other[d];
        round_row(row.data(), hidden, T());
        store_row(new_residual + i * hidden, row.data(), hidden);
      }
      vfloat acc = {};
      int64_t d = 0;
      for (; d + kLanes <= hidden; d += kLanes) {
        const vfloat v = vload(row.data() + d);
        acc += v * v;
      }
      float sum = srt_cpu::vsum(acc);
      for (; d < hidden; ++d) sum += row[d] * row[d];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      for (d = 0; d < hidden; ++d) row[d] *= inv;
      round_row(row.data(), hidden, T());
      for (d = 0; d < hidden; ++d) row[d] *= w[d];
      store_row(out + i * hidden, row.data(), hidden);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                            const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.scalar_type() == x.scalar_type(),
              "weight must be [", hidden, "] of x's dtype, got ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({rows, hidden}, x.options());
  at::Tensor new_residual;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x, got ", residual->sizes(), " and ", x.sizes());
    new_residual = at::empty({rows, hidden}, x.options());
  }
  dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr,
                            w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            residual.has_value() ? new_residual.data_ptr<scalar_t>() : nullptr, rows, hidden,
                            x.stride(0), residual.has_value() ? residual->stride(0) : 0, eps);
  });
  // Without a residual the second output is an empty placeholder (a custom op may not return
  // one tensor twice).
  return {out, residual.has_value() ? new_residual : at::empty({0}, x.options())};
}

// ------------------------------------------------------------------------------------ SiLU and mul
// x [rows, 2 * d] -> T(T(silu(gate)) * up), gate = x[:, :d], up = x[:, d:].
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d, int64_t x_s0) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(d), up(d);
    for (int64_t i = begin; i < end; ++i) {
      load_row(x + i * x_s0, gate.data(), d);
      load_row(x + i * x_s0 + d, up.data(), d);
      int64_t e = 0;
      for (; e + kLanes <= d; e += kLanes) {
        const vfloat g = vload(gate.data() + e);
        vstore(gate.data() + e, g / (1.0f + srt_cpu::vexp(-g)));
      }
      for (; e < d; ++e) gate[e] = gate[e] / (1.0f + std::exp(-gate[e]));
      round_row(gate.data(), d, T());
      for (e = 0; e < d; ++e) gate[e] *= up[e];
      store_row(out + i * d, gate.data(), d);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x's last dim must be even (gate and up halves), got ", x.size(1));
  const int64_t rows = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({rows, d}, x.options());
  dispatch_float_bf16(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, d, x.stride(0));
  });
  return out;
}

// ------------------------------------------------------------------------------------------- RoPE
// Neox (rotate-half) RoPE of q [n, heads, dim] and k [n, kv_heads, dim] at `positions`, with the
// cos/sin tables [max_position, dim] in the activations' dtype: out = T(T(x * cos) + T(rot(x) * sin)),
// rot(x) = [-x2, x1]. Returns new contiguous q and k.
template <typename T>
void rope_rows(const T* src, T* dst, int64_t n, int64_t heads, int64_t dim, int64_t s0, int64_t s1, const int64_t* pos,
               const T* cos, const T* sin) {
  const int64_t half = dim / 2;
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim), x(dim), rot(dim);
    for (int64_t i = begin; i < end; ++i) {
      load_row(cos + pos[i] * dim, c.data(), dim);
      load_row(sin + pos[i] * dim, s.data(), dim);
      for (int64_t h = 0; h < heads; ++h) {
        load_row(src + i * s0 + h * s1, x.data(), dim);
        for (int64_t e = 0; e < half; ++e) {
          rot[e] = -x[e + half];
          rot[e + half] = x[e];
        }
        for (int64_t e = 0; e < dim; ++e) {
          x[e] *= c[e];
          rot[e] *= s[e];
        }
        round_row(x.data(), dim, T());
        round_row(rot.data(), dim, T());
        for (int64_t e = 0; e < dim; ++e) x[e] += rot[e];
        store_row(dst + (i * heads + h) * dim, x.data(), dim);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& q,
                                                    const at::Tensor& k, const at::Tensor& cos_cache,
                                                    const at::Tensor& sin_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q and k must be [n, heads, dim] with the same n and dim, got ", q.sizes(), " and ", k.sizes());
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k need a contiguous head dim");
  TORCH_CHECK(q.size(2) % 2 == 0, "head dim must be even, got ", q.size(2));
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos_cache.scalar_type() == q.scalar_type() &&
                  sin_cache.scalar_type() == q.scalar_type(),
              "q, k and the cos/sin tables must share a dtype");
  TORCH_CHECK(cos_cache.dim() == 2 && cos_cache.size(1) == q.size(2) && sin_cache.sizes() == cos_cache.sizes(),
              "cos/sin tables must be [max_position, head_dim]");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == q.size(0), "positions must be [n]");
  if (pos.numel() > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < cos_cache.size(0), "positions [", lo, ", ", hi, "] outside the RoPE table of ",
                cos_cache.size(0), " rows");
  }
  const at::Tensor cos = cos_cache.contiguous(), sin = sin_cache.contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  dispatch_float_bf16(q.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    rope_rows<scalar_t>(q.data_ptr<scalar_t>(), q_out.data_ptr<scalar_t>(), q.size(0), q.size(1), q.size(2),
                        q.stride(0), q.stride(1), pos.data_ptr<int64_t>(), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>());
    rope_rows<scalar_t>(k.data_ptr<scalar_t>(), k_out.data_ptr<scalar_t>(), k.size(0), k.size(1), k.size(2),
                        k.stride(0), k.stride(1), pos.data_ptr<int64_t>(), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>());
  });
  return {q_out, k_out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
