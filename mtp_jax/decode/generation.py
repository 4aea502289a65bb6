"""Generation, the host API: `generate` and `stream`, plain or speculative (`speculative=`).

Both drive `mtp_jax.decode.engine.DecodeEngine`: `generate` runs the prefill and then the whole decode
loop as one jitted `lax.while_loop` with the state donated; `stream` runs the same jitted step once
per call and yields the tokens each row committed. Both compile once per (B, S, prompt bucket,
model, speculative config).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable, Sequence

import jax
from jax.sharding import Mesh

from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import GenerationResult
from mtp_jax.model import Transformer
from mtp_jax.sharding import to_host


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 64,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_length: int | None = None,
    stop_tokens: Iterable[int] | None = None,
    speculative: SpeculativeConfig | None = None,
    mesh: Mesh | None = None,
) -> GenerationResult:
    """Generates up to `max_new_tokens` tokens for each prompt, the whole loop on device.

    Args:
      model: the main model.
      prompts: B lists of int token ids (Python or NumPy ints; different lengths allowed), B 1-D
        integer arrays, or one 2-D integer array [B, P]. Text is rejected: encode it first.
      max_new_tokens: one int >= 1 for all rows, or one per row.
      sampling: `SamplingParams` for all rows or one per row; default greedy.
      max_length: S, the cache capacity in tokens (prompt + generated), in
        [2, config.max_position_embeddings]; default `config.max_position_embeddings`.
      stop_tokens: up to `MAX_STOP_TOKENS` (16) int token ids that end a row (kept in its
        output); default the config's EOS ids.
      speculative: a `SpeculativeConfig` to decode with the model's MTP modules; None for plain
        decoding. Greedy rows then produce exactly the tokens of plain greedy decoding; sampled rows
        are distributed exactly as plain sampling (relaxed acceptance, when on, trades that for
        speed in thinking phases).
      mesh: a device mesh (`mtp_jax.sharding.make_mesh`) to run sharded on (`DecodeEngine`); the
        number of prompts must then be a multiple of its `data` x `fsdp` size. Greedy tokens equal
        the single-device ones up to floating-point summation order (ties within ~1e-6 may differ).

    Returns:
      A `GenerationResult` (with `metrics` when speculating). Raises TypeError / ValueError, naming
      the argument, on invalid input (see `mtp_jax.decode.request.check_request`) and ValueError when the
      model cannot serve `speculative` (no MTP modules, vanilla/parallel with K > D, ...).
    """
    engine = DecodeEngine(model, speculative, mesh=mesh)
    state, padded = engine.init_state(
        prompts, max_new_tokens=max_new_tokens, sampling=sampling, max_length=max_length, stop_tokens=stop_tokens
    )
    start = time.perf_counter()
    state = engine.run(engine.prefill(state, padded))
    jax.block_until_ready(state.lengths)
    return engine.result(state, time.perf_counter() - start)


def stream(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int] = 64,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_length: int | None = None,
    stop_tokens: Iterable[int] | None = None,
    speculative: SpeculativeConfig | None = None,
    mesh: Mesh | None = None,
) -> Generator[list[list[int]], None, GenerationResult]:
    """Like `generate`, one step at a time: yields, per step, the tokens each row just committed.

    A finished row yields empty lists. The concatenation of everything yielded for a row equals
    `generate(...).tokens` for that row with the same arguments. The generator's return value
    (`StopIteration.value`) is the `GenerationResult` `generate` would give, its `seconds` the wall
    time from the prefill to the last step, the consumer's time between steps included. Raises as
    `generate`, at the first `next`.
    """
    engine = DecodeEngine(model, speculative, mesh=mesh)
    state, padded = engine.init_state(
        prompts, max_new_tokens=max_new_tokens, sampling=sampling, max_length=max_length, stop_tokens=stop_tokens
    )
    before = to_host(state.lengths)
    start = time.perf_counter()
    state = engine.prefill(state, padded)
    while True:
        tokens, lengths, done = to_host((state.tokens, state.lengths, state.done))
        yield [tokens[b, before[b] : lengths[b]].tolist() for b in range(len(before))]
        if done.all():
            return engine.result(state, time.perf_counter() - start)
        before = lengths
        state = engine.step(state)
