// mtp_jax_onednn: new rows written into a KV cache where it lies, in one XLA FFI call (no oneDNN here).
//
//   MtpWriteRows(cache [..., *row], index s32 [U], rows [U, *row]) -> cache, in the operand's own buffer
//
// With the cache seen as R rows of rows' trailing shape (its leading axes flattened, row-major; the caller
// passes the cache in its own shape: a reshape in XLA would cost the aliasing), row index[u] = rows[u] for
// u = 0 .. U - 1 in order (a row written twice keeps the later one); an index outside [0, R) is dropped. The caller aliases the result to the cache operand (jax.ffi.ffi_call's
// input_output_aliases), so only the U new rows move: XLA:CPU computes a bf16 scatter or dynamic-update-slice
// in float32, converting the whole cache both ways on every write (every layer of every step: a serving
// step grew with its page pools). Any dtype: a row is copied as bytes.

#include <cstdint>
#include <cstring>

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(MtpWriteRows, WriteRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
