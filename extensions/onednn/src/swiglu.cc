// SwiGLU over interleaved (gate, up) pairs, as mtp_jax.layers.ffn.swiglu computes it: silu(g) = g / (1 + e^-g)
// in float32, for bf16 rounded once to bf16, then times up and rounded once (the product of two bf16 values is
// exact in float32); e^x is vector_math.h's. XLA:CPU computes this SwiGLU after the gate_up matmul at about
// 4 ns an element (a fusion through float32 conversions); these loops at a small fraction of that, in the same
// call as the matmul (MtpOnednnMatmulSwiglu).

#include <cstdint>

#include "common.h"
#include "vector_math.h"

namespace {

using mtp_onednn::Bits;

// 1 / (1 + e^-g): 0 from g <= -88 (XLA's float32 is 0 there too once denormals flush, so silu(-inf) is NaN
// in both), 1 from g >= 88. A NaN g gives a bound here, and the caller's g * Sigmoid(g) is NaN all the same.
inline float Sigmoid(float g) {
  float t = -g;
  float zero = t >= 88.0f ? 1.0f : 0.0f;
  t = t > 88.0f ? 88.0f : t;
  t = t < -88.0f ? -88.0f : t;
  float e = mtp_onednn::ExpInRange(t);
  return zero != 0.0f ? 0.0f : 1.0f / (1.0f + e);
}

}  // namespace

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
