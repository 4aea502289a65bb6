// attention_loops.cc's loops for bf16 on CPUs with AVX512-BF16 (Zen 4 and 5, Xeon since Cooper Lake): VDPBF16PS
// multiplies 32 bf16 pairs and adds them pairwise into 16 float32 lanes, each product exact, so a 64-wide head
// is two instructions per position, with no widening. Inputs below 2^-126 are read as 0 and results below it
// flushed to 0, as XLA:CPU flushes (and as oneDNN's bf16 matmuls on these CPUs compute). Taken for D and Dv
// multiples of 32 (`Bf16DotProducts`); numbers as attention_loops.cc describes, in another summation order.
//
// Per KV head of a row: the scores 16 positions at a time, the block outer so that its keys stay in L1 for
// every query row (one vector of partial sums per position, summed across lanes by Sum16); each row's
// softmax (lanes.h) and its weights packed as bf16 pairs of positions; the weighted sum for up to 4 rows at a
// time, each block of values loaded once for the 4. On Zen 5 (one thread, 64-wide heads) 1.7-3.0 ns per
// (query row, position) against 4-5.3 ns in attention_loops.cc's lanes, and faster than oneDNN's three
// primitives up to 64 rows per KV head (docs/benchmarks.md, 2026-12-07).

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "common.h"
#include "lanes.h"
#include "vector_math.h"

namespace mtp_onednn {
namespace {

// Lane i: the sum of p[i]'s 16 lanes, pairwise in one fixed order (halves, quarters, pairs, neighbours): 16
// horizontal sums for 30 shuffles.
__attribute__((always_inline)) inline F16 Sum16(const F16* p) {
  F16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 8r .. 8r + 7: p[2i + r]'s halves summed
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // lanes 4r .. 4r + 3: p[4i + r]'s quarters
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // lanes 2r, 2r + 1: p[8i + r]'s pairs
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#define MTP_AVX512_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")))

inline __m512bh Pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// out_r[0, Dv) = sum over s < n of w_r[s] v[s] for R rows at once, C blocks of 32 columns per pass, each block
// of values loaded once for the R rows: positions s, s + 1 interleaved (unpack) against the rows' weights as
// bf16 pairs (`weights[r][s / 2]`), the one past n read as zeros; the sums rounded once to bf16. Each row's
// numbers do not depend on R (nor on the other rows): a query gets the same bits in a decode step as in a verify
// window.
template <int R, int C>
MTP_AVX512_BF16 inline void WeightedSumDp(const uint32_t* const* weights, const uint16_t* __restrict v, int64_t n,
                                          int64_t Dv, int64_t stride, uint16_t* const* out) {
  for (int64_t e = 0; e < Dv; e += C * kBlock) {
    __m512 acc[R][2 * C];  // [r][2c]: lane 4l + i is column 8l + i of block c, [r][2c + 1] column 8l + 4 + i
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2 * C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s += 2) {
      for (int c = 0; c < C; ++c) {
        const uint16_t* x = v + s * stride + e + c * kBlock;
        __m512i a = _mm512_loadu_si512(x);
        __m512i b = s + 1 < n ? _mm512_loadu_si512(x + stride) : _mm512_setzero_si512();
        __m512bh l = Pairs(_mm512_unpacklo_epi16(a, b)), h = Pairs(_mm512_unpackhi_epi16(a, b));
        for (int r = 0; r < R; ++r) {
          __m512bh w = Pairs(_mm512_set1_epi32(static_cast<int>(weights[r][s / 2])));
          acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], l, w);
          acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], h, w);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) {
        F16 x = acc[r][2 * c], y = acc[r][2 * c + 1];
        F16 first = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
        F16 second = __builtin_shufflevector(x, y, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
        first += 0.0f;  // a zero sum is +0: products flushed to -0 would otherwise give -0 or +0 as the row's
        second += 0.0f;  // later (weight 0) entries are there or not
        uint16_t* o = out[r] + e + c * kBlock;
        for (int i = 0; i < kLanes; ++i) o[i] = static_cast<uint16_t>(RoundBf16(first[i]) >> 16);
        for (int i = 0; i < kLanes; ++i) o[kLanes + i] = static_cast<uint16_t>(RoundBf16(second[i]) >> 16);
      }
  }
}

template <int C>
MTP_AVX512_BF16 inline void WeightedSumDpRows(int64_t R, const uint32_t* const* weights, const uint16_t* v,
                                              int64_t n, int64_t Dv, int64_t stride, uint16_t* const* out) {
  switch (R) {
    case 4: return WeightedSumDp<4, C>(weights, v, n, Dv, stride, out);
    case 3: return WeightedSumDp<3, C>(weights, v, n, Dv, stride, out);
    case 2: return WeightedSumDp<2, C>(weights, v, n, Dv, stride, out);
    default: return WeightedSumDp<1, C>(weights, v, n, Dv, stride, out);
  }
}

// Query row qm's scores (unscaled) against the keys of n <= 16 positions from k (lanes past n: 0): a vector of
// partial sums per position (VDPBF16PS over NQ blocks of 32, 0: D / 32 at run time), summed across lanes by Sum16.
template <int NQ>
MTP_AVX512_BF16 inline F16 ScoresDp(const uint16_t* __restrict qm, const uint16_t* __restrict k, int64_t n,
                                    int64_t k_stride, int64_t D) {
  const int64_t blocks = NQ ? NQ : D / kBlock;
  __m512bh qv[NQ ? NQ : 1];  // NQ > 0: the query's blocks held in registers; 0: loaded per position
  for (int c = 0; c < NQ; ++c) qv[c] = Pairs(_mm512_loadu_si512(qm + c * kBlock));
  F16 p[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; i < n && c < blocks; ++c) {
      __m512bh query;
      if constexpr (NQ > 0)
        query = qv[c];
      else
        query = Pairs(_mm512_loadu_si512(qm + c * kBlock));
      acc = _mm512_dpbf16_ps(acc, query, Pairs(_mm512_loadu_si512(k + i * k_stride + c * kBlock)));
    }
    p[i] = acc;
  }
  return Sum16(p);
}

// x[0, n), each a bf16 value held as float32, -> the pairs (x[2j] low, x[2j + 1] high; 0 past n) as uint32 in
// x[0, (n + 1) / 2), in place (each pair written after the values it is made of were read).
MTP_AVX512_BF16 inline void PackPairs(float* x, int64_t n) {
  int64_t j = 0;
  for (; 2 * j + kBlock <= n; j += kLanes) {
    U16 a, b;
    std::memcpy(&a, x + 2 * j, sizeof a);
    std::memcpy(&b, x + 2 * j + kLanes, sizeof b);
    U16 even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    U16 odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    U16 pairs = (even >> 16) | (odd & 0xffff0000u);
    std::memcpy(x + j, &pairs, sizeof pairs);
  }
  for (; 2 * j < n; ++j) {
    uint32_t pair = Bits(x[2 * j]) >> 16 | (2 * j + 1 < n ? Bits(x[2 * j + 1]) & 0xffff0000u : 0u);
    std::memcpy(x + j, &pair, sizeof pair);
  }
}

}  // namespace

// AttendBf16 (common.h) with VDPBF16PS, for D and Dv multiples of 32.
MTP_AVX512_BF16 void AttendBf16Dp(const uint16_t* __restrict q, const uint16_t* __restrict k,
                                  const uint16_t* __restrict v, int64_t M, int64_t J, int64_t H, int64_t D, int64_t Dv,
                                  int64_t k_stride, int64_t v_stride, const int64_t* visible, float scale,
                                  float* __restrict scores, int64_t S, uint16_t* __restrict out) {
  int64_t valid = 0;  // the row's valid entries (the last new token sees them all)
  for (int64_t m = 0; m < M; ++m) valid = visible[m] > valid ? visible[m] : valid;
  for (int64_t s0 = 0; s0 < valid; s0 += kLanes) {
    const int64_t n = valid - s0 < kLanes ? valid - s0 : kLanes;
    for (int64_t m = 0; m < M; ++m) {
      const uint16_t* qm = q + (m / J * H + m % J) * D;
      const uint16_t* ks = k + s0 * k_stride;
      F16 x = (D == 2 * kBlock   ? ScoresDp<2>(qm, ks, n, k_stride, D)
               : D == 4 * kBlock ? ScoresDp<4>(qm, ks, n, k_stride, D)
                                 : ScoresDp<0>(qm, ks, n, k_stride, D)) *
              scale;
      float* row = scores + m * S + s0;
      if (n == kLanes)
        Store16(row, x);
      else
        for (int64_t i = 0; i < n; ++i) row[i] = x[i];
    }
  }
  uint16_t* rows[4];
  const uint32_t* weights[4];
  for (int64_t m = 0; m < M; ++m) {
    float* x = scores + m * S;
    Softmax<uint16_t>(x, visible[m]);
    for (int64_t s = visible[m]; s < valid; ++s) x[s] = 0.0f;  // the later new tokens' entries: weight 0, summed
    PackPairs(x, valid);
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t R = M - m0 < 4 ? M - m0 : 4;
    for (int64_t r = 0; r < R; ++r) {
      int64_t m = m0 + r;
      rows[r] = out + (m / J * H + m % J) * Dv;
      weights[r] = reinterpret_cast<const uint32_t*>(scores + m * S);
    }
    if (Dv % (2 * kBlock) == 0)
      WeightedSumDpRows<2>(R, weights, v, valid, Dv, v_stride, rows);
    else
      WeightedSumDpRows<1>(R, weights, v, valid, Dv, v_stride, rows);
  }
}

}  // namespace mtp_onednn
