"""Multi-Token Prediction (MTP) modules, attached to the main model as `Transformer.mtp`.

DeepSeek-V3 style (`mtp_style="deepseek"`, arXiv 2412.19437 §2.2; docs/MTP_SPEC.md "MTP modules").
Module k = 1..D at sequence index i combines the previous depth's hidden state h_i^{k-1} with the
embedding of token t_{i+k} and predicts t_{i+k+1}:

    h'_i  = eh_proj(concat(enorm(embed(t_{i+k})), hnorm(h_i^{k-1})))    # [B, T, 2E] -> [B, T, E]
    o_i   = Block_k(h'_i)                                                # causal over indices <= i
    logits_i = head(shared_head.norm(o_i))                               # float32 [B, T, V]
    h_i^k = shared_head.norm(o_i) or o_i                                 # the hidden chained onward

h^0 is the main model's hidden state, after its final norm or before it; the concat order, the
chained hidden and MiMo's zero embedding at position 0 are checkpoint conventions, all set in
`ModelConfig` (`mtp_concat_order`, `mtp_hidden_after_norm`, `mtp_chain_after_shared_head_norm`,
`mtp_zero_embedding_at_start`). Qwen3.5's `mtp.*` head and MiMo's `model.mtp_layers.*` are this module
under other names (`ModelConfig.mtp_layout`, `mtp_jax.checkpoints.names`). `embed` and `head` are the main
model's, passed in at call time, never copied.

Parallel heads (`mtp_style="parallel"`, Gloeckle et al. 2024, arXiv 2404.19737 §2): head k is one
transformer block over the trunk's hidden state h^0 with no token input, and predicts t_{i+1+k}
through `shared_head.norm` and the shared head: `logits_i = head(shared_head.norm(Block_k(h_i^0)))`.

Parameter names follow DeepSeek-V3's README_WEIGHTS.md: module k holds `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm` and the block's own `input_layernorm`, `self_attn.*`,
`post_attention_layernorm`, `mlp.*` directly (the modules subclass `DecoderLayer`), so checkpoint
key `model.layers.{L + k - 1}.<name>` maps onto `mtp[k - 1].<name>`.

Positions: a module call runs its T rows at the positions the caller gives, in its own one-layer
cache, like the main model: row i of a depth sits at position i, the position of h_i^{k-1}.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mtp_jax.cache import KVCache
from mtp_jax.config import ModelConfig
from mtp_jax.layers.decoder import DecoderLayer
from mtp_jax.layers.indexing import sequence_positions, take_rows
from mtp_jax.layers.linear import linear
from mtp_jax.layers.norm import RMSNorm

# Filters for `nnx.state`, `nnx.Optimizer(..., wrt=...)` and `nnx.DiffState`: the MTP modules'
# parameters, and the main model's. Training only the MTP modules (frozen main model) is an
# optimizer with `wrt=MTP_PARAMS`, or gradients taken with `nnx.DiffState(0, MTP_PARAMS)`.
MTP_PARAMS = nnx.All(nnx.Param, nnx.PathContains("mtp"))
MAIN_PARAMS = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("mtp")))

Embed = Callable[[Int[Array, "B T"]], Float[Array, "B T E"]]
Head = Callable[[Float[Array, "B T E"]], Float[Array, "B T V"]]


class SharedHead(nnx.Module):
    """DeepSeek-V3's `shared_head`, holding only `norm`: the projection is the main model's head, shared."""

    def __init__(self, config: ModelConfig):
        self.norm = RMSNorm.of(config)


class _MTPBlock(DecoderLayer):
    """A `DecoderLayer` with `shared_head.norm`, run against its own one-layer cache.

    `layer_index` is the layer's number in the checkpoint (L + k - 1 for module k): it decides the
    feed-forward block as for the main model's layers (DeepSeek-V3's MTP layers are MoE layers).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer_index: int):
        super().__init__(config, rngs, layer_index)
        self.shared_head = SharedHead(config)

    def _block_and_head(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        head: Head,
        segment_ids: Int[Array, "B T"] | None,
        logits_at: Int[Array, " B"] | None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        out, cache = DecoderLayer.__call__(self, x, positions, cache, segment_ids)
        normed = self.shared_head.norm(out)
        chained = normed if self.config.mtp_chain_after_shared_head_norm else out
        logits = head(normed if logits_at is None else take_rows(normed, logits_at))
        return logits, chained, cache


class MTPModule(_MTPBlock):
    """DeepSeek-V3 MTP module: `enorm`, `hnorm`, `eh_proj`, one transformer block, `shared_head.norm`.

    A `DecoderLayer` subclass so the block's parameters sit at the module's top level, as in the
    checkpoint; `__call__` is the whole module (the block alone is `DecoderLayer.__call__`).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, layer_index: int):
        super().__init__(config, rngs, layer_index)
        self.enorm = RMSNorm.of(config)
        self.hnorm = RMSNorm.of(config)
        self.eh_proj = linear(
            config, 2 * config.hidden_size, config.hidden_size, rngs, axes=(None, "embed"), name="eh_proj"
        )

    def __call__(
        self,
        hidden: Float[Array, "B T E"],
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        *,
        embed: Embed,
        head: Head,
        segment_ids: Int[Array, "B T"] | None = None,
        logits_at: Int[Array, " B"] | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """One depth over T rows per batch row.

        Args:
          hidden: h^{k-1} of shape [B, T, E] (h^0 for k = 1, see `initial_hidden`).
          tokens: int32 [B, T], t_{i+k} for row i.
          positions: int32 [B, T], the contiguous positions i of the rows (row i of a depth sits at
            the position of h_i^{k-1}), written into and attended over in `cache`.
          cache: this module's one-layer cache (`init_cache`).
          embed, head: the main model's `embed` and `head` (shared, not copied).
          segment_ids: optional int32 [B, T] packed-document ids; needs an empty cache (training).
          logits_at: optional int32 [B]: logits of row b's row `logits_at[b]` only, [B, 1, V] (drafting
            needs one row per step: the head is the module's largest matmul).

        Returns:
          logits float32 [B, T, V] (row i predicts t_{i+k+1}; [B, 1, V] with `logits_at`); h^k of
          shape [B, T, E], as chained to
          depth k + 1 (`config.mtp_chain_after_shared_head_norm`); the cache with the T entries written.
        """
        embedded = embed(tokens)  # [B, T, E]
        if self.config.mtp_zero_embedding_at_start:  # MiMo: row 0 pairs h_0 with no token embedding
            embedded = jnp.where(positions[..., None] == 0, 0, embedded).astype(embedded.dtype)
        e, h = self.enorm(embedded), self.hnorm(hidden)  # [B, T, E] each
        parts = (e, h) if self.config.mtp_concat_order == "embedding_first" else (h, e)
        x = self.eh_proj(jnp.concatenate(parts, axis=-1))  # [B, T, 2E] -> [B, T, E]
        return self._block_and_head(x, positions, cache, head, segment_ids, logits_at)


class ParallelMTPHead(_MTPBlock):
    """Gloeckle et al. 2024 head: one transformer block over the trunk's h^0, then `shared_head.norm`."""

    def __call__(
        self,
        hidden: Float[Array, "B T E"],
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        cache: KVCache,
        *,
        embed: Embed,
        head: Head,
        segment_ids: Int[Array, "B T"] | None = None,
        logits_at: Int[Array, " B"] | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Same interface as `MTPModule.__call__`; `hidden` is always h^0 and `tokens`, `embed` are unused.

        Returns logits float32 [B, T, V] (head k's row i predicts t_{i+1+k}), the head's hidden
        [B, T, E] (after or before `shared_head.norm`, as configured; nothing is chained: every head
        reads h^0) and the cache with the T entries written.
        """
        del tokens, embed  # no token input: every head reads the shared trunk only
        return self._block_and_head(hidden, positions, cache, head, segment_ids, logits_at)


def make_mtp_modules(config: ModelConfig, rngs: nnx.Rngs) -> nnx.List:
    """The D = `config.num_nextn_predict_layers` modules of `config.mtp_style` (empty when D = 0).

    An FP8 model whose `Fp8Config.quantize_mtp` is False gets unquantized modules: every linear and routed
    expert in `config.weight_dtype` (the modules are built from the config without `quantization`, which
    they hold as theirs), however the trunk is stored."""
    if config.quantization is not None and not config.quantization.quantize_mtp:
        config = config.replace(quantization=None)
    cls = MTPModule if config.mtp_style == "deepseek" else ParallelMTPHead
    return nnx.List([cls(config, rngs, config.num_hidden_layers + k) for k in range(config.num_nextn_predict_layers)])


def initial_hidden(
    model: nnx.Module, main_hidden: Float[Array, "B T E"], normed: Float[Array, "B T E"] | None = None
) -> Float[Array, "B T E"]:
    """h^0 from the main model's hidden state (as `Transformer.__call__` returns it, before the final
    norm): `model.norm(main_hidden)` when `config.mtp_hidden_after_norm`, else unchanged. `normed`:
    `model.norm(main_hidden)` where the caller has it already (the verify pass, which needs it for
    its logits too), so it is not computed twice."""
    if not model.config.mtp_hidden_after_norm:
        return main_hidden
    return model.norm(main_hidden) if normed is None else normed


def shift_left(tokens: Int[Array, "B T"], n: int, fill: int = 0) -> Int[Array, "B T"]:
    """`out[:, i] = tokens[:, i + n]`, and `fill` where `i + n >= T`."""
    num = tokens.shape[1]
    n = min(n, num)
    return jnp.concatenate([tokens[:, n:], jnp.full((tokens.shape[0], n), fill, tokens.dtype)], axis=1)


def mtp_forward_full(
    model: nnx.Module,
    main_hidden: Float[Array, "B T E"],
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"] | None = None,
) -> list[Float[Array, "B T V"]]:
    """All D depths over whole sequences from position 0, no prior cache (training; the decoding oracle).

    Args:
      model: the main `Transformer`, holding the modules in `model.mtp`.
      main_hidden: the main model's hidden states [B, T, E] before its final norm (as returned by
        `Transformer.__call__` / `forward_full` on the same tokens).
      tokens: int32 [B, T], the sequence t_0 .. t_{T-1}.
      segment_ids: optional int32 [B, T] packed-document ids: attention stays within a document.

    Returns:
      D arrays of logits float32 [B, T, V]; depth k's row i predicts t_{i+k+1}. Its token input
      t_{i+k} is 0 where i + k >= T: those rows have no label and the loss masks them.
    """
    return mtp_eagle_forward_full(model, main_hidden, tokens, segment_ids, eagle_steps=0)[0]


def mtp_eagle_forward_full(
    model: nnx.Module,
    main_hidden: Float[Array, "B T E"],
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"] | None = None,
    *,
    eagle_steps: int,
) -> tuple[list[Float[Array, "B T V"]], list[Float[Array, "B T V"]]]:
    """`mtp_forward_full`'s D depths, and MTP Eagle's K = `eagle_steps` passes of module 1 teacher-forced.

    Eagle pass k runs module 1 over pass k - 1's hidden states and the tokens k ahead (for simulated
    acceptance; an approximation of the live chain, whose passes attend to module 1's entries of the
    committed positions). Pass 1 is depth 1, taken from the depths (not run again): module 1 runs K
    times in all. Raises ValueError for eagle_steps < 0, or eagle_steps >= 1 without a DeepSeek-style
    MTP module (none, or parallel heads).

    Args: as `mtp_forward_full`.

    Returns:
      (depths, eagle): the D depths' logits as `mtp_forward_full` returns them, and K arrays of logits
      float32 [B, T, V] (none for K = 0), `eagle[0]` being `depths[0]`; pass k's row i predicts
      t_{i+k+1}, as depth k's.
    """
    batch, num = tokens.shape
    modules = list(model.mtp)
    parallel = model.config.mtp_style == "parallel"
    if eagle_steps < 0 or (eagle_steps and (not modules or model.config.mtp_style != "deepseek")):
        raise ValueError(
            f"eagle_steps needs a DeepSeek-style MTP module and eagle_steps >= 0, got {eagle_steps} with "
            f"{len(modules)} modules of style {model.config.mtp_style!r}"
        )
    positions = sequence_positions(batch, num)

    def run(module: nnx.Module, k: int, source: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Module `module` as depth (or eagle pass) k over `source`: (logits, the hidden chained onward)."""
        logits, hidden, _ = module(
            source,
            shift_left(tokens, k),
            positions,
            module.init_cache(batch, num),
            embed=model.embed,
            head=model.head,
            segment_ids=segment_ids,
        )
        return logits, hidden

    h0 = initial_hidden(model, main_hidden)
    hidden, depths, first_hidden = h0, [], None
    for k, module in enumerate(modules, start=1):
        logits, hidden = run(module, k, h0 if parallel else hidden)
        depths.append(logits)
        first_hidden = hidden if k == 1 else first_hidden
    eagle, hidden = depths[: min(eagle_steps, 1)], first_hidden
    for k in range(2, eagle_steps + 1):
        logits, hidden = run(modules[0], k, hidden)
        eagle.append(logits)
    return depths, eagle
