"""Continuous batching with MTP speculation: requests come and go, the jitted step stays the same.

The seed serving guide (sections 7, 8, 11; `docs/MTP_SPEC.md`, "Serving") in one class, `ServingEngine`:

- **Slots.** The decode state has `max_batch` rows of capacity `max_length`; a row is a slot. A
  free slot is a finished row (`done`), which a step leaves alone. Every engine step runs the one
  jitted speculative step over all slots (`DecodeEngine.step_with_output`), whoever holds them.
- **Admission.** A waiting request is prefilled in a staging state of its own (one row, or one per
  `data` x `fsdp` device on a mesh) in chunks of `prefill_chunk` tokens, at most `prefill_chunk`
  prompt tokens per engine step while other requests decode (so they keep decoding: several short
  prompts or one chunk of a long one), a whole prompt first when none does; the
  prefilled row is then copied into a free slot (`DecodeEngine.insert`). Shapes never change:
  nothing compiles after `warm_up`.
- **Advance by what was committed.** A step commits 1 .. K+1 tokens per row (`StepOutput`); the
  scheduler reads that count and hands each request exactly those tokens. KV use counts committed
  tokens only (rejected drafts' entries are stale, `mtp_jax.cache`).
- **Stops.** Stop tokens (EOS unless `ignore_eos`, plus the request's) and `max_tokens` are cut on
  device, inside the accepted block (`engine.commit`). Stop strings are matched on the host in the
  detokenized text, token by token, so one that completes inside an accepted block ends the output
  exactly there; the tokens after it are dropped and the slot is released at once. A stop token's
  text and a stop string are not part of the output text (OpenAI's and vLLM's default).
- **Cancellation** (`abort`) frees the slot before the next step; the other rows are untouched
  (rows never read each other).

Thread use: `add_request` and `abort` may be called from any thread; `step` from one thread at a
time (`mtp_jax.serving.AsyncEngine` runs it in a background thread for the HTTP server).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from tokenizers import Tokenizer

from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.engine import compiled_counts as decode_compiled_counts
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState
from mtp_jax.model import Transformer
from mtp_jax.serving.outputs import FINISH_REASONS, RequestMetrics, RequestOutput
from mtp_jax.serving.requests import ServedRequest
from mtp_jax.sharding import batch_rows, named_shardings, place, to_host, trim_specs
from mtp_jax.validation import is_integer

__all__ = ["FINISH_REASONS", "QueueFull", "RequestMetrics", "RequestOutput", "ServingEngine"]


class QueueFull(RuntimeError):
    """`add_request` when `max_queue` requests are already waiting (the server answers 429)."""


@dataclasses.dataclass
class _Staging:
    """The request being prefilled, chunk by chunk, in its own state."""

    request: ServedRequest
    state: DecodeState
    slot: int
    start: int = 0


class ServingEngine:
    """Continuous batching over `max_batch` slots with plain or MTP speculative decoding.

        engine = ServingEngine(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3),
                               tokenizer=tokenizer, max_batch=8, max_length=1024)
        rid = engine.add_request(tokenizer.encode("def f(").ids, max_tokens=64, stop=["\\n\\n"])
        while engine.has_unfinished():
            for out in engine.step():
                print(out.request_id, out.text, out.finish_reason)

    Args:
      model, speculative, mesh: as `DecodeEngine` (`max_batch` must then be a multiple of the
        mesh's `data` x `fsdp` size).
      tokenizer: an HF `tokenizers.Tokenizer` for text outputs and stop strings (None: ids only).
      max_batch: B, slots decoding at once. max_length: S, tokens per slot (prompt + output),
        default `config.max_position_embeddings`. prefill_chunk: C, prompt tokens per prefill call
        (>= K + 1 when speculating). max_queue: >= 1, requests waiting (not yet prefilling) beyond
        which `add_request` raises `QueueFull`. clock: the time source of `RequestMetrics` (seconds).
      stats: an optional listener with `on_step(engine, outputs)` and `on_finished(output)`
        (`mtp_jax.serving.prometheus.PrometheusMetrics`), called from `step`.

    Raises ValueError for a bad argument (naming it) or a model that cannot serve `speculative`.
    Method "oracle" (tests, benchmarks) drafts each request's `oracle_tokens` (`add_request`).
    """

    def __init__(
        self,
        model: Transformer,
        speculative: SpeculativeConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        max_batch: int = 8,
        max_length: int | None = None,
        prefill_chunk: int = 64,
        max_queue: int = 256,
        mesh: Mesh | None = None,
        clock: Callable[[], float] = time.perf_counter,
        stats=None,
    ):
        config = model.config
        max_length = config.max_position_embeddings if max_length is None else max_length
        k = 0 if speculative is None else speculative.num_speculative_tokens
        for name, value, low in (
            ("max_batch", max_batch, 1),
            ("max_length", max_length, 2),
            ("prefill_chunk", prefill_chunk, max(1, k + 1)),
            ("max_queue", max_queue, 1),
        ):
            if not is_integer(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if max_length > config.max_position_embeddings:
            raise ValueError(
                f"max_length={max_length} exceeds config.max_position_embeddings={config.max_position_embeddings}"
            )
        rows = batch_rows(mesh)
        if max_batch % rows:
            raise ValueError(f"max_batch={max_batch} must be a multiple of the mesh's data x fsdp size {rows}")
        self.model, self.speculative, self.tokenizer, self.mesh = model, speculative, tokenizer, mesh
        self.max_batch, self.max_length, self.prefill_chunk = int(max_batch), int(max_length), int(prefill_chunk)
        self.max_queue, self.clock, self.stats = int(max_queue), clock, stats
        self.num_speculative_tokens = k
        self.decode = DecodeEngine(model, speculative, mesh=mesh)
        self._staging_rows = rows
        self._oracle = speculative is not None and speculative.method == "oracle"
        state, _ = self.decode.init_state(
            [[0]] * self.max_batch,
            max_new_tokens=1,
            max_length=self.max_length,
            stop_tokens=[],
            oracle_tokens=np.zeros((self.max_batch, self.max_length), np.int32) if self._oracle else None,
        )
        self._state = self.decode.release(self._placed(state), np.ones(self.max_batch, bool))  # every slot free
        self._slots: list[ServedRequest | None] = [None] * self.max_batch
        self._waiting: collections.deque[ServedRequest] = collections.deque()
        self._staging: _Staging | None = None
        self._aborts: set[str] = set()
        self._ids: set[str] = set()  # every request not yet finished
        self._lock = threading.Lock()
        self._counter = itertools.count()

    # ------------------------------------------------------------------------------------------
    # Requests in

    def add_request(
        self,
        prompt: Sequence[int],
        *,
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        stop_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        stop: Iterable[str] = (),
        request_id: str | None = None,
        oracle_tokens: Sequence[int] | None = None,
    ) -> str:
        """Queues a request; returns its id. Any thread.

        prompt: token ids. max_tokens: tokens to generate, default all the slot holds (max_length -
        prompt length). sampling: default greedy (its seed is used as given). stop_token_ids: ids
        that end the output (kept as its last token), besides the model's EOS ids unless
        `ignore_eos`; at most `MAX_STOP_TOKENS` (16) in all. stop: strings that end the output
        (excluded from the text; needs a tokenizer). oracle_tokens: with method "oracle" only (and
        required there), the sequence its drafts replay, prompt first (at most max_length ids).

        Raises TypeError / ValueError naming the argument (prompt not token ids, prompt + max_tokens
        over max_length, too many stop tokens, stop strings without a tokenizer, a request_id in
        use, ...) and `QueueFull` when `max_queue` requests wait already.
        """
        request = ServedRequest.checked(
            self.model.config,
            prompt,
            max_length=self.max_length,
            max_tokens=max_tokens,
            sampling=sampling,
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            stop=stop,
            tokenizer=self.tokenizer,
            oracle=self._oracle,
            oracle_tokens=oracle_tokens,
            num_speculative_tokens=self.num_speculative_tokens,
        )
        now = self.clock()
        with self._lock:
            if request_id is None:
                request_id = f"req-{next(self._counter)}"
            if request_id in self._ids:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(
                    f"the request queue is full ({self.max_queue} requests waiting, max_queue="
                    f"{self.max_queue}); retry later"
                )
            request.id, request.metrics.arrival_time = request_id, now
            self._ids.add(request_id)
            self._waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancels a request (any thread): the next `step` frees its slot and reports it finished with
        reason "abort". Returns False when no unfinished request has this id."""
        with self._lock:
            if request_id not in self._ids:
                return False
            self._aborts.add(request_id)
            return True

    # ------------------------------------------------------------------------------------------
    # State, for schedulers and metrics

    @property
    def num_waiting(self) -> int:
        """Requests queued, not yet prefilling."""
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        """Requests prefilling or holding a slot."""
        return sum(r is not None for r in self._slots) + (self._staging is not None)

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._ids)

    @property
    def kv_cache_usage(self) -> float:
        """Committed tokens in the slots / (max_batch x max_length), in [0, 1]: positions holding
        entries a later step reads (rejected drafts' stale entries do not count)."""
        used = sum(len(r.prompt) + len(r.token_ids) for r in self._slots if r is not None)
        return used / (self.max_batch * self.max_length)

    def compiled_counts(self) -> dict[str, int]:
        """How many times each jitted call has compiled (tests check nothing compiles after warm-up)."""
        counts = decode_compiled_counts()
        return {name: counts[name] for name in ("_prefill_jit", "_step_with_output_jit", "_insert_jit", "_release_jit")}

    # ------------------------------------------------------------------------------------------
    # The engine step

    def step(self) -> list[RequestOutput]:
        """One engine iteration: aborts; one decode step of every slot; prefill work (one chunk, or a
        whole prompt when no slot decodes) and the insertion of a prefilled request. Returns what
        each request received, in this order (a request appears at most once)."""
        outputs: list[RequestOutput] = []
        self._apply_aborts(outputs)
        if any(r is not None for r in self._slots):
            outputs.extend(self._decode_step())
        self._prefill(outputs)
        if self.stats is not None:
            for out in outputs:
                if out.finished:
                    self.stats.on_finished(out)
            self.stats.on_step(self, outputs)
        return outputs

    def warm_up(self) -> None:
        """Compiles every jitted call by serving throwaway requests to the end (a prompt of three
        chunks and one of a single token, so every prefill kind runs), again until a pass compiles
        nothing (a safety net: on a mesh, should a call return some array with another spec than it
        was given, the next call compiles once more); afterwards `step` never compiles. The
        throwaway requests bypass `max_queue` and are not reported to `stats`. Call before taking
        requests (raises RuntimeError if some are unfinished)."""
        if self.has_unfinished():
            raise RuntimeError("warm_up runs before any request: this engine has unfinished requests")
        long = max(1, min(2 * self.prefill_chunk + 1, self.max_length - 1))  # the longest prompt, if shorter
        prompts = [[0] * long, [0]]
        stats, max_queue = self.stats, self.max_queue
        self.stats, self.max_queue = None, max(max_queue, len(prompts))
        try:
            for n in range(3):
                before = self.compiled_counts()
                ids = [
                    self.add_request(
                        p,
                        max_tokens=min(2, self.max_length - len(p)),
                        ignore_eos=True,
                        request_id=f"warm-up-{n}-{i}",
                        oracle_tokens=p if self._oracle else None,
                    )
                    for i, p in enumerate(prompts)
                ]
                while any(i in self._ids for i in ids):
                    self.step()
                if self.compiled_counts() == before:
                    return
        finally:
            self.stats, self.max_queue = stats, max_queue

    def _apply_aborts(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            waiting = [r for r in self._waiting if r.id in aborts]
            for r in waiting:
                self._waiting.remove(r)
        released = np.zeros(self.max_batch, bool)
        for r in waiting:
            outputs.append(self._finish(r, "abort", [], []))
        if self._staging is not None and self._staging.request.id in aborts:
            outputs.append(self._finish(self._staging.request, "abort", [], []))
            self._staging = None
        for slot, r in enumerate(self._slots):
            if r is not None and r.id in aborts:
                released[slot] = True
                outputs.append(self._finish(r, "abort", [], []))
        if released.any():
            self._state = self.decode.release(self._state, released)

    def _decode_step(self) -> list[RequestOutput]:
        self._state, out = self.decode.step_with_output(self._state)
        num, tokens, logprobs, accepted, done = to_host(
            (out.num_committed, out.tokens, out.logprobs, out.num_accepted, out.done)
        )
        now = self.clock()
        outputs, released = [], np.zeros(self.max_batch, bool)
        for slot, r in enumerate(self._slots):
            if r is None:
                continue
            n = int(num[slot])
            out = self._absorb(r, tokens[slot, :n].tolist(), logprobs[slot, :n].tolist(), n, int(accepted[slot]), now)
            m = r.metrics
            m.num_steps += 1
            m.num_drafts += self.num_speculative_tokens
            m.num_accepted += out.num_accepted
            for j in range(out.num_accepted):
                m.accepted_per_position[j] += 1
            outputs.append(out)
            released[slot] = out.finished and not done[slot]  # a stop string: the device row still runs
        if released.any():
            self._state = self.decode.release(self._state, released)
        return outputs

    def _prefill(self, outputs: list[RequestOutput]) -> None:
        """Prefill work for this step: chunks of up to `prefill_chunk` prompt tokens in all while
        slots decode (several short prompts, or one chunk of a long one), else a whole prompt first."""
        budget = self.prefill_chunk if any(r is not None for r in self._slots) else None  # None: unbounded
        while budget is None or budget > 0:
            if self._staging is None and not self._admit():
                return
            staging = self._staging
            tokens = min(self.prefill_chunk, len(staging.request.prompt) - staging.start)
            if budget is not None and tokens > budget and staging.start == 0 and budget < self.prefill_chunk:
                return  # a new prompt that would overrun this step's budget waits for the next step
            final = staging.start + self.prefill_chunk >= len(staging.request.prompt)
            self._prefill_chunk(staging, final)
            budget = self.prefill_chunk - tokens if budget is None else budget - tokens
            if final:
                self._staging = None
                outputs.append(self._first_token(staging))

    def _admit(self) -> bool:
        """Starts prefilling the oldest waiting request into a free slot; False when there is none."""
        free = [slot for slot, r in enumerate(self._slots) if r is None]
        with self._lock:
            if not free or not self._waiting:
                return False
            request = self._waiting.popleft()
        request.metrics.scheduled_time = self.clock()
        dummies = self._staging_rows - 1  # rows for the other data-parallel devices, never read
        oracle = None
        if request.oracle_tokens is not None:  # fixed shape [rows, S]: no recompiles
            oracle = np.zeros((self._staging_rows, self.max_length), np.int32)
            oracle[0, : len(request.oracle_tokens)] = request.oracle_tokens
        state, _ = self.decode.init_state(
            [request.prompt] + [[0]] * dummies,
            max_new_tokens=[request.max_tokens] + [1] * dummies,
            sampling=[request.sampling] + [SamplingParams()] * dummies,
            max_length=self.max_length,
            stop_tokens=request.stop_token_ids,
            oracle_tokens=oracle,
        )
        state = self._placed(state)
        self._staging = _Staging(request=request, state=state, slot=free[0])  # the slot stays free until then
        return True

    def _placed(self, state: DecodeState) -> DecodeState:
        """On a mesh: `state` placed with the specs jitted calls return (`trim_specs`), so a staged or
        slot state compiles each call once, whichever call it comes from."""
        if self.mesh is None:
            return state
        return place(state, trim_specs(named_shardings(state, state.logical_axes(), self.mesh)))

    def _prefill_chunk(self, staging: _Staging, final: bool) -> None:
        prompt, size, start = staging.request.prompt, self.prefill_chunk, staging.start
        chunk = np.zeros((self._staging_rows, size), np.int32)
        part = prompt[start : start + size]
        chunk[0, : len(part)] = part
        starts = np.zeros(self._staging_rows, np.int32)
        starts[0] = start
        chunk, starts = jnp.asarray(chunk), jnp.asarray(starts)
        if self.mesh is not None:
            chunk = place(chunk, named_shardings(chunk, P("batch"), self.mesh))
            starts = place(starts, named_shardings(starts, P("batch"), self.mesh))
        staging.state = self.decode.prefill(staging.state, chunk, starts, final=final)
        staging.start = start + size

    def _first_token(self, staging: _Staging) -> RequestOutput:
        """The prefill's committed token handed out; the row enters its slot unless it finished."""
        r, state = staging.request, staging.state
        position = len(r.prompt)
        token, logprob = to_host((state.tokens[0, position], state.logprobs[0, position]))
        out = self._absorb(r, [int(token)], [float(logprob)], 1, 0, self.clock())
        if not out.finished:  # (finished: by the device's rules, or a stop string; either way it stays out)
            self._state = self.decode.insert(self._state, state, staging.slot)
            r.slot = staging.slot
            self._slots[staging.slot] = r
        return out

    # ------------------------------------------------------------------------------------------
    # Host-side bookkeeping

    def _absorb(
        self,
        r: ServedRequest,
        tokens: list[int],
        logprobs: list[float],
        num_committed: int,
        num_accepted: int,
        now: float,
    ) -> RequestOutput:
        """Hands `tokens` to `r` up to its first stop condition; returns what it received."""
        taken = r.take(tokens, now)
        return self._output(
            r, tokens[:taken], logprobs[:taken], r.text_delta(), num_committed, min(num_accepted, taken), now
        )

    def _output(self, r: ServedRequest, tokens, logprobs, text, num_committed, num_accepted, now) -> RequestOutput:
        if r.finish_reason is not None:
            r.metrics.finished_time = now
            if r.slot is not None:
                self._slots[r.slot] = None
            with self._lock:
                self._ids.discard(r.id)
        return RequestOutput(
            request_id=r.id,
            token_ids=tokens,
            logprobs=logprobs,
            text=text,
            num_committed=num_committed,
            num_accepted=num_accepted,
            prompt_tokens=len(r.prompt),
            completion_tokens=len(r.token_ids),
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
            metrics=r.metrics,
        )

    def _finish(self, r: ServedRequest, reason: str, tokens, logprobs) -> RequestOutput:
        r.finish_reason = reason
        return self._output(r, tokens, logprobs, r.text_delta() if reason != "abort" else "", 0, 0, self.clock())
