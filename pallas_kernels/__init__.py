"""Pallas kernels for mtp_jax, each beside its plain-jnp reference and tested in interpret mode on CPU.

`verify_attention`: the verify pass's attention, T = K + 1 new queries per row against a KV cache
(grouped-query, per-row lengths, causal mask aligned to the end of each row), split-K over the cache.
"""

from pallas_kernels.verify_attention import (
    PRESETS,
    VerifyAttentionConfig,
    supports,
    verify_attention,
    verify_attention_reference,
)

__all__ = ["PRESETS", "VerifyAttentionConfig", "supports", "verify_attention", "verify_attention_reference"]
