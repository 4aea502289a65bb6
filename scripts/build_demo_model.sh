#!/usr/bin/env bash
# Regenerates the bundled demo model: trains it on this interpreter's standard library, fine-tunes its MTP
# heads on its own greedy continuations (self-distillation: the trunk frozen, byte-identical), evaluates it
# on the held-out split, and writes weights + config + tokenizer + model card into mtp_jax/assets/demo.
# About 1.9 hours on 2 CPU cores. Usage: bash scripts/build_demo_model.sh [RUN_DIR]
# (The bundled heads ran 300 steps, then were resumed to 600: `--resume --steps 600`, which redraws the
# cosine schedule from step 300; a straight 600-step run differs slightly.)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-runs/demo}
mtp-jax train "$RUN" --model demo --steps 800 --batch-size 16 --seq-len 256 --lr 3e-3 --warmup 50 \
  --eval-every 200 --checkpoint-every 50 --log-every 10 --no-progress
mtp-jax distill-data "$RUN/export" --out "$RUN-distill" --num-samples 1024 --max-new-tokens 192 --prompt-len 64 \
  --batch-size 32 --no-progress
mtp-jax train "$RUN-heads" --init-from "$RUN/export" --mtp-only --data "$RUN-distill" --mtp-targets self \
  --steps 600 --batch-size 16 --seq-len 256 --lr 1e-3 --warmup 20 --eval-every 100 --checkpoint-every 100 \
  --log-every 20 --no-progress
python scripts/model_card.py "$RUN" --heads "$RUN-heads" --out mtp_jax/assets/demo --overwrite
