// SwiGLU over interleaved (gate, up) pairs, as mtp_jax.layers.ffn.swiglu computes it: silu(g) = g / (1 + e^-g)
// in float32, for bf16 rounded once to bf16, then times up and rounded once (the product of two bf16 values is
// exact in float32). e^x: Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial for expf (within about
// one float32 ulp), written without branches so that the loops vectorise (built with -fno-trapping-math, which
// lets the compiler turn the clamps into selects; results are unchanged). XLA:CPU computes this SwiGLU after
// the gate_up matmul at about 4 ns an element (a fusion through float32 conversions); these loops at a small
// fraction of that, in the same call as the matmul (MtpOnednnMatmulSwiglu).

#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

inline float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// 1 / (1 + e^-g): 0 from g <= -88 (XLA's float32 is 0 there too once denormals flush, so silu(-inf) is NaN
// in both), 1 from g >= 88. A NaN g gives a bound here, and the caller's g * Sigmoid(g) is NaN all the same.
inline float Sigmoid(float g) {
  float t = -g;
  float zero = t >= 88.0f ? 1.0f : 0.0f;
  t = t > 88.0f ? 88.0f : t;
  t = t < -88.0f ? -88.0f : t;
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float k = t * 1.44269504088896341f + kShift;
  int32_t n = static_cast<int32_t>(Bits(k) - Bits(kShift));
  k -= kShift;
  float r = t - k * 0.693359375f;  // ln 2 in two parts
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float e = (p * r * r + r + 1.0f) * Bits(static_cast<uint32_t>(n + 127) << 23);
  return zero != 0.0f ? 0.0f : 1.0f / (1.0f + e);
}

// float32 -> bf16 (in the high half) by round to nearest even, as XLA converts; a NaN stays a quiet NaN.
inline uint32_t RoundBf16(float f) {
  uint32_t u = Bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  uint32_t nan = (u | 0x00400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

}  // namespace

// One copy of each loop for AVX-512 (x86-64-v4), AVX2 (v3) and baseline x86-64, picked when the library loads.
#define MTP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

namespace mtp_onednn {

MTP_CLONES void SwigluBf16(const uint32_t* __restrict pairs, uint16_t* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {  // a pair's gate is its low half (column 2i), its up the high one
    float gate = Bits(pairs[i] << 16), up = Bits(pairs[i] & 0xffff0000u);
    float silu = Bits(RoundBf16(gate * Sigmoid(gate)));
    y[i] = static_cast<uint16_t>(RoundBf16(silu * up) >> 16);
  }
}

MTP_CLONES void SwigluF32(const float* __restrict pairs, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = pairs[2 * i] * Sigmoid(pairs[2 * i]) * pairs[2 * i + 1];
}

}  // namespace mtp_onednn
