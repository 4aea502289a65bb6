// mtp_jax_onednn: a KV cache's rows moved as bytes, in one XLA FFI call each (no oneDNN here): new rows
// written where the cache lies, and the rows a paged cache's block table names gathered.
//
//   MtpWriteRows(cache [..., *row], index s32 [U], rows [U, *row]) -> cache, in the operand's own buffer
//
// With the cache seen as R rows of rows' trailing shape (its leading axes flattened, row-major; the caller
// passes the cache in its own shape: a reshape in XLA would cost the aliasing), row index[u] = rows[u] for
// u = 0 .. U - 1 in order (a row written twice keeps the later one); an index outside [0, R) is dropped. The caller aliases the result to the cache operand (jax.ffi.ffi_call's
// input_output_aliases), so only the U new rows move: XLA:CPU computes a bf16 scatter or dynamic-update-slice
// in float32, converting the whole cache both ways on every write (every layer of every step: a serving
// step grew with its page pools). Any dtype: a row is copied as bytes.
//
//   MtpGatherRows(source [N, *row], index s32 [U]) -> [U, *row]
//
// Row u is source[index[u]], or zeros for an index outside [0, N) (a paged cache's sentinel page). XLA:CPU
// gathers a bf16 page pool element by element, through float32; here a row (a page) is one memcpy, spread
// over every core (MTP_JAX_ONEDNN_THREADS) from 2 MiB copied.

#include <cstdint>
#include <cstring>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error WriteRowsImpl(ffi::AnyBuffer cache, ffi::Buffer<ffi::S32> index, ffi::AnyBuffer rows,
                                ffi::Result<ffi::AnyBuffer> out) {
  const int64_t count = index.element_count();
  const size_t row_bytes = count ? rows.size_bytes() / count : 0;
  if (rows.element_type() != cache.element_type() || (count && (row_bytes == 0 || cache.size_bytes() % row_bytes))) {
    return ffi::Error::InvalidArgument("MtpWriteRows: cache [..., *row] and rows [U, *row] of one dtype expected");
  }
  const int64_t num_rows = count ? cache.size_bytes() / row_bytes : 0;
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());  // not aliased
  const char* src = static_cast<const char*>(rows.untyped_data());
  const int32_t* at = index.typed_data();
  for (int64_t u = 0; u < count; ++u) {
    if (at[u] >= 0 && at[u] < num_rows) std::memcpy(dst + at[u] * row_bytes, src + u * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

static ffi::Error GatherRowsImpl(ffi::AnyBuffer source, ffi::Buffer<ffi::S32> index, ffi::Result<ffi::AnyBuffer> out) {
  const int64_t count = index.element_count();
  const size_t row_bytes = count ? out->size_bytes() / count : 0;
  if (source.element_type() != out->element_type() || (count && (row_bytes == 0 || source.size_bytes() % row_bytes))) {
    return ffi::Error::InvalidArgument("MtpGatherRows: source [N, *row] and out [U, *row] of one dtype expected");
  }
  const int64_t num_rows = count ? source.size_bytes() / row_bytes : 0;
  const char* src = static_cast<const char*>(source.untyped_data());
  char* dst = static_cast<char*>(out->untyped_data());
  const int32_t* at = index.typed_data();
  const int threads = out->size_bytes() >= (size_t{2} << 20) ? mtp_onednn::Threads() : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t u = 0; u < count; ++u) {
    if (at[u] >= 0 && at[u] < num_rows) {
      std::memcpy(dst + u * row_bytes, src + at[u] * row_bytes, row_bytes);
    } else {
      std::memset(dst + u * row_bytes, 0, row_bytes);
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpGatherRows, GatherRowsImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpWriteRows, WriteRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
