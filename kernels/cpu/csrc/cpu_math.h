// Small building blocks of the CPU kernels: bf16 <-> fp32, 8-float vectors (GCC/Clang vector
// extensions: AVX registers with -mavx, SSE pairs without) with a branch-free exp, and a
// dynamically scheduled loop on torch's intra-op thread pool.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace srt_cpu {

inline float to_float(float x) { return x; }

inline float to_float(c10::BFloat16 x) {
  // bf16 is the upper half of an fp32.
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // bf16: round to nearest even
}

// One K or V row as fp32: fp32 storage is used in place, bf16 is widened into `scratch`.
inline const float* float_row(const float* row, float* /*scratch*/, int64_t /*n*/) { return row; }

inline const float* float_row(const c10::BFloat16* row, float* scratch, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(scratch + i, &wide, sizeof(float));
  }
  return scratch;
}

// Eight floats. Written out explicitly because the compiler does not keep a running output
// chunk in registers across a loop over keys on its own.
constexpr int64_t kLanes = 8;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat vbroadcast(float x) { return vfloat{} + x; }

// exp on eight lanes, branch-free: x = n*ln2 + r with |r| <= ln2/2 (n rounded by adding and
// subtracting 1.5 * 2^23; ln2 split in a short high part, so n*hi is exact, and a low part),
// e^r from its degree-7 Taylor polynomial (relative error < 1e-8), 2^n from the exponent bits.
inline vfloat vexp(vfloat x) {
  const vfloat lo = vbroadcast(-87.0f), hi = vbroadcast(88.0f), magic = vbroadcast(12582912.0f);
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vfloat n = (x * 1.4426950408889634f + magic) - magic;
  const vfloat r = (x - n * 0.693145751953125f) - n * 1.4286068203094172e-6f;
  vfloat p = 1.0f + r * (1.0f / 7.0f);
  p = 1.0f + r * (1.0f / 6.0f) * p;
  p = 1.0f + r * (1.0f / 5.0f) * p;
  p = 1.0f + r * (1.0f / 4.0f) * p;
  p = 1.0f + r * (1.0f / 3.0f) * p;
  p = 1.0f + r * (1.0f / 2.0f) * p;
  p = 1.0f + r * p;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float vsum(vfloat v) {
  // Halve twice with vector adds, then add the last two lanes.
  typedef float half_t __attribute__((vector_size(kLanes / 2 * sizeof(float))));
  typedef float quarter_t __attribute__((vector_size(kLanes / 4 * sizeof(float))));
  half_t lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const half_t h = lo + hi;
  quarter_t a, b;
  std::memcpy(&a, &h, sizeof(a));
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof(a), sizeof(b));
  const quarter_t q = a + b;
  return q[0] + q[1];
}

// Run `body(i, state)` for i in [0, n) on torch's intra-op threads, handing out indices one at a
// time (dynamic scheduling: the tail of a ragged batch does not pile up on one thread). torch's
// own pool, so torch.set_num_threads governs these ops too and no second OpenMP runtime loads.
template <typename State, typename MakeState, typename Body>
void parallel_tasks(int64_t n, const MakeState& make_state, const Body& body) {
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    State state = make_state();
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(i, state);
  });
}

}  // namespace srt_cpu
