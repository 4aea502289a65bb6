"""Decoding: plain and MTP speculative, one fixed-shape jitted step (`step.decode_step`), driven by `DecodeEngine`.

Read in this order: `generation` (generate, stream) -> `engine` (DecodeEngine: the jitted calls) ->
`state` (DecodeState) -> `step` (verify, accept_and_commit, commit, decode_step) -> `acceptance` ->
`drafters` (one function per method; `draft_vocab` for a reduced draft vocabulary) -> `speculative`
(SpeculativeConfig) -> `sampling`.
"""

from mtp_jax.decode.draft_vocab import frequent_tokens
from mtp_jax.decode.drafters import (
    DRAFTERS,
    DraftState,
    draft,
    draft_after_prefill,
    draft_after_verify,
    draft_eagle,
    draft_oracle,
    draft_parallel,
    draft_vanilla,
    init_draft_state,
)
from mtp_jax.decode.engine import DecodeEngine, compiled_counts
from mtp_jax.decode.generation import generate, stream
from mtp_jax.decode.metrics import SpeculativeCounters, SpeculativeMetrics
from mtp_jax.decode.sampling import SamplingParams, SamplingState
from mtp_jax.decode.speculative import MAX_SPECULATIVE_TOKENS, METHODS, SpeculativeConfig
from mtp_jax.decode.state import DecodeState, GenerationResult, init_state, results_from_state
from mtp_jax.decode.step import (
    StepOutput,
    accept_and_commit,
    commit,
    commit_first_token,
    decode_step,
    insert_row,
    prefill,
    release_rows,
    run,
    step_with_output,
    verify,
)
from mtp_jax.decode.text import TextStream, stream_text

__all__ = [
    "DRAFTERS",
    "MAX_SPECULATIVE_TOKENS",
    "METHODS",
    "DecodeEngine",
    "DecodeState",
    "DraftState",
    "GenerationResult",
    "SamplingParams",
    "SamplingState",
    "SpeculativeConfig",
    "SpeculativeCounters",
    "SpeculativeMetrics",
    "StepOutput",
    "TextStream",
    "accept_and_commit",
    "commit",
    "commit_first_token",
    "compiled_counts",
    "decode_step",
    "draft",
    "draft_after_prefill",
    "draft_after_verify",
    "draft_eagle",
    "draft_oracle",
    "draft_parallel",
    "draft_vanilla",
    "frequent_tokens",
    "generate",
    "init_draft_state",
    "init_state",
    "insert_row",
    "prefill",
    "release_rows",
    "results_from_state",
    "run",
    "step_with_output",
    "stream",
    "stream_text",
    "verify",
]
