// Small building blocks of the CPU kernels: bf16 <-> fp32, 8-float vectors (GCC/Clang vector
// extensions: AVX registers with -mavx, SSE pairs without) with a branch-free exp, and a
// dynamically scheduled loop on torch's intra-op thread pool.
#pragma once

#include <ATen/Parallel.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
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

// A vector of floats: sixteen lanes (one zmm register) where the compiler may use AVX-512,
// else eight (AVX, or SSE pairs). Written out explicitly because the compiler does not keep a
// running output chunk in registers across a loop over keys on its own.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));

// kLanes consecutive values as fp32: fp32 as is; bf16 widened in registers (bf16 is the upper
// half of an fp32: zero-extend, shift left by 16).
inline vfloat vload(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  // One 512-bit zero-extend: the generic conversion below compiled to two 256-bit halves and an
  // insert under GCC's 256-bit preference for this CPU.
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vfloat)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#else
  vhalf bits;
  std::memcpy(&bits, p, sizeof(bits));
  const vuint wide = __builtin_convertvector(bits, vuint) << 16;
  vfloat out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
#endif
}

// Every lane = x, as one broadcast instruction where there are intrinsics for it (the generic
// `vfloat{} + x` also adds +0.0 first, an extra dependent instruction in a micro-kernel).
inline vfloat vbroadcast(float x) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (vfloat)_mm256_set1_ps(x);
#else
  return vfloat{} + x;
#endif
}

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

typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));

// Lanes i and i + 4 of v added (after folding sixteen lanes to eight where vfloat has sixteen):
// the first level of vsum's tree.
inline vfloat4 fold4(vfloat v) {
#if defined(__AVX512F__)
  typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
  vfloat8 lo8, hi8;
  std::memcpy(&lo8, &v, sizeof(lo8));
  std::memcpy(&hi8, reinterpret_cast<const char*>(&v) + sizeof(lo8), sizeof(hi8));
  const vfloat8 e = lo8 + hi8;
#else
  const vfloat e = v;
#endif
  vfloat4 lo, hi;
  std::memcpy(&lo, &e, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&e) + sizeof(lo), sizeof(hi));
  return lo + hi;
}

// The lanes' sum as a tree: ((e0 + e4) + (e1 + e5)) + ((e2 + e6) + (e3 + e7)).
inline float vsum(vfloat v) {
  const vfloat4 h = fold4(v);
  return (h[0] + h[1]) + (h[2] + h[3]);
}

// The largest lane (exact in any order).
inline float vmax(vfloat v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float top = v[0];
  for (int64_t l = 1; l < kLanes; ++l) top = std::max(top, v[l]);
  return top;
#endif
}

// kLanes floats rounded to bf16 (to nearest even; NaN stays a quiet NaN), as c10 rounds: the bf16
// bits in the low half of each lane.
inline vuint vbf16_bits(vfloat v) {
  vuint bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const vuint rounded = (bits + (((bits >> 16) & 1) + 0x7FFFu)) >> 16;
  const vuint is_nan = reinterpret_cast<vuint>(v != v);  // all ones where NaN
  return (rounded & ~is_nan) | ((vuint{} + 0x7FC0u) & is_nan);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// With AVX512-BF16 one instruction rounds sixteen lanes to nearest even (NaN then keeps its sign
// and payload, so NaN lanes are set to c10's 0x7FC0 after).
inline __m256i vbf16_narrow(vfloat v) {
  const __m512 x = (__m512)v;
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(x);
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm256_mask_mov_epi16(rounded, is_nan, _mm256_set1_epi16(0x7FC0));
}

inline void vstore(c10::BFloat16* p, vfloat v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vbf16_narrow(v)); }

inline vfloat vround(vfloat v, c10::BFloat16 /*tag*/) {
  return (vfloat)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vbf16_narrow(v)), 16));
}
#else
// Store kLanes floats as bf16.
inline void vstore(c10::BFloat16* p, vfloat v) {
  const vhalf narrow = __builtin_convertvector(vbf16_bits(v), vhalf);
  std::memcpy(p, &narrow, sizeof(narrow));
}

inline vfloat vround(vfloat v, c10::BFloat16 /*tag*/) {
  const vuint wide = vbf16_bits(v) << 16;
  vfloat out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}
#endif

// Bytes of the widest vector register the build may use.
#if defined(__AVX512F__)
constexpr size_t kRegisterBytes = 64;
#elif defined(__AVX__)
constexpr size_t kRegisterBytes = 32;
#else
constexpr size_t kRegisterBytes = 16;
#endif

// v (a float or a vfloat) computed on its own: the empty asm keeps the compiler from fusing the
// operation that made v into a later add (-ffp-contract=fast), which would skip the rounding a
// torch op's stored fp32 result has. A value wider than a register goes through memory.
template <typename V>
inline V computed_alone(V v) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (sizeof(V) <= kRegisterBytes) {
    __asm__("" : "+x"(v));
  } else {
    __asm__("" : "+m"(v));
  }
#elif defined(__aarch64__)
  if constexpr (sizeof(V) <= kRegisterBytes) {
    __asm__("" : "+w"(v));
  } else {
    __asm__("" : "+m"(v));
  }
#else
  __asm__("" : "+m"(v));
#endif
  return v;
}

// v as stored in fp32 and read back: itself, computed on its own.
inline vfloat vround(vfloat v, float /*tag*/) { return computed_alone(v); }

// A row of n values into an fp32 buffer, whole vectors then a scalar tail.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = to_float(src[i]);
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

#if defined(__AVX512F__)
// Sixteen sums at once: lane p of the result is the sum of the lanes of a[4 * (p % 4) + p / 4].
// Four rounds of shuffles and adds halve the vectors each time (256-bit halves, 128-bit blocks,
// pairs, neighbours), so every sum adds lane l to lane l + 8, then l + 4, l + 2, l + 1: the
// same association for every vector, whatever the vectors beside it.
inline __m512 sum_lanes16(__m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  }
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}
#endif

}  // namespace srt_cpu
