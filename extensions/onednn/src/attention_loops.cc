// The decode step's attention for one KV head of one row in plain loops (MtpOnednnAttention's path for small
// calls): a decode or verify step's few query rows against the cache where it lies, reading only the row's valid
// entries. Three oneDNN primitives per call cost more than the arithmetic at these sizes (24 heads of
// one query over 128 positions: about 36 us in oneDNN, where the products take a few).
//
// Numbers as in the oneDNN path and pallas_kernels.verify_attention_reference: each score a float32 sum of
// exact products (bf16 x bf16 is exact in float32; lanes of 16 summed pairwise, so another order than
// oneDNN's), times `scale`; the softmax over a row's visible scores in float32 (peak, e^(x - peak) with
// vector_math.h's exponential, the sum, each weight divided by it and rounded once to the cache's dtype); the
// weighted sum in float32 over the row's valid entries (the later new tokens' weigh 0, so an Inf or NaN value
// there gives NaN, as in the reference), rounded once to the output's dtype. Entries at or past the row's
// length are never read, so stale cache entries (Inf, NaN) cannot reach it; a query that sees nothing, or
// whose visible scores are all -inf, gets zeros (but for such values). Each row's numbers are its own, whatever
// the other rows of the call. bf16 with whole 32-element head blocks on a CPU with AVX512-BF16 goes to
// attention_dpbf16.cc's loops instead (`Bf16DotProducts`); these ("the lanes") take the rest.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common.h"
#include "lanes.h"
#include "vector_math.h"

namespace {

using mtp_onednn::Bits;
using mtp_onednn::F16;
using mtp_onednn::kBlock;
using mtp_onednn::kLanes;
using mtp_onednn::Load16;
using mtp_onednn::Narrow;
using mtp_onednn::Softmax;
using mtp_onednn::Store16;
using mtp_onednn::Sum;
using mtp_onednn::U16;

// A block of 32 elements as two vectors. float32: the first and the last 16. bf16 (read as 16 uint32 pairs,
// the widening exact): the even elements, then the odd ones; `Interleaved` puts such a pair back in order.
struct Block {
  F16 lo, hi;
};

inline Block LoadBlock(const float* p) { return {Load16(p), Load16(p + kLanes)}; }

inline Block LoadBlock(const uint16_t* p) {
  U16 u;
  std::memcpy(&u, p, sizeof u);
  return {reinterpret_cast<F16>(u << 16), reinterpret_cast<F16>(u & 0xffff0000u)};
}

inline void StoreBlock(float* p, Block x, float) {
  Store16(p, x.lo);
  Store16(p + kLanes, x.hi);
}

inline void StoreBlock(float* p, Block x, uint16_t) {
  Store16(p, __builtin_shufflevector(x.lo, x.hi, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23));
  Store16(p + kLanes,
          __builtin_shufflevector(x.lo, x.hi, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31));
}

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) { return Bits(static_cast<uint32_t>(x) << 16); }

// q's n elements widened to float32 in `qf`, each whole block in LoadBlock's order (what Dot reads).
template <typename T>
__attribute__((always_inline)) inline void WidenQuery(const T* __restrict q, int64_t n, float* __restrict qf) {
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) StoreBlock(qf + i, LoadBlock(q + i), float{});
  for (; i < n; ++i) qf[i] = Widen(q[i]);
}

// qf (WidenQuery's) . b[0, n): exact products summed in float32.
template <typename T>
__attribute__((always_inline)) inline float Dot(const float* __restrict qf, const T* __restrict b, int64_t n) {
  F16 lo = {}, hi = {};
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Block x = LoadBlock(b + i);
    lo += Load16(qf + i) * x.lo;
    hi += Load16(qf + i + kLanes) * x.hi;
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += qf[i] * Widen(b[i]);
  return Sum(lo + hi) + tail;
}

// out[0, Dv) = sum over s < n of w[s] v[s], the value rows `stride` apart; two blocks at a time in registers.
template <typename T>
__attribute__((always_inline)) inline void WeightedSum(const float* __restrict w, const T* __restrict v,
                                                       int64_t n, int64_t Dv, int64_t stride,
                                                       float* __restrict out) {
  int64_t e = 0;
  for (; e + 2 * kBlock <= Dv; e += 2 * kBlock) {
    Block a = {}, b = {};
    for (int64_t s = 0; s < n; ++s) {
      Block x = LoadBlock(v + s * stride + e), y = LoadBlock(v + s * stride + e + kBlock);
      a.lo += w[s] * x.lo;
      a.hi += w[s] * x.hi;
      b.lo += w[s] * y.lo;
      b.hi += w[s] * y.hi;
    }
    StoreBlock(out + e, a, T{});
    StoreBlock(out + e + kBlock, b, T{});
  }
  for (; e + kBlock <= Dv; e += kBlock) {
    Block a = {};
    for (int64_t s = 0; s < n; ++s) {
      Block x = LoadBlock(v + s * stride + e);
      a.lo += w[s] * x.lo;
      a.hi += w[s] * x.hi;
    }
    StoreBlock(out + e, a, T{});
  }
  for (; e < Dv; ++e) {
    float a = 0.0f;
    for (int64_t s = 0; s < n; ++s) a += w[s] * Widen(v[s * stride + e]);
    out[e] = a;
  }
}

inline void Put(float* p, float x) { *p = x; }
inline void Put(uint16_t* p, float x) { *p = static_cast<uint16_t>(mtp_onednn::RoundBf16(x) >> 16); }

template <typename T>
__attribute__((always_inline)) inline void Attend(const T* __restrict q, const T* __restrict k,
                                                  const T* __restrict v, int64_t M, int64_t J, int64_t H,
                                                  int64_t D, int64_t Dv, int64_t k_stride, int64_t v_stride,
                                                  const int64_t* visible, float scale, float* __restrict scores,
                                                  int64_t S, float* __restrict work, T* __restrict out) {
  float* qf = work;
  float* sum = work + D;
  int64_t valid = 0;  // the row's valid entries (the last new token sees them all)
  for (int64_t m = 0; m < M; ++m) valid = visible[m] > valid ? visible[m] : valid;
  for (int64_t m = 0; m < M; ++m) {
    int64_t t = m / J, j = m % J;  // new token t's query head j of this KV head's J
    WidenQuery(q + (t * H + j) * D, D, qf);
    float* x = scores + m * S;
    for (int64_t s = 0; s < visible[m]; ++s) x[s] = Dot(qf, k + s * k_stride, D) * scale;
    Softmax<T>(x, visible[m]);
    // The later new tokens' entries weigh exactly 0 here but are summed, as in the reference (an Inf or NaN
    // value there gives NaN); stale entries, at or past the row's length, are never read.
    for (int64_t s = visible[m]; s < valid; ++s) x[s] = 0.0f;
    WeightedSum(x, v, valid, Dv, v_stride, sum);
    T* o = out + (t * H + j) * Dv;
    for (int64_t e = 0; e < Dv; ++e) Put(o + e, sum[e] + 0.0f);  // a zero sum is +0, as in attention_dpbf16.cc
  }
}

}  // namespace

namespace mtp_onednn {

MTP_CLONES void AttendBf16Lanes(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t M, int64_t J,
                                int64_t H, int64_t D, int64_t Dv, int64_t k_stride, int64_t v_stride,
                                const int64_t* visible, float scale, float* scores, int64_t S, float* work,
                                uint16_t* out) {
  Attend(q, k, v, M, J, H, D, Dv, k_stride, v_stride, visible, scale, scores, S, work, out);
}

bool Bf16DotProducts(int64_t D, int64_t Dv) {
  // the CPU has AVX512-BF16, and ONEDNN_MAX_CPU_ISA does not stop below it
  static const bool allowed = __builtin_cpu_supports("avx512bf16") && MaxIsaAllows("AVX512_CORE_BF16");
  return allowed && D % kBlock == 0 && Dv % kBlock == 0;
}

void AttendBf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t M, int64_t J, int64_t H, int64_t D,
                int64_t Dv, int64_t k_stride, int64_t v_stride, const int64_t* visible, float scale, float* scores,
                int64_t S, float* work, uint16_t* out) {
  if (Bf16DotProducts(D, Dv))
    AttendBf16Dp(q, k, v, M, J, H, D, Dv, k_stride, v_stride, visible, scale, scores, S, out);
  else
    AttendBf16Lanes(q, k, v, M, J, H, D, Dv, k_stride, v_stride, visible, scale, scores, S, work, out);
}

MTP_CLONES void AttendF32(const float* q, const float* k, const float* v, int64_t M, int64_t J, int64_t H, int64_t D,
                          int64_t Dv, int64_t k_stride, int64_t v_stride, const int64_t* visible, float scale,
                          float* scores, int64_t S, float* work, float* out) {
  Attend(q, k, v, M, J, H, D, Dv, k_stride, v_stride, visible, scale, scores, S, work, out);
}

}  // namespace mtp_onednn
