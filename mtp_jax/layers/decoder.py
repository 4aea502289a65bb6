"""The pre-norm decoder layer (Llama / DeepSeek-V3 names), shared by the main model and the MTP modules."""

from __future__ import annotations

from flax import nnx

from mtp_jax.cache import KVCache
from mtp_jax.config import ModelConfig
from mtp_jax.layers.attention import Attention
from mtp_jax.layers.ffn import MLP
from mtp_jax.layers.norm import RMSNorm


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype)
        self.mlp = MLP(config, rngs)

    def init_cache(self, batch_size: int, max_length: int) -> KVCache:
        """This layer's empty cache, capacity `max_length` tokens."""
        return KVCache.init(self.config, batch_size, max_length)

    def __call__(self, x, positions, cache, segment_ids=None):
        attn, cache = self.self_attn(self.input_layernorm(x), positions, cache, segment_ids)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache
