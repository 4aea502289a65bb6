"""`DecodeEngine`: the decode step of `mtp_jax.decode.step`, jitted once at its boundary (the public step API).

Each jitted call takes the model split by NNX (`static_split`: the graph a static argument, the
weights traced) and merges it inside, so the program holds the model once and a new engine on the
same graph reuses it; the decode state is donated. Every call compiles once per (B, S, prompt bucket,
model, drafter): generation length, sampling parameters, stop tokens and prompt contents are data,
never shapes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtp_jax.decode import draft_vocab
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState, GenerationResult, init_state, results_from_state
from mtp_jax.decode.step import (
    StepOutput,
    decode_step,
    insert_row,
    prefill,
    prefill_rows,
    prompt_logprobs,
    release_rows,
    run,
    step_with_output,
)
from mtp_jax.layers import onednn
from mtp_jax.model import Transformer, static_split
from mtp_jax.sharding import named_shardings, on_mesh, place, shard_params
from mtp_jax.validation import is_integer


def _jit_with_model(fn: Callable, *static: str, donate: tuple[str, ...] = ("state",)) -> Callable:
    """`fn(model, speculative, state, ...)` jitted as `(graph, params, speculative, state, ...)`: the model
    merged from its NNX split inside the program, `graph`, `speculative` and `static` static, the state
    (and the other arguments `donate` names) donated."""

    @functools.partial(jax.jit, static_argnames=("graph", "speculative", *static), donate_argnames=donate)
    def jitted(graph, params, speculative, state, *args, **kwargs):
        return fn(graph.merge(params), speculative, state, *args, **kwargs)

    return jitted


_prefill_jit = _jit_with_model(prefill, "final")
_step_jit = _jit_with_model(decode_step)
_run_jit = _jit_with_model(run)
_step_with_output_jit = _jit_with_model(step_with_output, "num_drafts", "draft_next", "top_logprobs")
_prefill_rows_jit = _jit_with_model(prefill_rows, "final", donate=("state", "rows"))
_insert_jit = jax.jit(insert_row, donate_argnames=("state",))
_prompt_logprobs_jit = jax.jit(
    lambda graph, params, tokens, num: prompt_logprobs(graph.merge(params), tokens, num),
    static_argnames=("graph", "num"),
)
_release_jit = jax.jit(release_rows, donate_argnames=("state",))


def compiled_counts() -> dict[str, int]:
    """Programs compiled so far by each jitted call of this module (tests and serving check that
    nothing compiles after a warm-up)."""
    return {
        name: fn._cache_size()
        for name, fn in (
            ("_prefill_jit", _prefill_jit),
            ("_step_jit", _step_jit),
            ("_run_jit", _run_jit),
            ("_step_with_output_jit", _step_with_output_jit),
            ("_prefill_rows_jit", _prefill_rows_jit),
            ("_insert_jit", _insert_jit),
            ("_release_jit", _release_jit),
        )
    }


class DecodeEngine:
    """Plain or speculative decoding of one model, step by step, jitted (the public step API).

    `speculative`: a `SpeculativeConfig`, or None for plain decoding. The model's weights are read
    once, here: build a new engine after changing them. Every call that takes a state donates it
    (its buffers are reused; do not read a state after passing it in). On the CPU backend with the
    optional `mtp_jax_onednn` extension installed, each bfloat16 and float32 Linear kernel (a tied
    head's embedding transposed, each MoE expert's kernel) is also packed for oneDNN's matmul here and
    the engine holds both copies: bfloat16 and the experts go to oneDNN at every row count, float32
    from a few rows (`mtp_jax.layers.onednn.MIN_ROWS`; `MTP_JAX_ONEDNN=0` turns it off).

    `mesh` (`mtp_jax.sharding.make_mesh`): the weights are placed on it by their logical axes, the
    states `init_state` builds by `DecodeState.logical_axes` (rows over `data` x `fsdp`: the batch
    must be a multiple of their product, else ValueError), and every jitted call runs under it
    (GSPMD; the step keeps the state's placement, so nothing recompiles). With `jax.distributed`,
    every process builds the same engine and state, and owns its devices' shards.

        engine = DecodeEngine(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
        state, padded = engine.init_state(prompts, max_new_tokens=64)
        state = engine.prefill(state, padded)
        state = engine.step(state)   # or engine.run(state): every step until all rows are done
        result = engine.result(state, seconds=0.0)

    Raises ValueError at construction when the model cannot serve `speculative`.
    """

    def __init__(self, model: Transformer, speculative: SpeculativeConfig | None = None, *, mesh: Mesh | None = None):
        if speculative is not None:
            speculative.check_model(model, model.config.vocab_size)
        self.model, self.speculative, self.mesh = model, speculative, mesh
        tied = model.embed_tokens if model.lm_head is None else None
        with draft_vocab.attached(model, speculative):  # the head over SpeculativeConfig.draft_vocab, if any
            packed = {} if mesh is not None else onednn.pack_params(model, tied)  # CPU, extension built
            with onednn.swapped(packed):
                self._graph, params = static_split(model)
                self._params = jax.tree.map(lambda x: x, params)  # holds the packed kernels after the swap ends
        if mesh is not None:
            self._params = shard_params(self._params, mesh)

    def _call(self, jitted: Callable, state: DecodeState, *args, **kwargs):
        """A jitted call with the model, under the engine's mesh if any."""
        with on_mesh(self.mesh):
            return jitted(self._graph, self._params, self.speculative, state, *args, **kwargs)

    def init_state(self, prompts: Sequence[Sequence[int]], **request) -> tuple[DecodeState, jax.Array]:
        """The initial state and padded prompts (int32 [B, P]), placed on the engine's mesh if any;
        keyword arguments as `init_state`'s (max_new_tokens, sampling, max_length, stop_tokens,
        oracle_tokens)."""
        state, padded = init_state(self.model, prompts, speculative=self.speculative, **request)
        if self.mesh is not None:
            state = place(state, named_shardings(state, state.logical_axes(), self.mesh))
            padded = place(padded, named_shardings(padded, P("batch", None), self.mesh))
        return state, padded

    def prefill(
        self, state: DecodeState, padded_prompts: jax.Array, start: jax.Array | None = None, *, final: bool = True
    ) -> DecodeState:
        """The prompts through the model, the first token committed, the first drafts made; or one
        chunk of them at positions `start` .. (int32 [B]; see `prefill`)."""
        return self._call(_prefill_jit, state, padded_prompts, start, final=final)

    def step(self, state: DecodeState) -> DecodeState:
        """One decode step for every row (`decode_step`)."""
        return self._call(_step_jit, state)

    def run(self, state: DecodeState) -> DecodeState:
        """Steps until every row is done, as one `lax.while_loop` on device."""
        return self._call(_run_jit, state)

    def step_with_output(
        self,
        state: DecodeState,
        block_table: jax.Array | None = None,
        num_drafts: int | None = None,
        *,
        draft_next: bool = True,
        top_logprobs: bool = True,
        token_bitmask: jax.Array | None = None,
        drafts: jax.Array | None = None,
    ) -> tuple[DecodeState, StepOutput]:
        """One decode step and what each row committed (`step_with_output`; a paged state with its rows'
        `block_table`, int32 [B, W]); `num_drafts`: verify only the first k of the K drafts (0 .. K, one
        program each); `draft_next=False` (with k = 0): a plain step that only writes the MTP caches, its
        drafts stale until a step that drafts; `top_logprobs=False`: the state's top logprobs are not updated
        (a state built with max_logprobs = 0 has none either way); `token_bitmask` (int32 [B, K+1, ceil(V / 32)]):
        the tokens a grammar allows at each verify position (structured output; None: all, a program of its own);
        `drafts` (int32 [B, K]): drafts proposed by the host where >= 0 (`decode_step`).
        Raises ValueError for k outside 0 .. K or for draft_next=False with k != 0."""
        k_max = 0 if self.speculative is None else self.speculative.num_speculative_tokens
        if num_drafts is not None and (not is_integer(num_drafts) or not 0 <= num_drafts <= k_max):
            raise ValueError(f"num_drafts must be an int in 0 .. {k_max} (K), got {num_drafts!r}")
        if not isinstance(draft_next, bool):
            raise ValueError(f"draft_next must be a bool, got {draft_next!r}")
        if not draft_next and num_drafts != 0:
            raise ValueError(
                f"draft_next=False needs num_drafts=0 (stale drafts cannot be verified), got {num_drafts!r}"
            )
        return self._call(
            _step_with_output_jit,
            state,
            block_table,
            num_drafts=num_drafts,
            draft_next=draft_next,
            top_logprobs=bool(top_logprobs) and state.top_logprobs.shape[-1] > 0,
            token_bitmask=token_bitmask,
            drafts=drafts,
        )

    def prefill_rows(
        self,
        state: DecodeState,
        rows: DecodeState,
        padded_prompts: jax.Array,
        start: jax.Array,
        block_table: jax.Array,
        token_bitmask: jax.Array | None = None,
        *,
        final: bool,
    ) -> tuple[DecodeState, DecodeState]:
        """A chunk of the paged row state `rows` prefilled into `state`'s page pools (`prefill_rows`; a final
        chunk's token masked by `token_bitmask[:, 0]`, int32 [R, 1, W]); both states are donated and returned."""
        return self._call(
            _prefill_rows_jit, state, rows, padded_prompts, start, block_table, token_bitmask, final=final
        )

    def insert(self, state: DecodeState, rows: DecodeState, slot: int) -> DecodeState:
        """Row 0 of `rows` into row `slot` of `state` (`insert_row`; `rows` is not donated)."""
        with on_mesh(self.mesh):
            return _insert_jit(state, rows, jnp.int32(slot))

    def release(self, state: DecodeState, rows: np.ndarray) -> DecodeState:
        """`state` with `rows` (bool [B]) done (`release_rows`)."""
        with on_mesh(self.mesh):
            return _release_jit(state, jnp.asarray(rows, bool))

    def prompt_logprobs(self, tokens: jax.Array, num: int) -> tuple[jax.Array, ...]:
        """`prompt_logprobs` of `tokens` (int32 [1, T]) with the `num` most likely tokens per position."""
        with on_mesh(self.mesh):
            return _prompt_logprobs_jit(self._graph, self._params, tokens, num)

    def lower_run(self, state: DecodeState) -> jax.stages.Lowered:
        """`run` lowered for this state's shapes (`.compile().as_text()` is the HLO a profile reads)."""
        with on_mesh(self.mesh):
            return _run_jit.lower(self._graph, self._params, self.speculative, state)

    def result(self, state: DecodeState, seconds: float) -> GenerationResult:
        """The host-side view of a state (`seconds`: the wall time to report)."""
        return results_from_state(state, seconds, speculating=self.speculative is not None)
