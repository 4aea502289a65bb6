// Spike: an XLA FFI CPU handler computing y[M, N] = x[M, K] @ w[K, N] with oneDNN's matmul
// primitive, for bf16 (fp32 accumulation inside oneDNN, bf16 out) and fp32. See README.md.
//
// Two handlers:
//   OnednnMatmulPlain  - weight used in place, plain row-major [K, N] (format_tag::ab).
//   OnednnMatmulPacked - primitive created with format_tag::any for the weight; the weight is
//                        reordered into oneDNN's preferred (blocked) layout once and the packed copy
//                        cached, keyed by (weight buffer pointer, packed layout, a 16-sample
//                        fingerprint of the weight's bytes).
//
// STALENESS HAZARD (this is a spike): the packed cache trusts that the bytes at a given pointer do
// not change. XLA may free a weight buffer and reuse the address for a different array; the
// fingerprint only samples 16 positions, so a different weight that agrees on those samples (or a
// weight updated in place) would silently be multiplied using the stale packed copy. The cache also
// never evicts (memory grows with every distinct weight seen). A real extension would pack at load
// time (pack as an explicit op whose output is the packed weight, kept as a jax.Array) instead.
//
// Primitives are cached per (M, K, N, dtype, packed). Threading: oneDNN's OpenMP runtime (this build
// links libgomp); OMP_NUM_THREADS governs it, independently of XLA's own intra-op thread pool.

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Ctx {
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
};

Ctx& ctx() {
  static Ctx* c = new Ctx();  // leaked on purpose: no destruction order issues at exit
  return *c;
}

using PrimKey = std::tuple<int64_t, int64_t, int64_t, int, bool>;  // M, K, N, dtype, packed

struct PrimEntry {
  dnnl::matmul prim;
  dnnl::memory::desc src_md, wei_md, dst_md;  // wei_md: the layout the primitive expects
  dnnl::memory::desc wei_user_md;             // plain [K, N] row-major
};

struct PackedWeight {
  const void* ptr;
  dnnl::memory::desc md;
  uint64_t fingerprint;
  dnnl::memory mem;
};

std::mutex g_mu;
std::map<PrimKey, std::shared_ptr<PrimEntry>> g_prims;
std::vector<PackedWeight> g_packed;

uint64_t Fingerprint(const void* data, size_t bytes) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t h = 1469598103934665603ull ^ bytes;
  constexpr int kSamples = 16;
  for (int i = 0; i < kSamples; ++i) {
    size_t off = bytes <= 8 ? 0 : (bytes - 8) * i / (kSamples - 1);
    uint64_t v = 0;
    std::memcpy(&v, p + off, bytes < 8 ? bytes : 8);
    h = (h ^ v) * 1099511628211ull;
  }
  return h;
}

std::shared_ptr<PrimEntry> GetPrim(int64_t M, int64_t K, int64_t N, dnnl::memory::data_type dt,
                                   bool packed) {
  PrimKey key{M, K, N, static_cast<int>(dt), packed};
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_prims.find(key);
    if (it != g_prims.end()) return it->second;
  }
  using tag = dnnl::memory::format_tag;
  auto e = std::make_shared<PrimEntry>();
  e->src_md = dnnl::memory::desc({M, K}, dt, tag::ab);
  e->wei_user_md = dnnl::memory::desc({K, N}, dt, tag::ab);
  auto wei_req = packed ? dnnl::memory::desc({K, N}, dt, tag::any) : e->wei_user_md;
  e->dst_md = dnnl::memory::desc({M, N}, dt, tag::ab);
  dnnl::matmul::primitive_desc pd(ctx().eng, e->src_md, wei_req, e->dst_md);
  e->wei_md = pd.weights_desc();
  e->prim = dnnl::matmul(pd);
  std::lock_guard<std::mutex> lock(g_mu);
  g_prims.emplace(key, e);
  return e;
}

// Returns the packed copy of the weight at `w` for layout `md`, creating it on first use.
dnnl::memory GetPacked(const PrimEntry& e, void* w, size_t bytes) {
  uint64_t fp = Fingerprint(w, bytes);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& pw : g_packed)
      if (pw.ptr == w && pw.fingerprint == fp && pw.md == e.wei_md) return pw.mem;
  }
  dnnl::memory user(e.wei_user_md, ctx().eng, w);
  dnnl::memory packed(e.wei_md, ctx().eng);
  dnnl::reorder(user, packed).execute(ctx().strm, user, packed);
  ctx().strm.wait();
  std::lock_guard<std::mutex> lock(g_mu);
  g_packed.push_back({w, e.wei_md, fp, packed});
  return packed;
}

ffi::Error MatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                      bool packed) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("onednn_matmul: operands must be rank 2");
  int64_t M = xd[0], K = xd[1], N = wd[1];
  if (wd[0] != K || yd[0] != M || yd[1] != N)
    return ffi::Error::InvalidArgument("onednn_matmul: shape mismatch");
  auto et = x.element_type();
  if (w.element_type() != et || y->element_type() != et)
    return ffi::Error::InvalidArgument("onednn_matmul: dtypes must agree");
  dnnl::memory::data_type dt;
  if (et == ffi::DataType::BF16)
    dt = dnnl::memory::data_type::bf16;
  else if (et == ffi::DataType::F32)
    dt = dnnl::memory::data_type::f32;
  else
    return ffi::Error::InvalidArgument("onednn_matmul: only bf16 and f32");
  try {
    auto e = GetPrim(M, K, N, dt, packed);
    auto& c = ctx();
    dnnl::memory src(e->src_md, c.eng, x.untyped_data());
    dnnl::memory dst(e->dst_md, c.eng, y->untyped_data());
    dnnl::memory wei = packed && e->wei_md != e->wei_user_md
                           ? GetPacked(*e, w.untyped_data(), w.size_bytes())
                           : dnnl::memory(e->wei_user_md, c.eng, w.untyped_data());
    e->prim.execute(c.strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    c.strm.wait();
  } catch (const dnnl::error& err) {
    return ffi::Error::Internal(std::string("onednn_matmul: ") + err.what());
  }
  return ffi::Error::Success();
}

ffi::Error PlainImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return MatmulImpl(x, w, y, /*packed=*/false);
}
ffi::Error PackedImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y) {
  return MatmulImpl(x, w, y, /*packed=*/true);
}

}  // namespace

extern "C" {
// Reports, for a (M, K, N, dtype) the layout the packed primitive picks: 1 if it differs from
// plain row-major (i.e. a reorder/pack actually happens), 0 if not. dtype: 0 f32, 1 bf16.
int onednn_packed_layout_differs(int64_t M, int64_t K, int64_t N, int dtype) {
  auto dt = dtype == 1 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
  auto e = GetPrim(M, K, N, dt, true);
  return e->wei_md != e->wei_user_md;
}
// Number of packed weight copies held (grows without bound; see the hazard above).
int onednn_packed_cache_size() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int>(g_packed.size());
}
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmulPlain, PlainImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K]
                                  .Arg<ffi::AnyBuffer>()  // w [K, N]
                                  .Ret<ffi::AnyBuffer>()  // y [M, N]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmulPacked, PackedImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
