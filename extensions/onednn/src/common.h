// What the handlers of onednn_matmul.cc and onednn_attention.cc share: the CPU engine, the dtypes they
// take, the thread knobs read from the environment, their primitive caches' lookup, and swiglu.cc's loops.
#pragma once

#include <cctype>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

#include <omp.h>
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr: the extension is built for x86-64 only

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace mtp_onednn {

struct Ctx {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
};

inline Ctx& ctx() {
  static Ctx* c = new Ctx();  // never destroyed: no destruction-order issues at exit
  return *c;
}

// A positive integer from the environment, else `fallback` (unset, 0 or garbage keep the default).
inline int64_t EnvInt(const char* name, int64_t fallback) {
  const char* s = std::getenv(name);
  int64_t v = s ? std::atoll(s) : 0;
  return v > 0 ? v : fallback;
}

// Whether ONEDNN_MAX_CPU_ISA (or its older name DNNL_MAX_CPU_ISA, as oneDNN reads them) leaves the extension's own
// loops for `isa` on: unset, or naming `isa` or an ISA above it in oneDNN's order (an unknown name: on).
inline bool MaxIsaAllows(const char* isa) {
  static const char* const kOrder[] = {"SSE41",       "AVX",         "AVX2",           "AVX2_VNNI",
                                       "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16"};
  const char* env = std::getenv("ONEDNN_MAX_CPU_ISA");
  if (!env) env = std::getenv("DNNL_MAX_CPU_ISA");
  std::string max = env ? env : "";
  for (char& c : max) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  for (const char* name : kOrder) {
    if (std::strcmp(name, isa) == 0) return true;
    if (max == name) return false;
  }
  return true;
}

// The OpenMP threads of a call that uses more than one: MTP_JAX_ONEDNN_THREADS, default OMP_NUM_THREADS (its
// first number), else every core this process may run on. Not omp_get_max_threads(): that is the calling
// thread's own count, which a small call before may have set to 1.
inline int Threads() {
  static const int threads =
      static_cast<int>(EnvInt("MTP_JAX_ONEDNN_THREADS", EnvInt("OMP_NUM_THREADS", omp_get_num_procs())));
  return threads;
}

// The multiply-adds from which a call is worth every core: MTP_JAX_ONEDNN_PARALLEL_MACS, default 8 Mi.
inline int64_t ParallelMacs() {
  static const int64_t macs = EnvInt("MTP_JAX_ONEDNN_PARALLEL_MACS", 8 << 20);
  return macs;
}

// Whether a oneDNN call runs on every core (else one thread): an operand streamed from memory of
// MTP_JAX_ONEDNN_PARALLEL_BYTES (default 2 MiB) or more, or of 1 MiB or more in a call of ParallelMacs()
// multiply-adds or more. A small call is done sooner than OpenMP wakes its workers, and idle workers spin,
// taking cores from XLA's own pool (docs/benchmarks.md, 2026-12-07).
inline bool EveryCore(size_t bytes, int64_t macs) {
  static const size_t parallel_bytes = EnvInt("MTP_JAX_ONEDNN_PARALLEL_BYTES", 2 << 20);
  constexpr size_t kMinParallelBytes = 1 << 20;
  return bytes >= parallel_bytes || (bytes >= kMinParallelBytes && macs >= ParallelMacs());
}

// body(i) for i in [0, n) on Threads() OpenMP workers, split evenly. XLA runs with denormals flushed (MXCSR's
// FTZ / DAZ); OpenMP's workers keep the mode of wherever they were created, so each takes the calling thread's
// for the loop (else, e.g., a sigmoid below 2^-126 is kept on some rows and flushed on others).
template <typename Body>
void ParallelFor(int64_t n, Body body) {
  const unsigned int mode = _mm_getcsr();
#pragma omp parallel num_threads(Threads())
  {
    const unsigned int own = _mm_getcsr();
    _mm_setcsr(mode);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
    _mm_setcsr(own);
  }
}

// The value cached under `key`, made by `make()` on its first call. `make` runs outside the lock (creating a
// oneDNN primitive takes a while): two threads may both make one, and the first one stored is kept. A cache
// holding kMaxCached entries starts over (a process meeting ever new shapes; values handed out stay valid:
// they are shared_ptrs or descriptors held by value).
constexpr size_t kMaxCached = 1024;

template <typename Map, typename Make>
typename Map::mapped_type Cached(Map& cache, std::mutex& mu, const typename Map::key_type& key, Make make) {
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  auto value = make();
  std::lock_guard<std::mutex> lock(mu);
  if (cache.size() >= kMaxCached) cache.clear();
  return cache.emplace(key, std::move(value)).first->second;
}

// bf16 and f32 map to oneDNN's types; false for any other.
inline bool DataType(xla::ffi::DataType et, dnnl::memory::data_type* dt) {
  if (et == xla::ffi::DataType::BF16) {
    *dt = dnnl::memory::data_type::bf16;
    return true;
  }
  if (et == xla::ffi::DataType::F32) {
    *dt = dnnl::memory::data_type::f32;
    return true;
  }
  return false;
}

// SwiGLU of n interleaved (gate, up) pairs into y[n] (swiglu.cc): bf16 pairs read as one uint32 each.
void SwigluBf16(const uint32_t* __restrict pairs, uint16_t* __restrict y, int64_t n);
void SwigluF32(const float* __restrict pairs, float* __restrict y, int64_t n);

// Whether AttendBf16 takes the VDPBF16PS path for these head sizes: AVX512-BF16 (unless ONEDNN_MAX_CPU_ISA
// stops below it), D and Dv multiples of 32.
bool Bf16DotProducts(int64_t D, int64_t Dv);

// One KV head of one row in plain loops (attention_loops.cc): its M = T J query rows (row m: new token m / J's
// query head m % J of this KV head's J, at q + ((m / J) H + m % J) D, q [T, H, D] from this head's first)
// against the cache positions s < visible[m], key s at k + s k_stride, value s at v + s v_stride; row m's
// result at out + ((m / J) H + m % J) Dv in q's dtype. scores [M, S] and work [D + Dv] are the caller's.
void AttendBf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t M, int64_t J, int64_t H, int64_t D,
                int64_t Dv, int64_t k_stride, int64_t v_stride, const int64_t* visible, float scale, float* scores,
                int64_t S, float* work, uint16_t* out);
// AttendBf16's path with VDPBF16PS (attention_dpbf16.cc; only where Bf16DotProducts(D, Dv)).
void AttendBf16Dp(const uint16_t* q, const uint16_t* k, const uint16_t* v, int64_t M, int64_t J, int64_t H, int64_t D,
                  int64_t Dv, int64_t k_stride, int64_t v_stride, const int64_t* visible, float scale, float* scores,
                  int64_t S, uint16_t* out);
void AttendF32(const float* q, const float* k, const float* v, int64_t M, int64_t J, int64_t H, int64_t D, int64_t Dv,
               int64_t k_stride, int64_t v_stride, const int64_t* visible, float scale, float* scores, int64_t S,
               float* work, float* out);

}  // namespace mtp_onednn
