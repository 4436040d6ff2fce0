// Fused element-wise ops of a decoder layer on the CPU: RMSNorm (with the residual add), SiLU-and-mul
// and neox-style RoPE. Each replaces several torch ops that each read and wrote the whole
// activation (a prefill's gate/up output is tokens x 2 x intermediate), with one pass per row
// (RMSNorm: two) that reads and writes the tensors directly, vector by vector, with no fp32 row
// buffers. They round where the torch ops they replace round (every torch op on bf16 stores bf16;
// srt_cpu::vround does it in registers), so results equal the torch path up to the order of the
// RMS sum and of the exp.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "cpu_math.h"

namespace {

using srt_cpu::kLanes;
using srt_cpu::load_row;
using srt_cpu::vfloat;
using srt_cpu::vload;
using srt_cpu::vstore;

// Rows of work per parallel chunk: enough that a chunk outweighs the hand-off.
constexpr int64_t kGrainRows = 4;

// x stored in T and read back; for fp32 computed on its own, not fused into a later add (see
// srt_cpu::vround).
template <typename T>
inline float rounded(float x) {
  return srt_cpu::to_float(srt_cpu::from_float<T>(x));
}

template <>
inline float rounded<float>(float x) {
  return srt_cpu::computed_alone(x);
}

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
// first T(x + residual) and is also returned as the new residual. Two passes over each row straight
// from and to the tensors (no fp32 row buffers): the sum of squares (writing the new residual),
// then the scaling. The rounded row the second pass needs is what the first stored (the new
// residual) or x itself.
template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t rows,
                   int64_t hidden, int64_t x_s0, int64_t r_s0, double eps) {
  std::vector<float> w(hidden);
  load_row(weight, w.data(), hidden);
  const int64_t body = hidden - hidden % (2 * kLanes);
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * x_s0;
      // Two accumulators: the sum is not one long chain of dependent adds.
      vfloat acc0 = {}, acc1 = {};
      float tail = 0.0f;
      if (residual != nullptr) {
        const T* res = residual + i * r_s0;
        T* dst = new_residual + i * hidden;
        int64_t d = 0;
        for (; d < body; d += 2 * kLanes) {
          const vfloat a = srt_cpu::vround(vload(src + d) + vload(res + d), T());
          const vfloat b = srt_cpu::vround(vload(src + d + kLanes) + vload(res + d + kLanes), T());
          vstore(dst + d, a);
          vstore(dst + d + kLanes, b);
          acc0 += a * a;
          acc1 += b * b;
        }
        for (; d < hidden; ++d) {
          const T v = srt_cpu::from_float<T>(srt_cpu::to_float(src[d]) + srt_cpu::to_float(res[d]));
          dst[d] = v;
          tail += srt_cpu::to_float(v) * srt_cpu::to_float(v);
        }
        src = dst;
      } else {
        int64_t d = 0;
        for (; d < body; d += 2 * kLanes) {
          const vfloat a = vload(src + d), b = vload(src + d + kLanes);
          acc0 += a * a;
          acc1 += b * b;
        }
        for (; d < hidden; ++d) tail += srt_cpu::to_float(src[d]) * srt_cpu::to_float(src[d]);
      }
      const float sum = srt_cpu::vsum(acc0 + acc1) + tail;
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
      T* o = out + i * hidden;
      int64_t d = 0;
      for (; d + kLanes <= hidden; d += kLanes) {
        vstore(o + d, srt_cpu::vround(vload(src + d) * inv, T()) * vload(w.data() + d));
      }
      for (; d < hidden; ++d) {
        const float normed = srt_cpu::to_float(srt_cpu::from_float<T>(srt_cpu::to_float(src[d]) * inv));
        o[d] = srt_cpu::from_float<T>(normed * w[d]);
      }
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
// x [rows, 2 * d] -> T(T(silu(gate)) * up), gate = x[:, :d], up = x[:, d:]; one pass, in registers.
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d, int64_t x_s0) {
  at::parallel_for(0, rows, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* gate = x + i * x_s0;
      const T* up = gate + d;
      T* o = out + i * d;
      int64_t e = 0;
      for (; e + kLanes <= d; e += kLanes) {
        const vfloat g = vload(gate + e);
        vstore(o + e, srt_cpu::vround(g / (1.0f + srt_cpu::vexp(-g)), T()) * vload(up + e));
      }
      for (; e < d; ++e) {
        const float g = srt_cpu::to_float(gate[e]);
        const float silu = srt_cpu::to_float(srt_cpu::from_float<T>(g / (1.0f + std::exp(-g))));
        o[e] = srt_cpu::from_float<T>(silu * srt_cpu::to_float(up[e]));
      }
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
  const int64_t body = half - half % kLanes;
  at::parallel_for(0, n, kGrainRows, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* c = cos + pos[i] * dim;
      const T* s = sin + pos[i] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = src + i * s0 + h * s1;
        T* o = dst + (i * heads + h) * dim;
        int64_t e = 0;
        for (; e < body; e += kLanes) {
          const vfloat x1 = vload(x + e), x2 = vload(x + half + e);
          vstore(o + e, srt_cpu::vround(x1 * vload(c + e), T()) - srt_cpu::vround(x2 * vload(s + e), T()));
          vstore(o + half + e,
                 srt_cpu::vround(x2 * vload(c + half + e), T()) + srt_cpu::vround(x1 * vload(s + half + e), T()));
        }
        for (; e < half; ++e) {
          const float x1 = srt_cpu::to_float(x[e]), x2 = srt_cpu::to_float(x[half + e]);
          o[e] = srt_cpu::from_float<T>(rounded<T>(x1 * srt_cpu::to_float(c[e])) -
                                        rounded<T>(x2 * srt_cpu::to_float(s[e])));
          o[half + e] = srt_cpu::from_float<T>(rounded<T>(x2 * srt_cpu::to_float(c[half + e])) +
                                               rounded<T>(x1 * srt_cpu::to_float(s[half + e])));
        }
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
  // A plain loop: two aten reductions (min, max) cost more than the rotation of a decode step.
  const int64_t* p = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < pos.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < cos_cache.size(0), "position ", p[i], " (token ", i,
                ") outside the RoPE table of ", cos_cache.size(0), " rows");
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

// ------------------------------------------------------------------------------ KV pool writes
// k and v [n, kv_heads, dim] written into k_buffer / v_buffer [slots, kv_heads, dim] at slots
// loc[i]: the pool's index_copy_, as plain row copies (any dtype, the bytes as they are). Every
// slot is checked before anything is written.
template <typename index_t>
void store_rows(const at::Tensor& buffer, const at::Tensor& src, const index_t* loc, int64_t n) {
  const int64_t heads = src.size(1), bytes = src.size(2) * src.element_size();
  const int64_t b_s0 = buffer.stride(0) * buffer.element_size(), b_s1 = buffer.stride(1) * buffer.element_size();
  const int64_t s_s0 = src.stride(0) * src.element_size(), s_s1 = src.stride(1) * src.element_size();
  char* dst = static_cast<char*>(buffer.data_ptr());
  const char* from = static_cast<const char*>(src.data_ptr());
  const bool whole_rows = b_s1 == bytes && s_s1 == bytes;  // a slot's heads back to back on both sides
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* row = dst + static_cast<int64_t>(loc[i]) * b_s0;
      const char* in = from + i * s_s0;
      if (whole_rows) {
        std::memcpy(row, in, heads * bytes);
      } else {
        for (int64_t h = 0; h < heads; ++h) std::memcpy(row + h * b_s1, in + h * s_s1, bytes);
      }
    }
  });
}

void store_kv(const at::Tensor& k_buffer, const at::Tensor& v_buffer, const at::Tensor& loc, const at::Tensor& k,
              const at::Tensor& v) {
  for (const at::Tensor* t : {&k_buffer, &v_buffer, &loc, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), "store_kv takes CPU tensors only, got ", t->device());
  }
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "store_kv: buffers [slots, kv_heads, head_dim] and rows [n, kv_heads, head_dim], got ",
              k_buffer.sizes(), ", ", v_buffer.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(k.sizes().slice(1) == k_buffer.sizes().slice(1) && v.sizes().slice(1) == v_buffer.sizes().slice(1) &&
                  k.size(0) == v.size(0) && k_buffer.size(0) == v_buffer.size(0),
              "store_kv: rows ", k.sizes(), " / ", v.sizes(), " do not fit buffers ", k_buffer.sizes(), " / ",
              v_buffer.sizes());
  TORCH_CHECK(k.scalar_type() == k_buffer.scalar_type() && v.scalar_type() == v_buffer.scalar_type(),
              "store_kv: rows must have the buffers' dtype (", k_buffer.scalar_type(), " / ", v_buffer.scalar_type(),
              "), got ", k.scalar_type(), " / ", v.scalar_type());
  for (const at::Tensor* t : {&k_buffer, &v_buffer, &k, &v}) {
    TORCH_CHECK(t->stride(2) == 1, "store_kv: the head_dim axis must be contiguous");
  }
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == k.size(0), "store_kv: loc must be [n] with n = ", k.size(0));
  TORCH_CHECK(loc.scalar_type() == at::kLong || loc.scalar_type() == at::kInt, "store_kv: loc must be int64 or int32");
  const at::Tensor slots = loc.contiguous();
  const int64_t n = slots.size(0), size = k_buffer.size(0);
  auto run = [&](const auto* idx) {
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(idx[i] >= 0 && idx[i] < size, "store_kv: slot ", static_cast<int64_t>(idx[i]), " (row ", i,
                  ") outside the pool of ", size, " slots");
    }
    store_rows(k_buffer, k, idx, n);
    store_rows(v_buffer, v, idx, n);
  };
  if (slots.scalar_type() == at::kLong) {
    run(slots.data_ptr<int64_t>());
  } else {
    run(slots.data_ptr<int32_t>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(srt_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_embedding(Tensor positions, Tensor q, Tensor k, Tensor cos_cache, Tensor sin_cache) -> (Tensor, Tensor)");
  m.def("store_kv(Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor loc, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(srt_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("store_kv", &store_kv);
}
