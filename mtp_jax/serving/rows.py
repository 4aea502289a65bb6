"""The serving engine's device side: the decode state of its rows, the row states prompts are prefilled in,
and the jitted calls over them (`mtp_jax.decode.engine.DecodeEngine`), each given the block table of the
rows it touches (`mtp_jax.serving.paging.RowPages`).

The decode state has `max_batch` rows (slots) over paged caches (`mtp_jax.cache.PagedCache`): the pools of
every layer, main model and MTP modules, live in it. A prompt is prefilled in a staging row state of its own
(one row, or one per `data` x `fsdp` device on a mesh) that holds no pools: each chunk borrows the decode
state's (`DecodeEngine.prefill_rows`), so the KV lands in the request's pages and entering a slot copies
no KV (`insert`). On a mesh every array is placed as the jitted calls return it, so nothing recompiles.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import PageLayout
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.engine import compiled_counts as decode_compiled_counts
from mtp_jax.decode.grammar_mask import bitmask_width
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState
from mtp_jax.decode.step import StepOutput
from mtp_jax.model import Transformer
from mtp_jax.serving.paging import RowPages
from mtp_jax.serving.requests import ServedRequest
from mtp_jax.sharding import batch_rows, named_shardings, place, to_host, trim_specs

JITTED = ("_prefill_rows_jit", "_step_with_output_jit", "_insert_jit", "_release_jit")


class DeviceRows:
    """`max_batch` decode rows over `paging`'s pages, and the staging rows of prefills (see the module).

    `state` is the decode state (donated to every call; read it only between calls). Raises ValueError
    when `max_batch` is not a multiple of the mesh's `data` x `fsdp` size."""

    def __init__(
        self,
        model: Transformer,
        speculative: SpeculativeConfig | None,
        *,
        mesh: Mesh | None,
        max_batch: int,
        max_length: int,
        prefill_chunk: int,
        paging: RowPages,
        variants: tuple[int, ...],
        max_logprobs: int = 0,
    ):
        self.staging_rows = batch_rows(mesh)
        if max_batch % self.staging_rows:
            raise ValueError(
                f"max_batch={max_batch} must be a multiple of the mesh's data x fsdp size {self.staging_rows}"
            )
        self.mesh, self.paging, self.max_batch, self.max_length = mesh, paging, max_batch, max_length
        self.prefill_chunk, self.num_pages = prefill_chunk, paging.allocator.num_pages
        self.decode = DecodeEngine(model, speculative, mesh=mesh)
        self.k_max = 0 if speculative is None else speculative.num_speculative_tokens
        self.variants = variants  # the numbers of drafts a step may verify (`SpeculationPolicy.variants`)
        self.drafts_stale = False  # after a plain step that drafted nothing (`step(..., draft_next=False)`)
        self.oracle = speculative is not None and speculative.method == "oracle"
        self.max_logprobs = max_logprobs
        self.bitmask_width = bitmask_width(model.config.vocab_size)
        # Every step and final prefill chunk takes a token bitmask (one program whether or not a row has a
        # grammar); these all-allowed ones stay on the device for the steps in which no row has one.
        self._allow_all_step = self._on_mesh(np.full((max_batch, self.k_max + 1, self.bitmask_width), -1, np.int32))
        self._own_drafts = self._on_mesh(np.full((max_batch, self.k_max), -1, np.int32))  # none proposed
        self._allow_all_prefill = self._on_mesh(np.full((self.staging_rows, 1, self.bitmask_width), -1, np.int32))
        state, _ = self.decode.init_state(
            [[0]] * max_batch,
            max_new_tokens=1,
            max_length=max_length,
            stop_tokens=[],
            oracle_tokens=np.zeros((max_batch, max_length), np.int32) if self.oracle else None,
            pages=PageLayout(self.num_pages, paging.page_size),
            max_logprobs=max_logprobs,
        )
        self.state = self.decode.release(self._placed(state), np.ones(max_batch, bool))  # every slot free

    @staticmethod
    def compiled_counts() -> dict[str, int]:
        """Programs compiled so far by each jitted call the engine makes."""
        counts = decode_compiled_counts()
        return {name: counts[name] for name in JITTED}

    def staging(self, prompt: list[int], max_new: int, request: ServedRequest | None = None) -> DecodeState:
        """A staging row state for `prompt` (and `request`'s sampling, stops and oracle tokens; after a preemption
        the prompt ends with what the request had received, its output for the penalties), without pools."""
        dummies = self.staging_rows - 1  # rows for the other data-parallel devices, never read
        oracle = None
        if self.oracle:  # fixed shape [rows, S]: no recompiles
            oracle = np.zeros((self.staging_rows, self.max_length), np.int32)
            if request is not None:
                oracle[0, : len(request.oracle_tokens)] = request.oracle_tokens
        state, _ = self.decode.init_state(
            [prompt] + [[0]] * dummies,
            max_new_tokens=[max_new] + [1] * dummies,
            sampling=[SamplingParams() if request is None else request.sampling] + [SamplingParams()] * dummies,
            max_length=self.max_length,
            stop_tokens=[] if request is None else request.stop_token_ids,
            oracle_tokens=oracle,
            pages=PageLayout(self.num_pages, self.paging.page_size, pools=False),
            max_logprobs=self.max_logprobs,
            num_generated=[0 if request is None else len(request.token_ids)] + [0] * dummies,
        )
        return self._placed(state)

    def prefill(
        self, rows: DecodeState, request: ServedRequest, prompt: list[int], start: int, *, final: bool
    ) -> DecodeState:
        """The chunk of `prompt` at `start` (C tokens, the last one right-padded) prefilled from the staging
        state `rows` into `request`'s pages (a final chunk's token masked by the request's grammar, if any);
        returns the new staging state."""
        size = self.prefill_chunk
        chunk = np.zeros((self.staging_rows, size), np.int32)
        part = prompt[start : start + size]
        chunk[0, : len(part)] = part
        starts = np.zeros(self.staging_rows, np.int32)
        starts[0] = start
        table = self.table([request] + [None] * (self.staging_rows - 1), self.paging.prefill_width(start))
        mask = self._allow_all_prefill
        if final and request.grammar is not None:
            host = np.full((self.staging_rows, 1, self.bitmask_width), -1, np.int32)
            request.grammar.fill_mask(host[0, 0])
            mask = self._on_mesh(host)
        self.state, rows = self.decode.prefill_rows(
            self.state, rows, self._on_mesh(chunk), self._on_mesh(starts), table, mask, final=final
        )
        return rows

    def first_token(self, rows: DecodeState, position: int) -> tuple[int, float, np.ndarray, np.ndarray, np.ndarray]:
        """The token a final prefill committed at `position`, its logprob, the `max_logprobs` most likely
        tokens there (raw logprobs float32 [N], ids int32 [N]) and the row's first drafts (int32 [K])."""
        token, logprob, values, ids, drafts = to_host(
            (
                rows.tokens[0, position],
                rows.logprobs[0, position],
                rows.top_logprobs[0, 0],
                rows.top_tokens[0, 0],
                rows.draft.tokens[0],
            )
        )
        return int(token), float(logprob), values, ids, drafts

    @property
    def plain_steps_skip_drafts(self) -> bool:
        """Whether a step verifying no drafts drafts none either (adaptive speculation: its plain step costs
        what a step without speculation does, plus the MTP modules' cache writes)."""
        return self.k_max > 0 and 0 in self.variants

    def step(
        self,
        slots: Sequence[ServedRequest | None],
        width: int,
        num_drafts: int,
        *,
        draft_next: bool = True,
        top_logprobs: bool = False,
    ) -> StepOutput:
        """One decode step of every slot (`slots[b]`: row b's request, None for a free row) reading `width`
        pages per row and verifying `num_drafts` drafts, drafting the next ones unless `draft_next` is False
        (then `drafts_stale` until a step drafts again: `DecodeEngine.step_with_output`); returns what each
        row committed, on the host; its top logprobs only with `top_logprobs` (a program of its own, for steps
        in which a running request asked for them). A request with a grammar (`ServedRequest.grammar`) has its
        row's drafts replaced by the tokens its grammar forces after their valid prefix and its tokens masked at
        each verify position given them (`GrammarMatcher.propose`). Raises
        ValueError for drafts to verify while stale."""
        if num_drafts and self.drafts_stale:
            raise ValueError("the drafts are stale after a step that drafted none: a step must draft first")
        mask, drafts = self._allow_all_step, self._own_drafts
        constrained = [(b, r) for b, r in enumerate(slots) if r is not None and r.grammar is not None]
        if constrained:
            host = np.full((self.max_batch, self.k_max + 1, self.bitmask_width), -1, np.int32)
            proposed = np.full((self.max_batch, self.k_max), -1, np.int32)
            for b, r in constrained:
                proposed[b, :num_drafts] = r.grammar.propose(r.drafts[:num_drafts], host[b, : num_drafts + 1])
            mask, drafts = self._on_mesh(host), self._on_mesh(proposed)
        self.state, out = self._step(self.table(slots, width), num_drafts, draft_next, top_logprobs, mask, drafts)
        self.drafts_stale = not draft_next
        return to_host(out)  # (a StepOutput of numpy arrays)

    def _step(self, table, num_drafts: int, draft_next: bool, top_logprobs: bool, mask=None, drafts=None):
        k = None if num_drafts == self.k_max and draft_next else num_drafts  # all K: the one program of a fixed K
        return self.decode.step_with_output(
            self.state,
            table,
            num_drafts=k,
            draft_next=draft_next,
            top_logprobs=top_logprobs,
            token_bitmask=self._allow_all_step if mask is None else mask,
            drafts=None if not self.k_max else self._own_drafts if drafts is None else drafts,  # (K = 0: none)
        )

    def insert(self, rows: DecodeState, slot: int) -> None:
        """A prefilled staging row into slot `slot`."""
        self.state = self.decode.insert(self.state, rows, slot)

    def release(self, slots: Sequence[int]) -> None:
        """The rows `slots` done: steps no longer commit for them, their slots are free."""
        if slots:
            released = np.zeros(self.max_batch, bool)
            released[list(slots)] = True
            self.state = self.decode.release(self.state, released)

    def warm_widths(self) -> None:
        """A step (of each number of drafts in `variants`) and a prefill chunk of each kind at every width of
        `paging.buckets`, every table entry the sentinel and every slot free: all writes are dropped, nothing
        changes but the compiled programs. Each call takes both a fresh state and one a call returned (on a
        mesh their placements may differ), so neither a prefill that starts wide (a prefix hit) nor a
        release after a step (a preemption, an abort) compiles later."""
        rows = self.staging([0], 1)
        chunk = self._on_mesh(np.zeros((self.staging_rows, self.prefill_chunk), np.int32))
        starts = self._on_mesh(np.zeros(self.staging_rows, np.int32))
        free = [None] * self.staging_rows
        for width in self.paging.buckets:
            plain = [(0, False)] if self.plain_steps_skip_drafts else []
            tops = (False, True) if self.max_logprobs else (False,)
            for (k, draft_next), top in itertools.product([(k, True) for k in self.variants] + plain, tops):
                table = self.table([None] * self.max_batch, width)
                self.state, _ = self._step(table, k, draft_next, top)
                self.release([0])  # (slot 0 is free: nothing changes)
            if width < self.paging.prefill_width(0):
                continue  # narrower than any prefill chunk reads
            for final, fresh in itertools.product((False, True), (True, False)):
                rows = self.staging([0], 1) if fresh else rows
                self.state, rows = self.decode.prefill_rows(
                    self.state, rows, chunk, starts, self.table(free, width), self._allow_all_prefill,
                    final=final,
                )  # fmt: skip

    def table(self, owners: Sequence[ServedRequest | None], width: int) -> jnp.ndarray:
        """`RowPages.table` on the device (rows over the batch axes on a mesh)."""
        return self._on_mesh(self.paging.table(owners, width))

    def _placed(self, state: DecodeState) -> DecodeState:
        """On a mesh: `state` placed with the specs jitted calls return (`trim_specs`), so a staged or
        slot state compiles each call once, whichever call it comes from."""
        if self.mesh is None:
            return state
        return place(state, trim_specs(named_shardings(state, state.logical_axes(), self.mesh)))

    def _on_mesh(self, array: np.ndarray) -> jnp.ndarray:
        """A host array of rows as a device array, its rows over the batch axes on a mesh."""
        array = jnp.asarray(array)
        if self.mesh is not None:
            array = place(array, named_shardings(array, P("batch"), self.mesh))
        return array
