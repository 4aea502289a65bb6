"""The main model: a decoder in Flax NNX (Llama/Qwen2, GLM-4.5, DeepSeek-V3) with an explicit cache.

Module and parameter names follow Hugging Face's `LlamaForCausalLM` and DeepSeek-V3 (`embed_tokens`,
`layers[i].self_attn`, `mlp`, `input_layernorm`, `norm`, `lm_head`), except the fused projections
(`self_attn.qkv_proj` group-major, `mlp.gate_up_proj` interleaved, so that a tensor-parallel shard
is self-contained; MLA's `fused_qkv_a_proj`), which `mtp_jax.checkpoints` fuses from the checkpoint's
separate tensors on load and takes apart again on export.

`Transformer.__call__(tokens, positions, cache)` runs T >= 1 new tokens per row at the positions the
caller gives against a per-layer cache and returns the logits, the final hidden states (which the MTP
modules consume) and the new cache; it never decides lengths (`mtp_jax.cache`).

Two layouts of the same weights (`ModelConfig.scan_layers`): `layers[i]`, one `DecoderLayer` per
layer run in a Python loop (compile time grows with depth), or `layer_groups[g]`, one `DecoderStack`
per run of layers of one kind (`ModelConfig.layer_groups`) run under `jax.lax.scan`, its parameters
with a leading layer axis (`layers.{start + i}.<path>` is `layer_groups.{g}.layer.<path>[i]`, see
`per_layer_path`) and its cache a `StackedCache`. A seed gives the same weights in both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mtp_jax.cache import KVCache, RecurrentCache, StackedCache
from mtp_jax.config import ModelConfig
from mtp_jax.layers import onednn
from mtp_jax.layers.decoder import DecoderLayer, DecoderStack
from mtp_jax.layers.indexing import sequence_positions, take_rows
from mtp_jax.layers.linear import dot_general, linear
from mtp_jax.layers.mla import MLACache
from mtp_jax.layers.norm import RMSNorm
from mtp_jax.mtp import make_mtp_modules

Cache = KVCache | MLACache | RecurrentCache | StackedCache  # one entry of the main model's cache


class Transformer(nnx.Module):
    """Decoder-only language model in Hugging Face's layout: Llama / Qwen2 / Mistral (`LlamaForCausalLM`),
    GLM-4.5's attention (partial rotary, q/k norm), DeepSeek-V3 (MLA, MoE from layer
    `first_k_dense_replace` on), and Qwen3.5 (Gated DeltaNet and gated attention layers, zero-centred
    norms), as `config` selects."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed_tokens = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=config.compute_dtype,
            param_dtype=config.weight_dtype,
            embedding_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
            embedding_metadata={"logical_axes": ("vocab", "embed")},
        )
        layers = [DecoderLayer(config, rngs, i) for i in range(config.num_hidden_layers)]
        if config.scan_layers:  # built per layer, then stacked: the same weights as the unrolled layout
            self.layer_groups = nnx.List([DecoderStack(layers[g.start : g.stop], g.start) for g in config.layer_groups])
        else:
            self.layers = nnx.List(layers)
        self.norm = RMSNorm.of(config)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else linear(config, config.hidden_size, config.vocab_size, rngs, axes=("embed", "vocab"), name="lm_head")
        )
        # D MTP modules (an empty nnx.List when D = 0), created last so the main weights do not depend on D.
        self.mtp = make_mtp_modules(config, rngs)

    @property
    def blocks(self) -> nnx.List:
        """What the forward runs in turn, one cache each: `layer_groups` (scan_layers) or `layers`."""
        return self.layer_groups if self.config.scan_layers else self.layers

    def embed(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        """The embedding table's rows for `tokens` in the Embed's dtype (`nnx.Embed`'s lookup). The table
        passes an optimization barrier first: XLA:CPU gathers from a bfloat16 table through a float32
        conversion, which inside `DecodeEngine.run`'s loop XLA hoists out as a float32 copy of the whole
        table, allocated on every run (V x E x 4 bytes: `run`'s temporary memory on the medium preset in
        bf16 134 MiB with it, 9 MiB without; 3.7 GB for DeepSeek-V3's table); behind the barrier the
        conversion stays fused into the gather (the rows only). Step times did not change measurably."""
        # tied to the tokens (new every step), the table is no longer loop-invariant: nothing to hoist
        table, tokens = jax.lax.optimization_barrier((self.embed_tokens.embedding[...], tokens))
        if self.embed_tokens.dtype is not None:
            table = table.astype(self.embed_tokens.dtype)
        return jnp.take(table, tokens, axis=0)

    def head(self, x: Float[Array, "B T E"]) -> Float[Array, "B T V"]:
        """Output head (shared with the MTP modules): logits in float32. Apply after the final norm."""
        if self.lm_head is None:  # tied: x @ embedding.T, as `nnx.Embed.attend` but through `dot_general`
            packed = onednn.packed_for(self.embed_tokens, onednn.TIED_HEAD, x)  # a CPU DecodeEngine's copy
            if packed is not None:
                dot = onednn.PackedDot(self.config.hidden_size, self.config.vocab_size)
                return dot(x.astype(packed.dtype), packed, (((x.ndim - 1,), (0,)), ((), ()))).astype(jnp.float32)
            embedding = self.embed_tokens.embedding[...].astype(x.dtype)  # [V, E]
            return dot_general(x, embedding, (((x.ndim - 1,), (1,)), ((), ()))).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def init_cache(self, batch_size: int, max_length: int) -> tuple[Cache, ...]:
        """The main model's empty cache, capacity `max_length` tokens: one cache per layer (`KVCache` or
        `MLACache`, arrays [B, S, ...]), or with `scan_layers` one `StackedCache` per layer group.

        Raises ValueError for a batch size or capacity below 1.
        """
        return tuple(block.init_cache(batch_size, max_length) for block in self.blocks)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: tuple[Cache, ...],
        segment_ids: Int[Array, "B T"] | None = None,
        *,
        logits_at: Int[Array, " B"] | None = None,
        with_logits: bool = True,
        advance: Int[Array, " B"] | None = None,
        keep_candidates: bool = False,
    ) -> tuple[jax.Array | None, jax.Array, tuple[Cache, ...]]:
        """Forward of T new tokens per row at the positions the caller gives (the model contract).

        Args:
          tokens: int32 [B, T]; ids must lie in [0, V) (not checked inside jit).
          positions: int32 [B, T], each row's T contiguous absolute positions. The new entries are
            written there and token t attends to cache positions <= positions[b, t]; positions at
            or past S are dropped (such rows give wrong results rather than corrupt others; callers
            bound them).
          cache: `init_cache`'s pytree (one cache per layer, or per layer group with `scan_layers`),
            holding each row's earlier positions.
          segment_ids: optional int32 [B, T] document ids of packed rows (training). When given, the
            cache must be empty: token t attends only to new tokens s <= t of its own segment.
          logits_at: optional int32 [B]: compute the logits of row b's new token `logits_at[b]`
            only (a prefill needs the last prompt token's), as float32 [B, 1, V].
          with_logits: False to skip the final norm and head (logits None): a caller that needs
            both the normed hidden states and the logits applies `norm` and `head` itself, once.
          advance: optional int32 [B] in [0, T], for recurrent layers (`ModelConfig.layer_types`): their
            state absorbs row b's first `advance[b]` new tokens only (a right-padded prefill: its prompt's).
            Default all T. Attention layers ignore it.
          keep_candidates: static; recurrent layers return `mtp_jax.cache.RecurrentCandidates` (the state
            after each new token) for a speculative commit to select from (`mtp_jax.cache.settle`).

        Returns:
          logits float32 [B, T, V] ([B, 1, V] with `logits_at`, None without `with_logits`); hidden
          states [B, T, E] *before* the final norm (the input of `norm` and `head`); the cache with
          the T new entries written.
          The model keeps no lengths: which positions are live is the caller's state.
        """
        x = self.embed(tokens)
        new_cache = []
        for block, block_cache in zip(self.blocks, cache, strict=True):
            x, block_cache = block(
                x, positions, block_cache, segment_ids, advance=advance, keep_candidates=keep_candidates
            )
            new_cache.append(block_cache)
        if not with_logits:
            return None, x, tuple(new_cache)
        logits = self.head(self.norm(x if logits_at is None else take_rows(x, logits_at)))
        return logits, x, tuple(new_cache)

    def forward_full(
        self, tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """Forward over whole sequences from position 0 with no prior cache: (logits, hidden states).

        With `segment_ids` (int32 [B, T]), packed documents do not attend to each other.
        """
        batch, num = tokens.shape
        logits, hidden, _ = self(tokens, sequence_positions(batch, num), self.init_cache(batch, num), segment_ids)
        return logits, hidden


def per_layer_path(path: tuple[str | int, ...], config: ModelConfig) -> list[tuple[str | int, ...]]:
    """The unrolled layout's paths of the slices of one parameter path (as `nnx.state` gives it).

    `("layer_groups", g, "layer", *rest)`, whose array is [n, ...], is the n paths
    `("layers", start + i, *rest)` of its slices i; any other path is itself (a list of one).
    """
    if str(path[0]) != "layer_groups":
        return [path]
    group = config.layer_groups[int(path[1])]
    return [("layers", layer, *path[3:]) for layer in group]


class _ShapeOnlyRngs:
    """`nnx.Rngs` for a model whose initial values are never computed (`nnx.eval_shape`): every stream
    hands out one fixed key. Under tracing, `nnx.Rngs`' counter update costs time in proportion to the
    program traced so far (JAX builds an error message on each `sharding` lookup of a tracer): 5 s for
    DeepSeek-V3 against 0.5 s with this; the shapes, dtypes and metadata are the same."""

    def __getattr__(self, stream: str):
        if stream.startswith("__"):
            raise AttributeError(stream)
        return lambda: jax.random.key(0)

    def __call__(self) -> jax.Array:
        return jax.random.key(0)


def abstract_model(config: ModelConfig) -> Transformer:
    """The `Transformer` of `config` with every parameter a `jax.ShapeDtypeStruct` (its metadata, the
    logical axes included, as a real model's): nothing is computed or allocated."""
    return nnx.eval_shape(lambda: Transformer(config, rngs=_ShapeOnlyRngs()))


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
        return self is other or (
            isinstance(other, StaticGraph) and self._hash == other._hash and self.graphdef == other.graphdef
        )

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
