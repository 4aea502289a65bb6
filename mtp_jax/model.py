"""The main model: a Llama/Qwen2-family decoder in Flax NNX with an explicit KV cache.

Module and parameter names follow Hugging Face's `LlamaForCausalLM` (`embed_tokens`,
`layers[i].self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, `norm`, `lm_head`), which are
also DeepSeek-V3's names, so checkpoint import is a rename-free walk (`mtp_jax.checkpoint`).

`Transformer.__call__` runs T >= 1 new tokens per row at per-row positions against a cache and
returns the logits, the final hidden states (which the MTP modules consume) and the new cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mtp_jax.attention import attend, segment_attention_reference
from mtp_jax.cache import KVCache, write_at
from mtp_jax.config import ModelConfig
from mtp_jax.layers.ffn import MLP
from mtp_jax.layers.linear import linear
from mtp_jax.layers.norm import RMSNorm
from mtp_jax.rope import apply_rope


def take_rows(x: Float[Array, "B T ..."], index: Int[Array, " B"]) -> Float[Array, "B 1 ..."]:
    """`x[b, index[b]]` for each row b, keeping a length-1 T axis."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, reading and writing one layer of the KV cache."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        d, h, g = config.resolved_head_dim, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = linear(config, config.hidden_size, h * d, rngs, config.attention_bias)
        self.k_proj = linear(config, config.hidden_size, g * d, rngs, config.attention_bias)
        self.v_proj = linear(config, config.hidden_size, g * d, rngs, config.attention_bias)
        self.o_proj = linear(config, h * d, config.hidden_size, rngs)

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        k_cache: jax.Array,
        v_cache: jax.Array,
        start: Int[Array, " B"],
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        c = self.config
        batch, num_new, _ = x.shape
        d, h, g = c.resolved_head_dim, c.num_attention_heads, c.num_key_value_heads
        q = self.q_proj(x).reshape(batch, num_new, h, d)  # [B, T, H, D]
        k = self.k_proj(x).reshape(batch, num_new, g, d)  # [B, T, G, D]
        v = self.v_proj(x).reshape(batch, num_new, g, d)  # [B, T, G, D]
        q, k = apply_rope(q, positions, c), apply_rope(k, positions, c)
        k_cache, v_cache = write_at(k_cache, k, start), write_at(v_cache, v, start)
        if segment_ids is None:
            out = attend(
                q, k_cache, v_cache, start + num_new, scale=c.attention_scale, impl=c.attention_impl
            )  # [B, T, H, D]
        else:  # whole packed sequences from an empty cache (training): attend within each segment only
            out = segment_attention_reference(q, k, v, segment_ids, scale=c.attention_scale)  # [B, T, H, D]
        return self.o_proj(out.reshape(batch, num_new, h * d)), k_cache, v_cache


class DecoderLayer(nnx.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype)
        self.mlp = MLP(config, rngs)

    def __call__(self, x, positions, k_cache, v_cache, start, segment_ids=None):
        attn, k_cache, v_cache = self.self_attn(
            self.input_layernorm(x), positions, k_cache, v_cache, start, segment_ids
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class Transformer(nnx.Module):
    """Decoder-only language model (HF `LlamaForCausalLM` / `Qwen2ForCausalLM` layout)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if config.attention_type != "gqa" or config.ffn_type != "dense" or config.partial_rotary_factor != 1 \
                or config.use_qk_norm:
            raise ValueError("the Transformer runs attention_type='gqa' with full rotary and no qk-norm, and "
                             f"ffn_type='dense' (got {config.attention_type!r}, partial_rotary_factor="
                             f"{config.partial_rotary_factor}, use_qk_norm={config.use_qk_norm}, {config.ffn_type!r}): "
                             "MLA, MoE and GLM-4.5 attention are layers in mtp_jax.layers, not yet wired into it")
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=config.compute_dtype,
            param_dtype=config.weight_dtype,
            embedding_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(config, rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.weight_dtype)
        self.lm_head = (
            None if config.tie_word_embeddings else linear(config, config.hidden_size, config.vocab_size, rngs)
        )
        from mtp_jax.mtp import make_mtp_modules  # mtp.py builds on this module's DecoderLayer

        # D MTP modules (an empty nnx.List when D = 0), created last so the main weights do not depend on D.
        self.mtp = make_mtp_modules(config, rngs)

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        return self.embed_tokens(tokens)

    def head(self, x: Float[Array, "B T E"]) -> Float[Array, "B T V"]:
        """Output head (shared with the MTP modules): logits in float32. Apply after the final norm."""
        if self.lm_head is None:
            return self.embed_tokens.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def __call__(
        self, tokens: Int[Array, "B T"], cache: KVCache, segment_ids: Int[Array, "B T"] | None = None, *,
        logits_at: Int[Array, " B"] | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Forward of T new tokens per row, at positions `cache.lengths[b] + t`.

        Args:
          tokens: int32 [B, T]; ids must lie in [0, V) (not checked inside jit).
          cache: a `KVCache` with `lengths[b] + T <= S` (writes past S are dropped, so rows that
            would overflow give wrong results rather than corrupt others; callers bound T).
          segment_ids: optional int32 [B, T] document ids of packed rows (training). When given, the
            cache must be empty: token t attends only to new tokens s <= t of its own segment.
          logits_at: optional int32 [B]: compute the logits of row b's new token `logits_at[b]`
            only (a prefill needs the last prompt token's), as float32 [B, 1, V].

        Returns:
          logits float32 [B, T, V] ([B, 1, V] with `logits_at`); hidden states [B, T, E] *before*
          the final norm (the input of `norm` and `head`); the cache with the T new entries written
          and `lengths + T`. Rolling back to fewer committed tokens is `cache.replace(lengths=...)`.
        """
        start = cache.lengths
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]  # [B, T]
        x = self.embed(tokens)
        new_k, new_v = [], []
        for layer, k_cache, v_cache in zip(self.layers, cache.k, cache.v, strict=True):
            x, k_cache, v_cache = layer(x, positions, k_cache, v_cache, start, segment_ids)
            new_k.append(k_cache)
            new_v.append(v_cache)
        logits = self.head(self.norm(x if logits_at is None else take_rows(x, logits_at)))
        return logits, x, KVCache(k=tuple(new_k), v=tuple(new_v), lengths=start + tokens.shape[1])

    def forward_full(
        self, tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Forward over whole sequences from position 0 with no prior cache: (logits, hidden states).

        With `segment_ids` (int32 [B, T]), packed documents do not attend to each other.
        """
        cache = KVCache.init(self.config, tokens.shape[0], tokens.shape[1])
        logits, hidden, _ = self(tokens, cache, segment_ids)
        return logits, hidden


def init_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised `Transformer` (weights ~ N(0, initializer_range), norms at 1)."""
    return Transformer(config, rngs=nnx.Rngs(seed))


class StaticGraph:
    """A model's `nnx.GraphDef` as a jit static argument, hashed once.

    Hashing or comparing a GraphDef walks the whole graph (about a millisecond for the demo model),
    and jit does both on every call with a static argument, which is as long as a decode step of a
    small model. `static_split` hands out one interned `StaticGraph` per distinct GraphDef, so
    repeated calls hash an int and compare by identity.
    """

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: nnx.GraphDef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self._hash == other._hash
                                 and self.graphdef == other.graphdef)

    def merge(self, params: nnx.State) -> Transformer:
        """The model rebuilt from this graph and `params` (inside jit: `nnx.merge`)."""
        return nnx.merge(self.graphdef, params)


@functools.lru_cache(maxsize=32)
def _interned(graphdef: nnx.GraphDef) -> StaticGraph:
    return StaticGraph(graphdef)


def static_split(model: Transformer) -> tuple[StaticGraph, nnx.State]:
    """`nnx.split(model)` with the GraphDef interned as a `StaticGraph` (for the jitted decode steps)."""
    graphdef, params = nnx.split(model)
    return _interned(graphdef), params
