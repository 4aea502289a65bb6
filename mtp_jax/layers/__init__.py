"""Building blocks shared by the main model and the MTP modules (`docs/MTP_SPEC.md`, "Every attention type").

`mla`: DeepSeek-V3's multi-head latent attention with its compressed latent cache; `moe`: DeepSeek-V3's
mixture of experts (sigmoid routing with the score-correction bias, group-limited top-k, shared experts).
"""
