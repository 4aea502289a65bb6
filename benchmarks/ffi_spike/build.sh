#!/usr/bin/env bash
# Builds build/libonednn_matmul.so (the XLA FFI handlers) against jaxlib's FFI headers and the
# venv's oneDNN (pip install onednn-devel-cpu-gomp onednn-cpu-gomp: headers in .venv/include,
# libdnnl.so in .venv/lib). Run from anywhere with the venv active.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
prefix="$(python -c 'import sys; print(sys.prefix)')"
ffi_inc="$(python -c 'import jax; print(jax.ffi.include_dir())')"
mkdir -p "$here/build"
set -x
g++ -O3 -shared -fPIC -std=c++17 \
  -I"$ffi_inc" -I"$prefix/include" \
  "$here/onednn_matmul.cc" -o "$here/build/libonednn_matmul.so" \
  -L"$prefix/lib" -ldnnl -Wl,-rpath,"$prefix/lib"
