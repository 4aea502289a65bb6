// mtp_jax_onednn: what a decode step reads of its logits over the vocabulary, in one XLA FFI call (no oneDNN
// here). XLA:CPU's reductions over a row of a few thousand logits run far from the memory bound (its argmax, a
// max then the lowest index holding it, and the log-sum-exp: 0.1-0.5 ms a step for 8 rows of 4096-32000).
//
//   MtpVocabStats(processed f32 [N, V], raw f32|bf16 [N, V]; log_sum: bool)
//       -> (argmax s32 [N], peak f32 [N], log_sum f32 [N])
//
// argmax[n]: the lowest index of processed[n]'s maximum, or of its first NaN if it holds one (ranked above every
// number), as `mtp_jax.sharding.vocab_argmax`. peak[n]: max(raw[n]) (NaN if it holds one), and log_sum[n]:
// log(sum(exp(raw[n] - peak[n]))), so that raw's log-softmax is (raw - peak) - log_sum, as `jax.nn.log_softmax`
// computes it: the same special values (all -inf or a +inf: NaN), the sum in another order and the exponential
// to its last bit. With log_sum false (a draft's argmax only), peak and log_sum are left unwritten and raw is
// not read. Rows are independent: a row's results do not depend on the others in the call. The AVX-512 loops run
// where the CPU has AVX-512 and ONEDNN_MAX_CPU_ISA (read once, when the library loads) allows AVX512_CORE.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <immintrin.h>

#include "common.h"
#include "lanes.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace mtp_onednn {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

inline float Widen(float x) { return x; }
inline float Widen(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float y;
  std::memcpy(&y, &bits, sizeof y);
  return y;
}

// x[0, n)'s maximum, NaN if any element is NaN: 16 running maxima and a NaN flag per lane.
template <typename T>
__attribute__((always_inline)) inline float Peak(const T* x, int64_t n) {
  F16 lanes = {};
  lanes -= kInf;
  F16 nan = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    F16 y;
    for (int j = 0; j < kLanes; ++j) y[j] = Widen(x[i + j]);
    lanes = y > lanes ? y : lanes;
    nan = y != y ? y : nan;
  }
  float peak = -kInf;
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) {
    peak = lanes[j] > peak ? lanes[j] : peak;
    any_nan |= nan[j] != nan[j];
  }
  for (; i < n; ++i) {
    const float y = Widen(x[i]);
    peak = y > peak ? y : peak;
    any_nan |= y != y;
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : peak;
}

// The lowest index of x[0, n)'s maximum `peak`, or of its first NaN if `peak` is NaN (n if none): blocks of 16
// compared at once until one holds it.
__attribute__((always_inline)) inline int64_t FirstAt(const float* x, int64_t n, float peak) {
  const bool nan = peak != peak;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    int hit = 0;
    for (int j = 0; j < kLanes; ++j) hit |= nan ? x[i + j] != x[i + j] : x[i + j] == peak;
    if (hit) break;
  }
  for (; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == peak) return i;
  return n;
}

// log(sum(exp(x[0, n) - peak))): the exponentials a chunk at a time into `scratch` (a loop GCC vectorises), summed
// into 16 lanes in one fixed order.
template <typename T>
__attribute__((always_inline)) inline float LogSum(const T* x, int64_t n, float peak) {
  constexpr int64_t kChunk = 1024;
  alignas(64) float scratch[kChunk];
  F16 sums = {};
  float tail = 0.0f;
  for (int64_t begin = 0; begin < n; begin += kChunk) {
    const int64_t m = n - begin < kChunk ? n - begin : kChunk;
    for (int64_t i = 0; i < m; ++i) scratch[i] = Exp(Widen(x[begin + i]) - peak);
    int64_t i = 0;
    for (; i + kLanes <= m; i += kLanes) sums += Load16(scratch + i);
    for (; i < m; ++i) tail += scratch[i];
  }
  return std::log(Sum(sums) + tail);
}

template <typename T>
__attribute__((always_inline)) inline void Stats(const float* processed, const T* raw, int64_t N, int64_t V,
                                                  bool log_sum, int32_t* argmax, float* peak, float* sums) {
  for (int64_t n = 0; n < N; ++n) {
    argmax[n] = static_cast<int32_t>(FirstAt(processed + n * V, V, Peak(processed + n * V, V)));
    if (log_sum) {
      peak[n] = Peak(raw + n * V, V);
      sums[n] = LogSum(raw + n * V, V, peak[n]);
    }
  }
}

// The same three with AVX-512 intrinsics (any AVX-512 CPU: Skylake-SP and later, Zen 4 and later), where GCC's
// vectorisation of the loops above leaves most of their work scalar.
#define MTP_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2")))

MTP_AVX512 inline __m512 Load512(const float* p) { return _mm512_loadu_ps(p); }
MTP_AVX512 inline __m512 Load512(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <typename T>
MTP_AVX512 inline float Peak512(const T* x, int64_t n) {
  __m512 lanes = _mm512_set1_ps(-kInf);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    __m512 y = Load512(x + i);
    lanes = _mm512_max_ps(y, lanes);  // a NaN y gives lanes (the second operand): flagged apart
    nan |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  }
  float peak = _mm512_reduce_max_ps(lanes);
  bool any_nan = nan != 0;
  for (; i < n; ++i) {
    const float y = Widen(x[i]);
    peak = y > peak ? y : peak;
    any_nan |= y != y;
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : peak;
}

MTP_AVX512 inline int64_t FirstAt512(const float* x, int64_t n, float peak) {
  const bool nan = peak != peak;
  const __m512 p = _mm512_set1_ps(peak);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    __m512 y = _mm512_loadu_ps(x + i);
    __mmask16 hit = nan ? _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(y, p, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (nan ? x[i] != x[i] : x[i] == peak) return i;
  return n;
}

// ExpInRange's steps (vector_math.h) on 16 lanes, clamped as Exp: 0 below -88 (and for -inf), +inf above 88,
// NaN for NaN (min / max return their second operand for a NaN: t is kept).
MTP_AVX512 inline __m512 Exp512(__m512 t) {
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  __m512 c = _mm512_max_ps(_mm512_set1_ps(-88.0f), _mm512_min_ps(_mm512_set1_ps(88.0f), t));
  __m512 k = _mm512_fmadd_ps(c, _mm512_set1_ps(1.44269504088896341f), shift);
  __m512i n = _mm512_sub_epi32(_mm512_castps_si512(k), _mm512_castps_si512(shift));
  k = _mm512_sub_ps(k, shift);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), c);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(1.9875691500e-4f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 e = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(q, r), r, r), _mm512_set1_ps(1.0f));
  __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
  e = _mm512_mul_ps(e, scale);
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t, _mm512_set1_ps(88.0f), _CMP_GT_OQ), e, _mm512_set1_ps(kInf));
}

template <typename T>
MTP_AVX512 inline float LogSum512(const T* x, int64_t n, float peak) {
  const __m512 p = _mm512_set1_ps(peak);
  __m512 sums = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) sums = _mm512_add_ps(sums, Exp512(_mm512_sub_ps(Load512(x + i), p)));
  float tail = 0.0f;
  for (; i < n; ++i) tail += Exp(Widen(x[i]) - peak);
  return std::log(_mm512_reduce_add_ps(sums) + tail);
}

template <typename T>
MTP_AVX512 void Stats512(const float* processed, const T* raw, int64_t N, int64_t V, bool log_sum, int32_t* argmax,
                         float* peak, float* sums) {
  for (int64_t n = 0; n < N; ++n) {
    argmax[n] = static_cast<int32_t>(FirstAt512(processed + n * V, V, Peak512(processed + n * V, V)));
    if (log_sum) {
      peak[n] = Peak512(raw + n * V, V);
      sums[n] = LogSum512(raw + n * V, V, peak[n]);
    }
  }
}

}  // namespace

MTP_CLONES void StatsBf16(const float* processed, const uint16_t* raw, int64_t N, int64_t V, bool log_sum,
                          int32_t* argmax, float* peak, float* sums) {
  Stats(processed, raw, N, V, log_sum, argmax, peak, sums);
}

MTP_CLONES void StatsF32(const float* processed, const float* raw, int64_t N, int64_t V, bool log_sum,
                         int32_t* argmax, float* peak, float* sums) {
  Stats(processed, raw, N, V, log_sum, argmax, peak, sums);
}

// The CPU has AVX-512 (F, BW, DQ, VL: oneDNN's AVX512_CORE), and ONEDNN_MAX_CPU_ISA does not stop below it.
static const bool kAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                            MaxIsaAllows("AVX512_CORE");

template <typename T>
void VocabStats(const float* processed, const T* raw, int64_t N, int64_t V, bool log_sum, int32_t* argmax, float* peak,
                float* sums) {
  if (kAvx512)
    Stats512(processed, raw, N, V, log_sum, argmax, peak, sums);
  else if constexpr (sizeof(T) == 2)
    StatsBf16(processed, raw, N, V, log_sum, argmax, peak, sums);
  else
    StatsF32(processed, raw, N, V, log_sum, argmax, peak, sums);
}

}  // namespace mtp_onednn

static ffi::Error VocabStatsImpl(ffi::Buffer<ffi::F32> processed, ffi::AnyBuffer raw, bool log_sum,
                                 ffi::Result<ffi::Buffer<ffi::S32>> argmax, ffi::Result<ffi::Buffer<ffi::F32>> peak,
                                 ffi::Result<ffi::Buffer<ffi::F32>> sums) {
  const auto dims = processed.dimensions();
  if (dims.size() < 1 || dims.back() == 0) {
    return ffi::Error::InvalidArgument("MtpVocabStats: processed [..., V] with V > 0 expected");
  }
  const int64_t V = dims.back(), N = processed.element_count() / V;
  const bool bf16 = raw.element_type() == ffi::DataType::BF16;
  const auto count = static_cast<size_t>(N);
  if (argmax->element_count() != count || peak->element_count() != count || sums->element_count() != count ||
      (log_sum && (raw.element_count() != count * static_cast<size_t>(V) || !(bf16 || raw.element_type() == ffi::DataType::F32)))) {
    return ffi::Error::InvalidArgument("MtpVocabStats: raw [N, V] float32 or bfloat16 and results [N] expected");
  }
  int32_t* a = argmax->typed_data();
  float *p = peak->typed_data(), *s = sums->typed_data();
  // Each thread takes whole rows (a row's numbers never depend on the split); small calls stay on this thread.
  const int64_t threads = N * V >= (int64_t{1} << 16) ? std::min<int64_t>(mtp_onednn::Threads(), N) : 1;
  const int64_t per = (N + threads - 1) / threads;
  auto rows = [&](int64_t t) {
    const int64_t begin = std::min(N, t * per), count = std::min(N, begin + per) - begin;
    const float* x = processed.typed_data() + begin * V;
    if (bf16)
      mtp_onednn::VocabStats(x, static_cast<const uint16_t*>(raw.untyped_data()) + begin * V, count, V, log_sum,
                            a + begin, p + begin, s + begin);
    else
      mtp_onednn::VocabStats(x, static_cast<const float*>(raw.untyped_data()) + begin * V, count, V, log_sum, a + begin,
                           p + begin, s + begin);
  };
  if (threads == 1)
    rows(0);
  else
    mtp_onednn::ParallelFor(threads, rows);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpVocabStats, VocabStatsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("log_sum")
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
