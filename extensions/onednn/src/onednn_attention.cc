// mtp_jax_onednn: the decode step's attention over the KV cache where it lies, in one XLA FFI call.
//
//   MtpOnednnAttention(q [B, T, H, D], k [B, S, G, D], v [B, S, G, Dv], lengths s32 [B]; scale)
//       -> out [B, T, H, Dv] in q's dtype, scratch f32 [B T H (2 S + D + Dv)] (the scores, the weights, and
//          oneDNN's rows head-major: XLA's buffer, so that nothing here outlives the call)
//
// The M = T H/G query rows that read KV head g are taken where they lie in q, and their results written where
// they belong (XLA would move both head-major in a fusion per layer): row m of KV head g is query head
// g H/G + m % (H/G) of new token t = m / (H/G), and sees cache positions s < lengths[b] - T + t + 1 (the verify
// window's causal mask, aligned to the end of the row as in pallas_kernels.verify_attention_reference). Up to
// LoopRows() rows per KV head (a decode or verify step's), attention_loops.cc's plain loops (attention_dpbf16.cc's
// with VDPBF16PS), head by head over each row's valid entries. Above it, the rows copied head-major and three oneDNN primitives and a reorder: the
// scores as a batched matmul over (B, G) whose keys are a strided view of the cache (times `scale` on the f32
// sum), the masked softmax over S (softmax_accurate in f32, the weights then rounded once to q's dtype), and
// the weighted sum as a second batched matmul over the values' strided view, rounded once to q's dtype. XLA:CPU
// would copy both caches head-major first (in f32, for bf16) on every layer and step, and compute the softmax
// in six fusions. q, k, v share one dtype, bf16 (products exact, summed in f32) or f32; a query with nothing to
// see, or whose visible scores are all -inf, gets zeros (as the reference's masked_softmax gives).
//
// Stale values (oneDNN's path; the loops never read them): the weights of entries at or past lengths[b] are
// exactly 0, but a stale value that is Inf or NaN would still turn 0 * v into NaN. Only then (an output block
// not finite) is that (b, g) summed again here over its first lengths[b] entries alone, in plain loops; a
// finite output is oneDNN's as it is.
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
#include "vector_math.h"

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

// A cached primitive of one product over the first `span` of the cache's S positions: src [B, G, M, C] (C: D
// or span) times the cache [B, S, G, D] viewed as [B, G, C, N] (N: span or D) into f32 [B, G, M, N], the sums
// times `scale`; created on `threads` threads.
std::shared_ptr<Primitive> GetProduct(Product kind, int64_t B, int64_t G, int64_t M, int64_t S, int64_t span,
                                      int64_t D, memory::data_type dt, float scale, int threads) {
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, uint32_t, int>;
  static std::map<Key, std::shared_ptr<Primitive>> cache;
  // scale by its bits: NaN compares unordered as a map key, its bits do not
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

// The cache positions new token t of T sees in a row of `length` valid entries, at most `limit`: < length - T + t + 1.
int64_t Visible(int32_t length, int64_t T, int64_t t, int64_t limit) {
  return std::clamp<int64_t>(int64_t{length} - T + t + 1, 0, limit);
}

// The query rows per KV head (new tokens x query heads per KV head) up to which attention_loops.cc's plain loops
// take the call (MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS; 0: never). Default: 64 for bf16 with VDPBF16PS, 4 otherwise.
// On Zen 5 (120-700 positions) the VDPBF16PS loops took 0.2-0.8x oneDNN's time at 1-32 rows, 0.9-1.0x at 64-256;
// the generic ones 0.3-1.0x at 1-4 rows and 2x at 16 (each row reads its keys and values on its own, where
// oneDNN's products share them; docs/benchmarks.md, 2026-12-07).
int64_t LoopRows(bool bf16, int64_t D, int64_t Dv) {
  static const int64_t rows = [] {
    const char* s = std::getenv("MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS");
    return s && *s ? std::max<int64_t>(std::atoll(s), 0) : int64_t{-1};
  }();
  if (rows >= 0) return rows;
  return bf16 && Bf16DotProducts(D, Dv) ? 64 : 4;
}

// Each (row b, KV head g) by AttendBf16 / AttendF32, on every core when `every_core`; q and out [B, T, H, *].
void AttendInLoops(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, const int32_t* len, void* out,
                   float* scores, int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, int64_t Dv, int64_t S,
                   float scale, bool bf16, bool every_core) {
  const int64_t J = H / G, M = T * J;  // row m: new token m / J
  auto head = [&](int64_t bg) {
    thread_local std::vector<float> work;
    thread_local std::vector<int64_t> visible;
    work.resize(D + Dv);
    visible.resize(M);
    int64_t b = bg / G, g = bg % G;
    for (int64_t m = 0; m < M; ++m) visible[m] = Visible(len[b], T, m / J, S);
    int64_t first = b * T * H + g * J;  // this head's first query row in [B, T, H]
    int64_t qo = first * D, ko = (b * S * G + g) * D, vo = (b * S * G + g) * Dv, oo = first * Dv;
    if (bf16)
      AttendBf16(static_cast<const uint16_t*>(q.untyped_data()) + qo,
                 static_cast<const uint16_t*>(k.untyped_data()) + ko,
                 static_cast<const uint16_t*>(v.untyped_data()) + vo, M, J, H, D, Dv, G * D, G * Dv, visible.data(),
                 scale, scores + bg * M * S, S, work.data(), static_cast<uint16_t*>(out) + oo);
    else
      AttendF32(static_cast<const float*>(q.untyped_data()) + qo, static_cast<const float*>(k.untyped_data()) + ko,
                static_cast<const float*>(v.untyped_data()) + vo, M, J, H, D, Dv, G * D, G * Dv, visible.data(), scale,
                scores + bg * M * S, S, work.data(), static_cast<float*>(out) + oo);
  };
  if (!every_core) {
    for (int64_t bg = 0; bg < B * G; ++bg) head(bg);
    return;
  }
  ParallelFor(B * G, head);
}

float Load(const void* base, int64_t i, bool bf16) {
  if (!bf16) return static_cast<const float*>(base)[i];
  return Bits(static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16);
}

ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> lengths,
                         ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> scratch, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ld = lengths.dimensions(),
       od = out->dimensions(), sd = scratch->dimensions();
  memory::data_type dt;
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4 || ld.size() != 1 || kd[0] != qd[0] ||
      kd[3] != qd[3] || vd[0] != qd[0] || vd[1] != kd[1] || vd[2] != kd[2] || ld[0] != qd[0] || od[0] != qd[0] ||
      od[1] != qd[1] || od[2] != qd[2] || od[3] != vd[3] || kd[2] <= 0 || qd[2] % kd[2] != 0 || sd.size() != 1 ||
      sd[0] != qd[0] * qd[1] * qd[2] * (2 * kd[1] + qd[3] + vd[3]))
    return ffi::Error::InvalidArgument(
        "mtp_onednn_attention: expected q [B, T, H, D], k [B, S, G, D] with G dividing H, v [B, S, G, Dv], lengths "
        "[B], out [B, T, H, Dv] and scratch [B T H (2 S + D + Dv)]");
  if (!DataType(q.element_type(), &dt) || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type() || out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("mtp_onednn_attention: q, k, v and out must share one dtype, bf16 or f32");
  int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], S = kd[1], G = kd[2], Dv = vd[3];
  if (out->element_count() == 0) return ffi::Error::Success();
  if (S == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const int32_t* len = lengths.typed_data();
  int64_t longest = 0;  // no row sees past it: the products stop at `span`, its multiple of kSpanStep
  for (int64_t b = 0; b < B; ++b) longest = std::max<int64_t>(longest, std::clamp<int64_t>(len[b], 0, S));
  const int64_t step = std::max(kSpanStep, (S / kSpans + kSpanStep - 1) / kSpanStep * kSpanStep);
  const int64_t span = std::min(S, (longest + step - 1) / step * step);
  if (span == 0) {  // nothing visible anywhere: zeros, as the reference gives
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  bool bf16 = dt == memory::data_type::bf16;
  size_t item = bf16 ? 2 : 4;
  const int64_t J = H / G, M = T * J;  // per KV head, row m: new token m / J's query head g J + m % J
  bool every_core = EveryCore(B * span * G * (D + Dv) * item, B * G * M * span * (D + Dv));
  if (M <= LoopRows(bf16, D, Dv)) {  // a decode step's few rows: plain loops, head by head
    AttendInLoops(q, k, v, len, out->untyped_data(), scratch->typed_data(), B, T, H, G, D, Dv, S, scale, bf16,
                  every_core);
    return ffi::Error::Success();
  }
  int threads = every_core ? Threads() : 1;
  omp_set_num_threads(threads);  // the calling thread's count, for every primitive below (created with it)
  const int64_t R = B * G * M;
  float* scores = scratch->typed_data();  // [R, span] each, in the scratch's first R x span entries
  float* weights = scores + R * S;
  float* o = weights + R * S;                // f32 [B, G, M, Dv]
  char* qg = reinterpret_cast<char*>(o + R * Dv);  // q's rows [B, G, M, D], in q's dtype
  auto q_row = [&](int64_t row) {  // row (b, g, m)'s row in [B, T, H]
    int64_t b = row / (G * M), g = row / M % G, m = row % M;
    return (b * T + m / J) * H + g * J + m % J;
  };
  for (int64_t row = 0; row < R; ++row)
    std::memcpy(qg + row * D * item, static_cast<const char*>(q.untyped_data()) + q_row(row) * D * item, D * item);
  auto visible = [&](int64_t row) { return Visible(len[row / (G * M)], T, row % M / J, span); };  // row (b, g, m)
  void* rounded = weights;  // the weights in q's dtype: f32 in place, bf16 over the scores (no longer read)
  try {
    if (D == 0)
      std::fill(scores, scores + R * span, 0.0f);
    else
      Run(Product::kScores, B, G, M, S, span, D, dt, qg, k.untyped_data(), scores, scale, threads);
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
  for (int64_t row = 0; row < R; ++row) {  // into [B, T, H, Dv], rounded once to q's dtype
    const float* from = o + row * Dv;
    if (bf16) {
      uint16_t* to = static_cast<uint16_t*>(out->untyped_data()) + q_row(row) * Dv;
      for (int64_t e = 0; e < Dv; ++e) to[e] = static_cast<uint16_t>(RoundBf16(from[e]) >> 16);
    } else {
      std::memcpy(static_cast<float*>(out->untyped_data()) + q_row(row) * Dv, from, Dv * sizeof(float));
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
                                  .Attr<float>("scale"));
