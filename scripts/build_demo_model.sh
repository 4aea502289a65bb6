#!/usr/bin/env bash
# Regenerates the bundled demo model: trains it on this interpreter's standard library, evaluates it
# on the held-out split, and writes weights + config + tokenizer + model card into mtp_jax/assets/demo.
# About 1.5 hours on 2 CPU cores. Usage: bash scripts/build_demo_model.sh [RUN_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/demo}
mtp-jax train "$RUN" --model demo --steps 800 --batch-size 16 --seq-len 256 --lr 3e-3 --warmup 50 \
  --eval-every 200 --checkpoint-every 50 --log-every 10 --no-progress
python scripts/model_card.py "$RUN" --out mtp_jax/assets/demo --overwrite
