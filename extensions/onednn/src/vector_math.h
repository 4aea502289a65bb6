// The scalar float32 pieces that swiglu.cc's and attention_loops.cc's loops share, written so that GCC
// vectorises the loops they sit in (no branches, no calls; the files are built with -fno-trapping-math, which
// lets the compiler turn the clamps into selects without changing a result), and the macro that clones a
// loop for AVX-512 (x86-64-v4), AVX2 (v3) and baseline x86-64, picked when the library loads.
#pragma once

#include <cstdint>
#include <cstring>

#define MTP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

namespace mtp_onednn {

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

// e^t for t in [-88, 88] (the caller clamps): Cody-Waite reduction by ln 2 and Cephes' degree-6 polynomial
// for expf, within about one float32 ulp; 0 at the bottom of the range (2^-127 is no float32 scale). A NaN t
// gives NaN.
inline float ExpInRange(float t) {
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
  return (p * r * r + r + 1.0f) * Bits(static_cast<uint32_t>(n + 127) << 23);
}

// float32 -> bf16 (in the high half) by round to nearest even, as XLA converts; a NaN stays a quiet NaN.
inline uint32_t RoundBf16(float f) {
  uint32_t u = Bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  uint32_t nan = (u | 0x00400000u) & 0xffff0000u;
  return (u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

}  // namespace mtp_onednn
