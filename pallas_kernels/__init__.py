"""Pallas kernels for mtp_jax, each beside its plain-jnp reference and tested in interpret mode on CPU.

`verify_attention`: the verify pass's attention, T = K + 1 new queries per row against a KV cache
(grouped-query, per-row lengths, causal mask aligned to the end of each row), split-K over the cache.
`paged_verify_attention`: the same attention over a paged KV cache (a pool of pages and a block table
per row; GQA, and MLA's absorbed form with its latent and rope-key pools), with
`paged_attention_reference` beside it.
"""

from pallas_kernels.paged_attention import (
    PagedAttentionConfig,
    paged_attention_reference,
    paged_verify_attention,
    supports_paged,
)
from pallas_kernels.verify_attention import (
    PRESETS,
    VerifyAttentionConfig,
    supports,
    verify_attention,
    verify_attention_reference,
)

__all__ = [
    "PRESETS",
    "PagedAttentionConfig",
    "VerifyAttentionConfig",
    "paged_attention_reference",
    "paged_verify_attention",
    "supports",
    "supports_paged",
    "verify_attention",
    "verify_attention_reference",
]
