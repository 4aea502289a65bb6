#!/usr/bin/env bash
# All GPU benchmarks in one command, in under 10 minutes on an H100/H200:
#   benchmarks/gpu/run_all.sh            (extra arguments go to each script, e.g. --preset hopper)
# Results: benchmarks/results/ (and $OUT when set), named by device and date.
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
# The script stops timing new shapes after --budget-s (400 s); the timeout is the backstop.
timeout 460 "$PYTHON" benchmarks/gpu/bench_verify_attention.py "$@"
# Whether the FP8 dequantization fuses into the dot, and FP8 vs bf16 matmul time (about a minute).
timeout 180 "$PYTHON" benchmarks/gpu/bench_fp8_matmul.py
