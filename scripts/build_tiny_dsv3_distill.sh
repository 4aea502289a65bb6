#!/usr/bin/env bash
# Self-distillation before/after on a tiny DeepSeek-V3 (benchmarks/results/self_distill_dsv3_cpu_*.{json,md},
# docs/benchmarks.md): MLA attention, one dense layer then MoE layers (sigmoid router with
# e_score_correction_bias, 8 routed experts of which 2 per token in 2 of 4 groups, 1 shared expert), one MTP
# layer stored as DeepSeek-V3 stores it (`model.layers.{N}`: enorm, hnorm, eh_proj, shared_head), the
# bundled demo model's tokenizer (vocab 4096) so that bench_self_distill's held-out prompts apply.
#
#   1. a random init written as a Hugging Face DeepSeek-V3 checkpoint (save_hf_checkpoint), which every
#      later step loads through the importer (a model directory);
#   2. the trunk + MTP layer trained from scratch on the stdlib corpus (data labels, MTP loss on),
#      aux-loss-free balancing on (--bias-update-speed): RUN/trunk/export = "before";
#   3. `distill-data` (the model's own greedy continuations), MTP-only training with --mtp-targets self:
#      RUN/heads/export = "after" (the trunk frozen, byte-identical);
#   4. bench_self_distill on both.
#
# Usage: bash scripts/build_tiny_dsv3_distill.sh [RUN_DIR]   (default /work/runs/tiny_dsv3; about 45 minutes
# on 2 shared CPU cores). The recorded run's trunk began as a 240-step schedule stopped (SIGTERM, which
# checkpoints) at step 34 and was resumed with `--resume --steps 130`, which redraws the cosine schedule from
# there; the straight 130-step run below differs slightly.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${1:-/work/runs/tiny_dsv3}
mkdir -p "$RUN"

python - "$RUN/init" mtp_jax/assets/demo/tokenizer.json <<'EOF'
import shutil
import sys

from mtp_jax.checkpoints import save_hf_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model

out, tokenizer = sys.argv[1], sys.argv[2]
config = ModelConfig(
    vocab_size=4096, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
    attention_type="mla", q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
    v_head_dim=32, ffn_type="moe", moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
    scoring_func="sigmoid", norm_topk_prob=True, eos_token_id=0, num_nextn_predict_layers=1,
)
save_hf_checkpoint(init_model(config, seed=0), out, overwrite=True)
shutil.copy(tokenizer, f"{out}/tokenizer.json")
EOF

mtp-jax train "$RUN/trunk" --model "$RUN/init" --steps 130 --batch-size 12 --seq-len 256 --lr 3e-3 --warmup 20 \
  --bias-update-speed 0.01 --eval-every 0 --checkpoint-every 50 --log-every 10 --no-progress
mtp-jax distill-data "$RUN/trunk/export" --out "$RUN/distill" --num-samples 256 --max-new-tokens 128 --prompt-len 64 \
  --batch-size 32 --no-progress
mtp-jax train "$RUN/heads" --init-from "$RUN/trunk/export" --mtp-only --data "$RUN/distill" --mtp-targets self \
  --steps 150 --batch-size 16 --seq-len 256 --lr 1e-3 --warmup 15 --eval-every 0 --checkpoint-every 50 \
  --log-every 10 --no-progress
python benchmarks/bench_self_distill.py "$RUN/trunk/export" "$RUN/heads/export" --labels before after \
  --name self_distill_dsv3 --repeats 2
