"""Spike: XLA:CPU's dot vs a jax.ffi custom call into oneDNN's matmul, inside a jitted loop.

Build first (`benchmarks/ffi_spike/build.sh`), then run with oneDNN's OpenMP pool sized to the
cores: `OMP_NUM_THREADS=2 python benchmarks/ffi_spike/bench.py`. See README.md.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.layers.linear import dot_general

HERE = Path(__file__).resolve().parent
LIB = ctypes.cdll.LoadLibrary(str(HERE / "build" / "libonednn_matmul.so"))
for name, fn in (("onednn_matmul_plain", LIB.OnednnMatmulPlain), ("onednn_matmul_packed", LIB.OnednnMatmulPacked)):
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
LIB.onednn_packed_layout_differs.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
LIB.onednn_packed_layout_differs.restype = ctypes.c_int

SHAPES = {"qkv": (1024, 3072), "gate_up": (1024, 5632), "down": (2816, 1024), "head": (1024, 32000)}
ROWS = (1, 4, 8, 32)
DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def onednn(x, w, packed: bool):
    target = "onednn_matmul_packed" if packed else "onednn_matmul_plain"
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return jax.ffi.ffi_call(target, out)(x, w)


def xla(x, w):
    # The models' path: bf16 operands accumulate in fp32 (one row padded to two), cast back.
    return dot_general(x, w, (((1,), (0,)), ((), ())))


VARIANTS = {
    "XLA dot": xla,
    "oneDNN ffi, plain w": lambda x, w: onednn(x, w, False),
    "oneDNN ffi, packed w": lambda x, w: onednn(x, w, True),
}


def loop_fn(matmul, iters: int):
    @jax.jit
    def run(x, w):
        def body(_, x):
            y = matmul(x, w)
            # loop-carried, so nothing hoists: x <- x + 1e-6 * rowmax(y) (reads all of y)
            return x + (jnp.max(y, axis=1, keepdims=True) * 1e-6).astype(x.dtype)

        return jax.lax.fori_loop(0, iters, body, x)

    return run


def check(rng) -> None:
    for dname, dt in DTYPES.items():
        for M in (1, 3, 8, 32):
            for K, N in ((1024, 3072), (2816, 1024)):
                x = jnp.asarray(rng.standard_normal((M, K), np.float32), dt)
                w = jnp.asarray(rng.standard_normal((K, N), np.float32) * K**-0.5, dt)
                ref = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))  # exact products, fp32 sum
                for packed in (False, True):
                    got = np.asarray(jax.jit(lambda a, b, packed=packed: onednn(a, b, packed))(x, w)).astype(np.float32)
                    if dt == jnp.float32:
                        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
                    else:  # one bf16 rounding of an fp32 sum (order may differ): |err| <= 2^-8 |ref| + fp32 noise
                        err = np.abs(got - ref)
                        bound = 2.0**-8 * np.abs(ref) + 1e-5 * np.abs(ref).max()
                        assert (err <= bound * 1.01).all(), (dname, M, K, N, packed, float((err / bound).max()))
    print("check: ffi matches jnp.dot (fp32 rtol 1e-5; bf16 within one bf16 rounding), plain and packed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, load {os.getloadavg()}")
    check(rng)
    rows = []
    for sname, (K, N) in SHAPES.items():
        for dname, dt in DTYPES.items():
            w = jnp.asarray(rng.standard_normal((K, N), np.float32) * K**-0.5, dt)
            for M in ROWS:
                x = jnp.asarray(rng.standard_normal((M, K), np.float32), dt)
                fns = {v: loop_fn(f, args.iters) for v, f in VARIANTS.items()}
                for f in fns.values():  # compile + first call (packs the weight)
                    f(x, w).block_until_ready()
                best = {v: float("inf") for v in fns}
                for _ in range(args.rounds):  # interleaved
                    for v, f in fns.items():
                        t0 = time.perf_counter()
                        f(x, w).block_until_ready()
                        best[v] = min(best[v], (time.perf_counter() - t0) / args.iters * 1e3)
                differs = LIB.onednn_packed_layout_differs(M, K, N, 1 if dt == jnp.bfloat16 else 0)
                row = (f"{sname} {K}x{N}", dname, M, *best.values(), differs)
                rows.append(row)
                print(
                    f"{row[0]:>16} {dname:>8} M={M:<2} "
                    + " ".join(f"{v}={t:.3f}" for v, t in best.items())
                    + f" packed/xla={best['oneDNN ffi, packed w'] / best['XLA dot']:.2f} repacked={differs}",
                    flush=True,
                )
    load = os.getloadavg()
    lines = [
        f"jax {jax.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
        f"{args.iters} iterations per jit call, min of {args.rounds} interleaved rounds, ms per matmul; "
        f"load average at end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "",
        "| shape (KxN) | dtype | M | XLA dot | oneDNN ffi, plain w | oneDNN ffi, packed w "
        "| plain / XLA | packed / XLA | packed layout differs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s, d, M, tx, tp, tk, diff in rows:
        lines.append(
            f"| {s} | {d} | {M} | {tx:.3f} | {tp:.3f} | {tk:.3f} | {tp / tx:.2f} | {tk / tx:.2f} "
            f"| {'yes' if diff else 'no'} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
