// mtp_jax_onednn: the decode step's attention over the KV cache where it lies, in one XLA FFI call.
//
//   MtpOnednnAttention(q [B, G, M, D], k [B, S, G, D], v [B, S, G, Dv], lengths s32 [B]; scale, num_queries T)
//       -> out f32 [B, G, M, Dv], scratch f32 [2, B, G, M, S] (the scores and the weights: XLA's buffer, so
//          that nothing here outlives the call)
//
// Row m of KV head g is query head g M/T + m % (M/T) of new token t = m / (M/T) (the caller puts q's heads
// that read KV head g together), and sees cache positions s < lengths[b] - T + t + 1 (the verify window's
// causal mask, aligned to the end of the row as in pallas_kernels.verify_attention_reference). Up to
// LoopRows() rows per KV head (a decode step's), attention_loops.cc's plain loops, head by head over the
// positions each row sees. Above it, three oneDNN primitives and a reorder: the scores as a batched matmul
// over (B, G) whose keys are a strided view of the cache (times `scale` on the f32 sum), the masked softmax
// over S (softmax_accurate in f32, the weights then rounded once to q's dtype), and the weighted sum as a
// second batched matmul over the values' strided view. XLA:CPU would copy both caches head-major first (in
// f32, for bf16) on every layer and step, and compute the softmax in six fusions. q, k, v share one dtype,
// bf16 (products exact, summed in f32) or f32; a query with nothing to see, or whose visible scores are all
// -inf, gets zeros (as the reference's masked_softmax gives).
//
// Stale values (oneDNN's path; the loops never read them): the weights of entries at or past lengths[b] are
// exactly 0, but a stale value that is Inf or NaN would still turn 0 * v into NaN. Only then (an output block not finite) is that (b, g) summed again
// here over its first lengths[b] entries alone, in plain loops; a finite output is oneDNN's as it is.
//
// Only the first `span` positions are read: the longest row's length rounded up to kSpanStep positions, or to
// S / kSpans for a long cache (entries past a row's length weigh exactly 0: the result is the same as over S).
//
// Threads: the matmuls' rule (EveryCore) over the bytes and multiply-adds of that span, for the loops (split by
// (row, KV head)) and for all of the primitives; each primitive cache is keyed by what decides that count.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using namespace mtp_onednn;

namespace {

std::mutex g_attention_mu;

enum class Product { kScores, kValues };

// The products and the softmax run over the first `span` cache positions, the longest row's length rounded
// up to a multiple of kSpanStep, or of S / kSpans when that is larger: a long-allocated cache (a serving
// bucket, a generate call's max_length) is read as far as its rows reach, in at most kSpans distinct spans
// per capacity S (each span is its own primitive, cached, created once per process).
constexpr int64_t kSpanStep = 64, kSpans = 32;

struct Primitive {
  dnnl::matmul prim;
  dnnl::softmax_forward softmax;
  dnnl::reorder round;
  memory::desc src, wei, dst;
};

uint32_t Bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;  // a map key: NaN compares unordered, its bits do not
}

// A cached primitive of one product over the first `span` of the cache's S positions: src [B, G, M, C] (C: D
// or span) times the cache [B, S, G, D] viewed as [B, G, C, N] (N: span or D) into f32 [B, G, M, N], the sums
// times `scale`; created on `threads` threads.
std::shared_ptr<Primitive> GetProduct(Product kind, int64_t B, int64_t G, int64_t M, int64_t S, int64_t span,
                                      int64_t D, memory::data_type dt, float scale, int threads) {
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, uint32_t, int>;
  static std::map<Key, std::shared_ptr<Primitive>> cache;
  Key key{static_cast<int>(kind), B, G, M, S, span, D, static_cast<int>(dt), Bits(scale), threads};
  return Cached(cache, g_attention_mu, key, [&] {
    bool scores = kind == Product::kScores;
    int64_t C = scores ? D : span, N = scores ? span : D;
    auto p = std::make_shared<Primitive>();
    p->src = memory::desc({B, G, M, C}, dt, memory::format_tag::abcd);
    // The cache [B, S, G, D] as [B, G, D, S] (keys: position s at stride G D) or [B, G, S, D] (values).
    memory::dims strides = scores ? memory::dims{S * G * D, D, 1, G * D} : memory::dims{S * G * D, D, G * D, 1};
    p->wei = memory::desc({B, G, C, N}, dt, strides);
    p->dst = memory::desc({B, G, M, N}, memory::data_type::f32, memory::format_tag::abcd);
    dnnl::primitive_attr attr;
    if (scale != 1.0f) {  // the scores times the softmax scale, in f32 on the sum as the reference does
      dnnl::post_ops ops;
      ops.append_eltwise(dnnl::algorithm::eltwise_linear, scale, 0.0f);
      attr.set_post_ops(ops);
    }
    p->prim = dnnl::matmul(dnnl::matmul::primitive_desc(ctx().eng, p->src, p->wei, p->dst, attr));
    return p;
  });
}

// One product; throws what oneDNN throws.
void Run(Product kind, int64_t B, int64_t G, int64_t M, int64_t S, int64_t span, int64_t D, memory::data_type dt,
         const void* a, const void* cache, float* out, float scale, int threads) {
  auto p = GetProduct(kind, B, G, M, S, span, D, dt, scale, threads);
  dnnl::stream strm(ctx().eng);
  memory src(p->src, ctx().eng, const_cast<void*>(a)), wei(p->wei, ctx().eng, const_cast<void*>(cache)),
      dst(p->dst, ctx().eng, out);
  p->prim.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
  strm.wait();
}

// The softmax over S of the scores [R, S] into the f32 `weights` [R, S] (the entries past a row's visible ones
// were set to -inf, which oneDNN's exp takes to exactly 0); for bf16 the caller rounds them once with `Round`
// (oneDNN's softmax into bf16 rounds twice: it keeps the exponentials in dst before scaling them).
std::shared_ptr<Primitive> GetSoftmax(int64_t R, int64_t S, memory::data_type dt, int threads) {
  static std::map<std::tuple<int64_t, int64_t, int, int>, std::shared_ptr<Primitive>> cache;
  return Cached(cache, g_attention_mu, std::make_tuple(R, S, static_cast<int>(dt), threads), [&] {
    auto p = std::make_shared<Primitive>();
    p->src = memory::desc({R, S}, memory::data_type::f32, memory::format_tag::ab);
    p->dst = memory::desc({R, S}, dt, memory::format_tag::ab);
    p->softmax = dnnl::softmax_forward(dnnl::softmax_forward::primitive_desc(
        ctx().eng, dnnl::prop_kind::forward_inference, dnnl::algorithm::softmax_accurate, p->src, p->src, 1));
    if (dt != memory::data_type::f32)
      p->round = dnnl::reorder(dnnl::reorder::primitive_desc(ctx().eng, p->src, ctx().eng, p->dst));
    return p;
  });
}

// The query rows per KV head (new tokens x query heads per KV head) up to which attention_loops.cc's plain loops
// take the call (MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS, default 4; 0: never): each row reads its keys and values on its own,
// where oneDNN's products share them between rows. On Zen 5 (bf16, 128-1024 positions) the loops took 0.3-0.8x
// oneDNN's time at 1-4 rows and 2x at 16 (docs/benchmarks.md, 2026-12-07, late).
int64_t LoopRows() {
  static const int64_t rows = [] {
    const char* s = std::getenv("MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS");
    return s && *s ? std::max<int64_t>(std::atoll(s), 0) : int64_t{4};
  }();
  return rows;
}

// Each (row b, KV head g) by AttendBf16 / AttendF32, on every core when `every_core`.
void AttendInLoops(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, const int32_t* len, float* out,
                   float* scores, int64_t B, int64_t G, int64_t M, int64_t D, int64_t Dv, int64_t S, int64_t T,
                   float scale, bool bf16, bool every_core) {
  const int64_t J = M / T;  // row m: new token m / J
  auto head = [&](int64_t bg) {
    thread_local std::vector<float> qf;
    thread_local std::vector<int64_t> visible;
    qf.resize(M * D);
    visible.resize(M);
    int64_t b = bg / G, g = bg % G;
    for (int64_t m = 0; m < M; ++m) visible[m] = std::clamp<int64_t>(int64_t{len[b]} - T + m / J + 1, 0, S);
    int64_t qo = bg * M * D, ko = (b * S * G + g) * D, vo = (b * S * G + g) * Dv;
    if (bf16)
      AttendBf16(static_cast<const uint16_t*>(q.untyped_data()) + qo,
                 static_cast<const uint16_t*>(k.untyped_data()) + ko,
                 static_cast<const uint16_t*>(v.untyped_data()) + vo, M, D, Dv, G * D, G * Dv, visible.data(), scale,
                 scores + bg * M * S, S, qf.data(), out + bg * M * Dv);
    else
      AttendF32(static_cast<const float*>(q.untyped_data()) + qo, static_cast<const float*>(k.untyped_data()) + ko,
                static_cast<const float*>(v.untyped_data()) + vo, M, D, Dv, G * D, G * Dv, visible.data(), scale,
                scores + bg * M * S, S, qf.data(), out + bg * M * Dv);
  };
  if (!every_core) {
    for (int64_t bg = 0; bg < B * G; ++bg) head(bg);
    return;
  }
  ParallelFor(B * G, head);
}

float Load(const void* base, int64_t i, bool bf16) {
  if (!bf16) return static_cast<const float*>(base)[i];
  uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> scratch, float scale,
                         int64_t T) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ld = lengths.dimensions(),
       od = out->dimensions(), sd = scratch->dimensions();
  memory::data_type dt;
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4 || ld.size() != 1 || kd[0] != qd[0] ||
      kd[2] != qd[1] || kd[3] != qd[3] || vd[0] != qd[0] || vd[1] != kd[1] || vd[2] != qd[1] || ld[0] != qd[0] ||
      od[0] != qd[0] || od[1] != qd[1] || od[2] != qd[2] || od[3] != vd[3] || sd.size() != 5 || sd[0] != 2 ||
      sd[1] != qd[0] || sd[2] != qd[1] || sd[3] != qd[2] || sd[4] != kd[1])
    return ffi::Error::InvalidArgument(
        "mtp_onednn_attention: expected q [B, G, M, D], k [B, S, G, D], v [B, S, G, Dv], lengths [B], out "
        "[B, G, M, Dv] and scratch [2, B, G, M, S]");
  if (!DataType(q.element_type(), &dt) || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type() || out->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(
        "mtp_onednn_attention: q, k and v must share one dtype, bf16 or f32, and out be f32");
  int64_t B = qd[0], G = qd[1], M = qd[2], D = qd[3], S = kd[1], Dv = vd[3];
  if (T <= 0 || M % T != 0)
    return ffi::Error::InvalidArgument("mtp_onednn_attention: num_queries must divide q's rows M");
  float* o = static_cast<float*>(out->untyped_data());
  if (out->element_count() == 0) return ffi::Error::Success();
  if (S == 0) {
    std::memset(o, 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const int32_t* len = lengths.typed_data();
  int64_t longest = 0;  // no row sees past it: the products stop at `span`, its multiple of kSpanStep
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, std::clamp<int64_t>(len[b], 0, S));
  const int64_t step = std::max(kSpanStep, (S / kSpans + kSpanStep - 1) / kSpanStep * kSpanStep);
  const int64_t span = std::min(S, (longest + step - 1) / step * step);
  if (span == 0) {  // nothing visible anywhere: zeros, as the reference gives
    std::memset(o, 0, out->size_bytes());
    return ffi::Error::Success();
  }
  bool bf16 = dt == memory::data_type::bf16;
  size_t item = bf16 ? 2 : 4;
  bool every_core = EveryCore(B * span * G * (D + Dv) * item, B * G * M * span * (D + Dv));
  if (M <= LoopRows()) {  // a decode step's few rows: plain loops, head by head
    AttendInLoops(q, k, v, len, o, scratch->typed_data(), B, G, M, D, Dv, S, T, scale, bf16, every_core);
    return ffi::Error::Success();
  }
  int threads = every_core ? Threads() : 1;
  omp_set_num_threads(threads);  // the calling thread's count, for every primitive below (created with it)
  int64_t R = B * G * M, J = M / T;  // row m of KV head g: new token m / J's query head g J + m % J
  float* scores = scratch->typed_data();  // [R, span] each, in the scratch's first R x span entries
  float* weights = scores + R * S;
  auto visible = [&](int64_t row) {  // cache positions row (b, g, m) sees: < lengths[b] - T + t + 1
    int64_t b = row / (G * M), m = row % M;
    return std::clamp<int64_t>(int64_t{len[b]} - T + m / J + 1, 0, span);
  };
  void* rounded = weights;  // the weights in q's dtype: f32 in place, bf16 over the scores (no longer read)
  try {
    if (D == 0)
      std::fill(scores, scores + R * span, 0.0f);
    else
      Run(Product::kScores, B, G, M, S, span, D, dt, q.untyped_data(), k.untyped_data(), scores, scale, threads);
    for (int64_t row = 0; row < R; ++row)
      std::fill(scores + row * span + visible(row), scores + (row + 1) * span,
                -std::numeric_limits<float>::infinity());
    auto soft = GetSoftmax(R, span, dt, threads);
    dnnl::stream strm(ctx().eng);
    memory src(soft->src, ctx().eng, scores), dst(soft->src, ctx().eng, weights);
    soft->softmax.execute(strm, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DST, dst}});
    strm.wait();
    // A row with nothing visible, or only -inf scores: oneDNN's weights are NaN, the reference's zeros.
    for (int64_t row = 0; row < R; ++row) {
      float* w = weights + row * span;
      if (visible(row) > 0 && std::isfinite(w[0])) continue;
      const float* x = scores + row * span;
      if (std::all_of(x, x + visible(row), [](float s) { return s == -std::numeric_limits<float>::infinity(); }))
        std::fill(w, w + span, 0.0f);
    }
    if (bf16) {
      rounded = scores;
      memory half(soft->dst, ctx().eng, rounded);
      soft->round.execute(strm, dst, half);
      strm.wait();
    }
    Run(Product::kValues, B, G, M, S, span, Dv, dt, rounded, v.untyped_data(), o, 1.0f, threads);
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("mtp_onednn_attention: ") + err.what());
  }
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      float* block = o + (b * G + g) * M * Dv;
      bool finite = true;
      for (int64_t i = 0; i < M * Dv && finite; ++i) finite = std::isfinite(block[i]);
      if (finite) continue;
      // Not finite: again over the valid entries only, so a stale Inf / NaN value cannot leak.
      int64_t valid = std::clamp<int64_t>(len[b], 0, S);
      for (int64_t m = 0; m < M; ++m) {
        int64_t row = ((b * G + g) * M + m) * span;
        for (int64_t e = 0; e < Dv; ++e) {
          float sum = 0.0f;
          for (int64_t s = 0; s < valid; ++s)
            sum += Load(rounded, row + s, bf16) * Load(v.untyped_data(), ((b * S + s) * G + g) * Dv + e, bf16);
          block[m * Dv + e] = sum;
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpOnednnAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("num_queries"));
