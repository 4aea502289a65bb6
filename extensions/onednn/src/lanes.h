// The 16-lane float32 vectors (GCC vector extensions) and the softmax that both of the extension's attention
// loops use: attention_loops.cc's for any x86-64 (cloned per ISA) and attention_dpbf16.cc's for AVX512-BF16.
// Internal linkage: each file gets its own copy, compiled for the functions it is inlined into.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vector_math.h"

namespace mtp_onednn {
namespace {

// 16 float32 lanes (one AVX-512 register, two AVX2 ones, four SSE ones: GCC splits the vector per clone).
typedef float F16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16, kBlock = 2 * kLanes;

inline F16 Load16(const float* p) {
  F16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void Store16(float* p, F16 x) { std::memcpy(p, &x, sizeof x); }

// A softmax weight in the operands' precision: float32 as it is, bf16 rounded to nearest even.
inline float Narrow(float x, float) { return x; }
inline float Narrow(float x, uint16_t) { return Bits(RoundBf16(x)); }

__attribute__((always_inline)) inline float Sum(F16 x) {  // pairwise, one fixed order
  x += __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += __builtin_shufflevector(x, x, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
  x += __builtin_shufflevector(x, x, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
  return x[0] + x[1];
}

// e^t: 0 below -88 (and for -inf), +inf above 88, NaN for NaN.
inline float Exp(float t) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float c = t > 88.0f ? 88.0f : t;
  c = c < -88.0f ? -88.0f : c;
  float e = ExpInRange(c);
  return t > 88.0f ? kInf : e;
}

// x[0, n) -> their softmax, each weight narrowed to T's precision.
template <typename T>
__attribute__((always_inline)) inline void Softmax(float* __restrict x, int64_t n) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  F16 lanes = {};
  lanes -= kInf;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    F16 y = Load16(x + i);
    lanes = y > lanes ? y : lanes;
  }
  float peak = -kInf;
  for (int j = 0; j < kLanes; ++j) peak = lanes[j] > peak ? lanes[j] : peak;
  for (; i < n; ++i) peak = x[i] > peak ? x[i] : peak;
  if (!std::isfinite(peak)) peak = 0.0f;  // as the reference: all -inf gives zeros, +inf NaN
  for (i = 0; i < n; ++i) x[i] = Exp(x[i] - peak);
  F16 sums = {};
  for (i = 0; i + kLanes <= n; i += kLanes) sums += Load16(x + i);
  float tail = 0.0f;
  for (; i < n; ++i) tail += x[i];
  float sum = Sum(sums) + tail;
  float denom = sum > 0.0f ? sum : 1.0f;
  for (i = 0; i < n; ++i) x[i] = Narrow(x[i] / denom, T{});
}

}  // namespace
}  // namespace mtp_onednn
