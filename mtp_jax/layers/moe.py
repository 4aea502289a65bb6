"""DeepSeek-V3's mixture-of-experts feed-forward block (arXiv 2412.19437 §2.1.2), with DeepSeek-V3's names.

Each token's hidden state goes to `num_experts_per_tok` of `n_routed_experts` SwiGLU experts plus
`n_shared_experts` always-on ones (fused into one MLP of width `moe_intermediate_size * n_shared_experts`):

    s = sigmoid(x @ gate.weight.T)                     (softmax when scoring_func == "softmax")
    chosen = top-k of (s + e_score_correction_bias), restricted to the topk_group best of n_group groups,
             a group's score being the sum of its two largest biased scores ("node-limited routing", §2.1.2)
    g = s[chosen] / (sum(s[chosen]) + 1e-20) if norm_topk_prob else s[chosen];  g *= routed_scaling_factor
    y = shared_experts(x) + sum_j g_j * expert_{chosen_j}(x)

The bias is the auxiliary-loss-free load-balancing term (§2.1.2, eq. 16): it steers which experts are
chosen and never enters the weights `g`. Its update rule (raise the bias of under-loaded experts, lower
the overloaded, by a fixed step after each training step) is not a gradient, so the bias is a
`ScoreCorrectionBias`, an `nnx.Param` subclass: checkpoints load and save it with the other parameters
and an optimizer can leave it out with `nnx.All(nnx.Param, nnx.Not(ScoreCorrectionBias))`. Training reads
each router's choices to set it (`mtp_jax.training.balance`): under `nnx.capture(fn, RoutingStats)` a `Router`
records a `Routing` (its unbiased scores and chosen experts); outside a capture it records nothing and traces
exactly as without this (decoding never computes any of it).

The routing (`route`) and the semantics match Hugging Face's `DeepseekV3TopkRouter` / `DeepseekV3MoE`;
GLM-4.5's `Glm4MoeTopkRouter` / `Glm4MoeMoE` compute the same (there `n_group = topk_group = 1` by
default, which turns group limiting off; `tests/test_moe.py` checks both).

Checkpoint layout (DeepSeek-V3 safetensors, prefix `model.layers.{l}.mlp.`):
  `gate.weight` [R, E]                      -> `gate.weight` (as is)
  `gate.e_score_correction_bias` [R]        -> `gate.e_score_correction_bias` (as is)
  `experts.{r}.gate_proj.weight` [I, E]     -> `experts.gate_up_proj[r, :, 0::2]` = its transpose
  `experts.{r}.up_proj.weight` [I, E]       -> `experts.gate_up_proj[r, :, 1::2]` = its transpose
                                               (`experts.gate_up_proj` [R, E, 2I], gate and up interleaved
                                               as `ffn.MLP`'s: one grouped matmul for both)
  `experts.{r}.down_proj.weight` [E, I]     -> `experts.down_proj` [R, I, E] = stack over r, then transpose(0, 2, 1)
  `shared_experts.{gate,up,down}_proj.weight` -> `shared_experts` (an `MLP`: `gate_up_proj` [E, 2I] is the
                                               gate and up weights' transposes interleaved, `down_proj` [I, E])
Qwen3.5-MoE (`Qwen3_5MoeSparseMoeBlock`): softmax scores, no bias (the router has no `e_score_correction_bias`
when `scoring_func` is "softmax"), no groups, and one shared expert `shared_expert` of width
`shared_expert_intermediate_size` whose output is scaled per token by sigmoid(`shared_expert_gate`(x))
(`shared_expert_gate.weight` [1, E]).
transformers 5 holds the stacked experts as `gate_up_proj` [R, 2I, E] (gate rows first, then up) and
`down_proj` [R, E, I]; ours are `gate_up_proj.reshape(R, 2, I, E).transpose(0, 3, 2, 1).reshape(R, E, 2I)`
and `down_proj.transpose(0, 2, 1)`.

The routed experts run as grouped matmuls (`jax.lax.ragged_dot`) over the N*k token-expert assignments
sorted by expert; every shape is fixed (no data-dependent shapes, no loop over experts). On TPU and GPU
jax lowers it to XLA's `ragged_dot` instruction (GPU: optionally a Pallas Triton kernel,
`jax_ragged_dot_use_gpu_pallas_triton_lowering`), meant to do the chosen experts' work only (not
measured here on GPU). On CPU jax 0.10
expands it into a dense contraction over all R groups of a masked [R, M, E] copy of its input: k times the
work of running every expert on every token, and slower than that beyond toy sizes (E 256, I 128, R 32, k 4,
N 512: 301 ms against 56 ms). Fine for tests; not for CPU serving, where a `DecodeEngine` with the optional
oneDNN extension runs oneDNN's grouped matmul over each expert's packed kernel instead
(`mtp_jax.layers.onednn.grouped_matmul`: only the chosen experts' rows).

Letters (beside the package's B, T, E): N = B*T tokens, R routed experts, k experts per token, M = N*k
assignments, I = moe_intermediate_size, P = n_group, Q = R / P experts per group.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from mtp_jax.config import ModelConfig
from mtp_jax.layers import onednn
from mtp_jax.layers.ffn import MLP, swiglu
from mtp_jax.layers.fp8 import dequantize, quantize
from mtp_jax.layers.fused import FusedLayout, gate_up_layout
from mtp_jax.layers.linear import linear
from mtp_jax.sharding import axis_size, context_spec


class ScoreCorrectionBias(nnx.Param):
    """The router's load-balancing bias `e_score_correction_bias` (selection only; not trained by gradient)."""


class RoutingStats(nnx.Intermediate):
    """What a `Router` sows as "routing" under `nnx.capture(fn, RoutingStats)`: a tuple with one `Routing` per call."""


@struct.dataclass
class Routing:
    """One router call's choice, as training's load balancing reads it (`mtp_jax.training.balance`).

    `scores` float32 [..., N, R]: the unbiased affinities s (sigmoid of the logits, or softmax: `affinities`);
    `indices` int32 [..., N, k]: the chosen experts (bias and group limit applied). A scanned layer stack
    (`DecoderStack`) records its layers' as one `Routing` with a leading layer axis.
    """

    scores: jax.Array
    indices: jax.Array


def affinities(logits: jax.Array, scoring_func: str = "sigmoid") -> jax.Array:
    """The router's unbiased token-to-expert affinities s of shape [N, R], float32: sigmoid of the logits
    [N, R] (DeepSeek-V3, arXiv 2412.19437 eq. 15), or their softmax over R. Raises ValueError for another
    scoring_func."""
    logits = logits.astype(jnp.float32)
    if scoring_func == "sigmoid":
        return jax.nn.sigmoid(logits)  # [N, R]
    if scoring_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)  # [N, R]
    raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring_func!r}")


def route(
    logits: jax.Array,
    bias: jax.Array,
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring_func: str = "sigmoid",
) -> tuple[jax.Array, jax.Array]:
    """Choose `top_k` experts per token and their weights, DeepSeek-V3's group-limited routing.

    Args:
      logits: router logits of shape [N, R] (computed in float32).
      bias: `e_score_correction_bias` of shape [R]; added to the scores for the choice only.
      top_k: k, experts per token. n_group / topk_group: the R experts form n_group equal groups and only
        the topk_group groups with the largest sum of their two best biased scores are eligible
        (n_group = 1 turns this off). norm_topk_prob: divide the k weights by their sum (+1e-20).
      scoring_func: "sigmoid" (DeepSeek-V3) or "softmax" (over the R logits; the rest is unchanged).

    Returns:
      (indices int32 [N, k], weights float32 [N, k]): the chosen experts, in descending biased score, and
      their weights, the unbiased scores (normalised if asked) times routed_scaling_factor.

    Shapes are fixed; `lax.top_k` breaks exact ties toward the lower index.
    """
    num_tokens, num_experts = logits.shape
    scores = affinities(logits, scoring_func)  # [N, R]
    choice = scores + bias.astype(jnp.float32)  # [N, R]
    if n_group > 1:
        per_group = num_experts // n_group
        grouped = choice.reshape(num_tokens, n_group, per_group)  # [N, P, Q]
        group_scores = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # [N, P]
        _, best_groups = jax.lax.top_k(group_scores, topk_group)  # [N, topk_group]
        group_mask = jax.nn.one_hot(best_groups, n_group, dtype=jnp.bool_).any(axis=-2)  # [N, P]
        expert_mask = jnp.repeat(group_mask, per_group, axis=-1)  # [N, R]
        choice = jnp.where(expert_mask, choice, -jnp.inf)  # [N, R]
    _, indices = jax.lax.top_k(choice, top_k)  # [N, k]
    weights = jnp.take_along_axis(scores, indices, axis=-1)  # [N, k]
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)  # [N, k]
    return indices.astype(jnp.int32), weights * routed_scaling_factor


class Router(nnx.Module):
    """DeepSeek-V3's `mlp.gate`: `weight` [R, E] and `e_score_correction_bias` [R], both float32 (the bias with
    sigmoid scoring only: softmax routers, Qwen's, have none).

    `__call__(x [N, E]) -> (indices int32 [N, k], weights float32 [N, k])`, computed in float32. Under
    `nnx.capture(fn, RoutingStats)` it also sows a `Routing` (scores and indices) as "routing"; not otherwise.
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        shape = (config.n_routed_experts, config.hidden_size)
        self.weight = nnx.Param(
            nnx.initializers.normal(config.initializer_range)(rngs.params(), shape, jnp.float32),
            logical_axes=(None, "embed"),
        )  # small: whole on every device
        self.e_score_correction_bias = (
            ScoreCorrectionBias(jnp.zeros((config.n_routed_experts,), jnp.float32))
            if config.scoring_func == "sigmoid"
            else None
        )

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        logits = jnp.einsum("ne,re->nr", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))  # [N, R]
        choose = functools.partial(
            route,
            top_k=c.num_experts_per_tok,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
            scoring_func=c.scoring_func,
        )
        bias = (
            jnp.zeros((c.n_routed_experts,), jnp.float32)
            if self.e_score_correction_bias is None
            else self.e_score_correction_bias[...]
        )
        rows = context_spec(P("batch", None), logits.shape)  # None: no mesh
        if rows is None or rows == P(None, None):
            indices, weights = choose(logits, bias)
        else:  # row by row, so per device on its rows (GSPMD gathers the rows for lax.top_k otherwise)
            shard = jax.shard_map(choose, in_specs=(rows, P(None)), out_specs=(rows, rows), check_vma=False)
            indices, weights = shard(logits, bias)
        if hasattr(self, "__captures__"):  # under `nnx.capture` (training): record the choice, as global arrays
            self.sow(RoutingStats, "routing", Routing(scores=affinities(logits, c.scoring_func), indices=indices))
        return indices, weights


class Experts(nnx.Module):
    """The R routed SwiGLU experts, stacked: `gate_up_proj` [R, E, 2I] (each expert's gate and up columns
    interleaved, [R, E, I, 2] flattened: column 2i is gate unit i, 2i + 1 up unit i, as `ffn.MLP`'s) and
    `down_proj` [R, I, E], in `config.weight_dtype`. With `config.quantization` quantizing "mlp.experts"
    (`Fp8Config.quantizes`): both float8_e4m3fn, with float32 block scales (`mtp_jax.layers.fp8`: each expert's
    HF `weight_scale_inv`s transposed, gate's blocks then up's) `gate_up_proj_scale_inv`
    [R, ceil(E / b_in), 2 ceil(I / b_out)] and `down_proj_scale_inv` [R, ceil(I / b_in), ceil(E / b_out)],
    split over `expert` as the kernels, dequantized to the compute dtype in each call.

    `__call__(x [N, E], indices int32 [N, k], weights float32 [N, k]) -> [N, E]`:
    `sum_j weights[:, j] * down(silu(gate) * up)` with `gate, up = split_gate_up(x @ gate_up_proj[indices[:, j]])`, as
    two `lax.ragged_dot`s over the N*k assignments sorted by expert.
    """

    grouped_kernels = ("gate_up_proj", "down_proj")  # `onednn.GROUPED`: packed for oneDNN by a CPU engine

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        r, e, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(config.initializer_range)
        fp8 = config.quantization
        self.block = fp8.weight_block_size if fp8 is not None and fp8.quantizes("mlp.experts") else None
        for name, shape, axes in (
            ("gate_up_proj", (r, e, 2 * i), ("experts", "embed", "moe_mlp")),
            ("down_proj", (r, i, e), ("experts", "moe_mlp", "embed")),
        ):
            if self.block is None:
                setattr(self, name, nnx.Param(init(rngs.params(), shape, config.weight_dtype), logical_axes=axes))
                continue
            kernel, scale_inv = quantize(init(rngs.params(), shape, jnp.float32), self.block, self._layout(name))
            setattr(self, name, nnx.Param(kernel, logical_axes=axes))
            setattr(self, f"{name}_scale_inv", nnx.Param(scale_inv, logical_axes=(axes[0], None, None)))

    def _layout(self, name: str) -> FusedLayout:
        """The output axis' pieces of the stacked kernel `name`: gate and up interleaved, or down's one."""
        c = self.config
        return gate_up_layout(c.moe_intermediate_size) if name == "gate_up_proj" else FusedLayout((c.hidden_size,))

    def _weight(self, name: str) -> jax.Array:
        """The stacked kernel `name` in the compute dtype (dequantized when FP8)."""
        dtype = self.config.compute_dtype
        if self.block is None:
            return getattr(self, name)[...].astype(dtype)
        scale_inv = getattr(self, f"{name}_scale_inv")[...]
        return dequantize(getattr(self, name)[...], scale_inv, self.block, self._layout(name), dtype)

    def __call__(self, x: jax.Array, indices: jax.Array, weights: jax.Array) -> jax.Array:
        gate_up, down = self._weight("gate_up_proj"), self._weight("down_proj")
        rows = context_spec(P("batch", None), x.shape)  # None: no mesh
        if rows is None or (rows == P(None, None) and axis_size("expert") == 1):
            packed = tuple(onednn.packed_grouped(self, name) for name in self.grouped_kernels)
            return _expert_sum(x, indices, weights, gate_up, down, first=0, packed=packed)
        return _experts_on_mesh(x, indices, weights, gate_up, down, rows)


def _expert_sum(
    x: jax.Array,
    indices: jax.Array,
    weights: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    *,
    first: jax.Array | int,
    packed: tuple[jax.Array | None, jax.Array | None] = (None, None),
) -> jax.Array:
    """`Experts.__call__` over the experts `first .. first + R' - 1` that `gate_up` [R', E, 2I] and `down`
    [R', I, E] hold (all R of them, or one device's share under expert parallelism): assignments to
    other experts contribute nothing. Returns [N, E] in x's dtype. `packed`: oneDNN's packed copies of
    the two (a CPU engine's, `onednn.packed_grouped`), whose grouped matmul replaces `ragged_dot`."""
    num_tokens, top_k = indices.shape
    num_local = gate_up.shape[0]
    local = indices.reshape(-1) - first  # [M], assignment m = token m // k, slot m % k
    mine = (local >= 0) & (local < num_local)  # [M]
    key = jnp.where(mine, local, num_local)  # others sort last, beyond every group
    order = jnp.argsort(key, stable=True)  # [M], assignments grouped by expert
    group_sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)  # [R']

    def grouped(lhs, kernel, packed_kernel):  # rows past the groups: 0
        if packed_kernel is None:
            return jax.lax.ragged_dot(lhs, kernel, group_sizes)
        return onednn.grouped_matmul(lhs, packed_kernel, group_sizes, kernel.shape[-1])

    xs = x.astype(gate_up.dtype)[order // top_k]  # [M, E], the token of each sorted assignment
    ys = grouped(swiglu(grouped(xs, gate_up, packed[0])), down, packed[1])  # [M, I] -> [M, E]
    inverse = jnp.argsort(order)  # [M], sorted position of each assignment
    y = ys[inverse].reshape(num_tokens, top_k, -1)  # [N, k, E]
    y = jnp.where(mine.reshape(num_tokens, top_k, 1), y, 0)  # other devices' experts: nothing here
    out = jnp.einsum("nke,nk->ne", y.astype(jnp.float32), weights.astype(jnp.float32))  # [N, E]
    return out.astype(x.dtype)


def _experts_on_mesh(
    x: jax.Array, indices: jax.Array, weights: jax.Array, gate_up: jax.Array, down: jax.Array, rows: P
) -> jax.Array:
    """`_expert_sum` per device under `shard_map` on the context mesh (`mtp_jax.sharding`): tokens stay
    where their rows are (`rows`, the batch axes) and whole over `expert`; the experts are split over
    `expert` (n devices): each device runs its R / n experts on every token routed to them, and one
    all-reduce (`psum`) over `expert` adds the shares (n = 1: data parallelism alone, no collective;
    GSPMD would gather the rows for the sort by expert otherwise). Raises ValueError when n does not
    divide R."""
    num_experts, n = gate_up.shape[0], axis_size("expert")
    if num_experts % n:
        raise ValueError(
            f"expert parallelism needs n_routed_experts ({num_experts}) to be a multiple of the "
            f"mesh's expert axis ({n})"
        )
    experts = P("expert", None, None)

    def local(x, indices, weights, gate_up, down):
        first = jax.lax.axis_index("expert") * gate_up.shape[0]
        y = _expert_sum(x, indices, weights, gate_up, down, first=first)
        return jax.lax.psum(y, "expert") if n > 1 else y

    return jax.shard_map(local, in_specs=(rows, rows, rows, experts, experts), out_specs=rows, check_vma=False)(
        x, indices, weights, gate_up, down
    )


class MoE(nnx.Module):
    """DeepSeek-V3's MoE feed-forward block: `gate` (a `Router`), `experts` (stacked `Experts`) and,
    when `n_shared_experts > 0`, `shared_experts` (an `MLP` of width moe_intermediate_size * n_shared_experts);
    Qwen3.5-MoE's (`shared_expert_gate`): `shared_expert` (an `MLP` of width shared_expert_intermediate_size)
    and `shared_expert_gate` [E, 1], the shared expert's output scaled by sigmoid(x @ shared_expert_gate).

    `__call__(x [B, T, E]) -> [B, T, E]` in x's dtype; the router runs in float32, the experts in
    `config.compute_dtype`. Requires `config.ffn_type == "moe"`. Source: arXiv 2412.19437 §2.1.2 and
    Hugging Face's `DeepseekV3MoE` (see the module docstring for the semantics and the checkpoint layout).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        if config.ffn_type != "moe":
            raise ValueError(f"MoE needs ffn_type='moe', got {config.ffn_type!r}")
        self.gate = Router(config, rngs)
        self.experts = Experts(config, rngs)
        width = config.shared_expert_intermediate_size or config.moe_intermediate_size * config.n_shared_experts
        self.gated_shared = config.shared_expert_gate
        if self.gated_shared:  # Qwen3.5-MoE's names
            self.shared_expert = MLP(config, rngs, intermediate_size=width, name="mlp.shared_expert")
            self.shared_expert_gate = linear(
                config, config.hidden_size, 1, rngs, axes=("embed", None), name="mlp.shared_expert_gate"
            )
        self.shared_experts = (
            MLP(config, rngs, intermediate_size=width, name="mlp.shared_experts")
            if config.n_shared_experts > 0 and not self.gated_shared
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, e = x.shape
        tokens = x.reshape(b * t, e)  # [N, E]
        indices, weights = self.gate(tokens)  # [N, k], [N, k]
        y = self.experts(tokens, indices, weights).reshape(b, t, e)  # [B, T, E]
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)  # [B, T, E]
        if self.gated_shared:
            gate = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32)).astype(x.dtype)  # [B, T, 1]
            y = y + gate * self.shared_expert(x)
        return y
