// mtp_jax_onednn: XLA FFI CPU handlers for a matmul against a weight pre-packed by oneDNN.
//
//   MtpOnednnPack(w [K, N]) -> packed [bytes]        the weight reordered, once, into the blocked layout
//                                                    oneDNN's matmul primitive prefers (format_tag::any)
//   MtpOnednnMatmul(x [..., K], packed) -> y [..., N] y = x @ w with oneDNN's matmul primitive, the leading
//                                                    axes flattened into M rows; N is y's last dimension
//   MtpOnednnGroupedMatmul(x [M, K], packed [R, P],  the grouped matmul of jax.lax.ragged_dot: rows
//     group_sizes s32 [R]) -> y [M, N]               offset_r .. offset_r + g_r - 1 of x times expert r's
//                                                    packed weight (P elements each), experts in order;
//                                                    rows past the groups are zeros; each group computed
//                                                    in power-of-two row chunks (few primitives)
//   MtpOnednnMatmulSwiglu(x [..., K], packed)         SwiGLU of an interleaved gate_up projection in one
//     -> y [..., N / 2], scratch [M, N]              call: the matmul into `scratch` (rounded to x's dtype,
//                                                    as MtpOnednnMatmul's y), then y[m, i] =
//                                                    silu(scratch[m, 2i]) * scratch[m, 2i + 1] as
//                                                    mtp_jax.layers.ffn.swiglu computes it (bf16: silu in
//                                                    f32 rounded once, the product rounded once)
//
// Both for bf16 (fp32 accumulation inside oneDNN, rounded once to bf16) and f32. The packed layout of a
// (K, N, dtype) is the one oneDNN picks for kLayoutRows rows; every M then uses a primitive created for
// that fixed layout, so one packed copy serves every row count. The packed bytes are an ordinary XLA
// buffer owned by the caller (no cache keyed by pointers: a weight that changes must be packed again).
//
// Threads: every core for a weight of 2 MiB or more, or of 1 MiB or more in a call of 8 Mi multiply-adds
// (M x K x N) or more; one thread otherwise (see UseThreads).
//
// C entry points (for ctypes): mtp_onednn_packed_bytes(K, N, dtype) is the packed buffer's size in bytes
// (dtype 0: f32, 1: bf16), mtp_onednn_impl(M, K, N, dtype, buf, len) writes the name of the
// implementation oneDNN chose for that matmul into buf.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include <omp.h>

#include "common.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using namespace mtp_onednn;

namespace {

constexpr int64_t kLayoutRows = 16;

std::mutex g_mu;

// oneDNN's OpenMP threads for one call on the calling (XLA) thread: MTP_JAX_ONEDNN_THREADS (default every
// core, or OMP_NUM_THREADS) for a weight of at least MTP_JAX_ONEDNN_PARALLEL_BYTES (default 2 MiB), and for
// a weight of 1 MiB or more once the call's M x K x N reaches MTP_JAX_ONEDNN_PARALLEL_MACS (default 8 Mi);
// else one. A small call is done sooner than OpenMP wakes its workers, and idle workers spin, taking cores
// from XLA's own pool; a large weight streams faster on every core, and a many-row call is compute-bound
// (benchmarks/bench_onednn.py, 2 cores: the medium preset's 2-64 MiB weights 1.2-1.6x faster on two threads
// than one; on Zen 5, one thread for the small preset's 1-2 MiB bf16 weights made its one-row step 1.0 ->
// 0.8 ms, while its 32-row eagle step needs both; docs/benchmarks.md, 2026-12-07). omp_set_num_threads
// sets the calling thread's value only; oneDNN fixes a primitive's thread count when it is created, and a
// primitive is cached per (M, K, N, dtype), which alone decide the count (the weight's bytes are its packed
// layout's), so each is created after UseThreads.
memory::desc PackedDesc(int64_t K, int64_t N, memory::data_type dt);

void UseThreads(int64_t M, int64_t K, int64_t N, memory::data_type dt) {
  omp_set_num_threads(EveryCore(PackedDesc(K, N, dt).get_size(), M * K * N) ? Threads() : 1);
}

memory::desc Plain(int64_t rows, int64_t cols, memory::data_type dt) {
  return memory::desc({rows, cols}, dt, memory::format_tag::ab);
}

// The packed weight layout of (K, N, dt), cached.
memory::desc PackedDesc(int64_t K, int64_t N, memory::data_type dt) {
  static std::map<std::tuple<int64_t, int64_t, int>, memory::desc> cache;
  return Cached(cache, g_mu, std::make_tuple(K, N, static_cast<int>(dt)), [&] {
    memory::desc any({K, N}, dt, memory::format_tag::any);
    return dnnl::matmul::primitive_desc(ctx().eng, Plain(kLayoutRows, K, dt), any, Plain(kLayoutRows, N, dt))
        .weights_desc();
  });
}

struct Matmul {
  dnnl::matmul prim;
  memory::desc src, wei, dst;
  std::string impl;
};

std::shared_ptr<Matmul> GetMatmul(int64_t M, int64_t K, int64_t N, memory::data_type dt) {
  static std::map<std::tuple<int64_t, int64_t, int64_t, int>, std::shared_ptr<Matmul>> cache;
  return Cached(cache, g_mu, std::make_tuple(M, K, N, static_cast<int>(dt)), [&] {
    auto m = std::make_shared<Matmul>();
    m->src = Plain(M, K, dt);
    m->wei = PackedDesc(K, N, dt);
    m->dst = Plain(M, N, dt);
    dnnl::matmul::primitive_desc pd(ctx().eng, m->src, m->wei, m->dst);
    m->impl = pd.impl_info_str();
    m->prim = dnnl::matmul(pd);
    return m;
  });
}

memory::data_type FromCode(int dtype) { return dtype == 1 ? memory::data_type::bf16 : memory::data_type::f32; }

ffi::Error PackImpl(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> packed) {
  auto wd = w.dimensions();
  memory::data_type dt;
  if (wd.size() != 2) return ffi::Error::InvalidArgument("mtp_onednn_pack: the weight must be [K, N]");
  if (!DataType(w.element_type(), &dt)) return ffi::Error::InvalidArgument("mtp_onednn_pack: bf16 or f32 only");
  try {
    auto md = PackedDesc(wd[0], wd[1], dt);
    if (packed->size_bytes() != md.get_size())
      return ffi::Error::InvalidArgument("mtp_onednn_pack: output size is not mtp_onednn_packed_bytes(K, N)");
    dnnl::stream strm(ctx().eng);
    memory src(Plain(wd[0], wd[1], dt), ctx().eng, w.untyped_data());
    memory dst(md, ctx().eng, packed->untyped_data());
    dnnl::reorder(src, dst).execute(strm, src, dst);
    strm.wait();
  } catch (const std::exception& err) {  // dnnl::error, std::bad_alloc, ...
    return ffi::Error::Internal(std::string("mtp_onednn_pack: ") + err.what());
  }
  return ffi::Error::Success();
}

// y [M, N] = x [M, K] @ the packed weight, every pointer the caller's.
ffi::Error RunMatmul(const char* name, const void* x, ffi::AnyBuffer packed, void* y, int64_t M, int64_t K, int64_t N,
                     memory::data_type dt) {
  if (N == 0) return ffi::Error::Success();
  try {
    if (packed.size_bytes() != PackedDesc(K, N, dt).get_size())
      return ffi::Error::InvalidArgument(
          std::string(name) + ": the packed weight's size is not that of one packed [K, N] weight (batched?)");
    if (M == 0) return ffi::Error::Success();
    UseThreads(M, K, N, dt);
    auto m = GetMatmul(M, K, N, dt);
    dnnl::stream strm(ctx().eng);
    memory src(m->src, ctx().eng, const_cast<void*>(x));
    memory wei(m->wei, ctx().eng, packed.untyped_data());
    memory dst(m->dst, ctx().eng, y);
    m->prim.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    strm.wait();
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string(name) + ": " + err.what());
  }
  return ffi::Error::Success();
}

// x [..., K] and y [..., N'] with equal leading axes, flattened into M rows; x, packed and y of one dtype.
ffi::Error Rows(const char* name, ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::AnyBuffer::Dimensions yd,
                ffi::DataType yt, int64_t* M, memory::data_type* dt) {
  auto xd = x.dimensions();
  if (xd.size() < 1 || yd.size() != xd.size() || !std::equal(xd.begin(), xd.end() - 1, yd.begin()))
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x must be [..., K] and y [..., N] with equal leading axes");
  if (!DataType(x.element_type(), dt) || yt != x.element_type() || packed.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x, the packed weight and y must share one dtype, bf16 or f32");
  *M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) *M *= xd[i];
  return ffi::Error::Success();
}

ffi::Error MatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> y) {
  int64_t M;
  memory::data_type dt;
  auto rows = Rows("mtp_onednn_matmul", x, packed, y->dimensions(), y->element_type(), &M, &dt);
  if (rows.failure()) return rows;
  return RunMatmul("mtp_onednn_matmul", x.untyped_data(), packed, y->untyped_data(), M, x.dimensions().back(),
                   y->dimensions().back(), dt);
}

ffi::Error MatmulSwigluImpl(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::AnyBuffer> scratch) {
  constexpr const char* kName = "mtp_onednn_matmul_swiglu";
  int64_t M;
  memory::data_type dt;
  auto rows = Rows(kName, x, packed, y->dimensions(), y->element_type(), &M, &dt);
  if (rows.failure()) return rows;
  int64_t half = y->dimensions().back(), N = 2 * half;
  if (scratch->element_type() != x.element_type() || scratch->element_count() != static_cast<size_t>(M * N))
    return ffi::Error::InvalidArgument(std::string(kName) +
                                       ": scratch must hold M x 2 * y.shape[-1] elements of x's dtype");
  auto run = RunMatmul(kName, x.untyped_data(), packed, scratch->untyped_data(), M, x.dimensions().back(), N, dt);
  if (run.failure()) return run;
  // Elements [start, start + n) of y (flattened) from the matmul's output.
  auto swiglu = [&](int64_t start, int64_t n) {
    if (dt == memory::data_type::bf16) {
      SwigluBf16(static_cast<const uint32_t*>(scratch->untyped_data()) + start,
                 static_cast<uint16_t*>(y->untyped_data()) + start, n);
    } else {
      SwigluF32(static_cast<const float*>(scratch->untyped_data()) + 2 * start,
                static_cast<float*>(y->untyped_data()) + start, n);
    }
  };
  // On this thread unless the call is large (a prefill): a decode step's few rows take microseconds.
  const int64_t total = M * half, chunk = 1 << 16;
  if (total < (int64_t{1} << 20)) {
    swiglu(0, total);
    return ffi::Error::Success();
  }
  ParallelFor((total + chunk - 1) / chunk, [&](int64_t i) { swiglu(i * chunk, std::min(chunk, total - i * chunk)); });
  return ffi::Error::Success();
}

ffi::Error GroupedImpl(ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::Buffer<ffi::S32> sizes,
                       ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), yd = y->dimensions(), pd = packed.dimensions(), sd = sizes.dimensions();
  memory::data_type dt;
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0] || pd.size() != 2 || sd.size() != 1 || sd[0] != pd[0])
    return ffi::Error::InvalidArgument(
        "mtp_onednn_grouped_matmul: expected x [M, K], packed [R, P], group_sizes [R] and y [M, N]");
  if (!DataType(x.element_type(), &dt) || y->element_type() != x.element_type() ||
      packed.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(
        "mtp_onednn_grouped_matmul: x, the packed weights and y must share one dtype, bf16 or f32");
  int64_t M = xd[0], K = xd[1], N = yd[1], R = pd[0];
  size_t item = dt == memory::data_type::bf16 ? 2 : 4;
  auto* xs = static_cast<const char*>(x.untyped_data());
  auto* ws = static_cast<char*>(packed.untyped_data());
  auto* ys = static_cast<char*>(y->untyped_data());
  const int32_t* groups = sizes.typed_data();
  int64_t offset = 0;
  try {
    size_t per_expert = PackedDesc(K, N, dt).get_size();
    if (static_cast<size_t>(pd[1]) * item != per_expert)
      return ffi::Error::InvalidArgument(
          "mtp_onednn_grouped_matmul: each expert's packed weight must be mtp_onednn_packed_bytes(K, N)");
    dnnl::stream strm(ctx().eng);
    for (int64_t r = 0; r < R; ++r) {
      int64_t rows = groups[r];
      if (rows < 0 || offset + rows > M)
        return ffi::Error::InvalidArgument(
            "mtp_onednn_grouped_matmul: group sizes must be non-negative and sum to at most M");
      // A group in chunks of powers of two (its binary digits, largest first): group sizes change with
      // the data, and a primitive per size ever seen would be created inside steps and kept; this way at
      // most log2(M) + 1 row counts per weight shape.
      for (int64_t chunk = int64_t{1} << 62; chunk > 0 && N > 0; chunk >>= 1) {
        if (!(rows & chunk)) continue;
        UseThreads(chunk, K, N, dt);
        auto m = GetMatmul(chunk, K, N, dt);
        memory src(m->src, ctx().eng, const_cast<char*>(xs + offset * K * item));
        memory wei(m->wei, ctx().eng, ws + r * per_expert);
        memory dst(m->dst, ctx().eng, ys + offset * N * item);
        m->prim.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
        offset += chunk;
      }
      if (N == 0) offset += rows;
    }
    strm.wait();
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("mtp_onednn_grouped_matmul: ") + err.what());
  }
  std::memset(ys + offset * N * item, 0, (M - offset) * N * item);
  return ffi::Error::Success();
}

}  // namespace

extern "C" {
int64_t mtp_onednn_packed_bytes(int64_t K, int64_t N, int dtype) {
  try {
    return static_cast<int64_t>(PackedDesc(K, N, FromCode(dtype)).get_size());
  } catch (const std::exception&) {
    return -1;
  }
}

// Threads(): the OpenMP threads a call on every core uses.
int mtp_onednn_threads() { return Threads(); }

int mtp_onednn_impl(int64_t M, int64_t K, int64_t N, int dtype, char* buf, int len) {
  try {
    UseThreads(M, K, N, FromCode(dtype));
    std::string s = GetMatmul(M, K, N, FromCode(dtype))->impl;
    std::snprintf(buf, len, "%s", s.c_str());
    return 0;
  } catch (const std::exception& err) {
    std::snprintf(buf, len, "%s", err.what());
    return 1;
  }
}
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpOnednnPack, PackImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpOnednnMatmul, MatmulImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpOnednnMatmulSwiglu, MatmulSwigluImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpOnednnGroupedMatmul, GroupedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
