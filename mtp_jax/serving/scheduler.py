"""Continuous batching with MTP speculation: requests come and go, the jitted step stays the same.

The seed serving guide (sections 7, 8, 11; `docs/MTP_SPEC.md`, "Serving") in one class, `ServingEngine`:

- **Slots and pages.** The decode state has `max_batch` rows (slots) of at most `max_length` tokens; a
  free slot is a finished row (`done`), which a step leaves alone. The KV caches, the main model's and
  every MTP module's, are pools of `num_pages` pages of `page_size` positions (`mtp_jax.cache.PagedCache`),
  lent to requests by a host allocator (`mtp_jax.serving.pages.PageAllocator`): before each step every
  running row owns pages for its L + K + 1 positions, and a step reads only the pages the longest of
  them needs, rounded up to one of a few compiled widths (`page_buckets`), so step time follows
  the tokens held, not `max_length`. Pages are freed when a request ends, never on a rejected draft.
- **Admission** is by free pages (and a free slot). A waiting request is prefilled in a staging row state
  (one row, or one per `data` x `fsdp` device on a mesh) straight into its own pages, in chunks of
  `prefill_chunk` tokens, at most `prefill_chunk` prompt tokens per engine step while other requests
  decode (so they keep decoding), as much when none does; the row then enters a free slot
  (`DecodeEngine.insert`, no KV copied). Shapes never change: nothing compiles after `warm_up`.
- **Preemption.** When a running row cannot get its next pages, the newest request gives all of its up and
  waits at the head of the queue; re-admitted, its prompt and the tokens it had are prefilled again and
  its output continues where it stopped (greedy: token for token what it would have been).
- **Prefix caching** (`mtp_jax.serving.pages`): full pages of committed tokens are kept, keyed by the
  whole prefix; a new request reuses the longest run of them, less the last one (whose MTP entry was
  computed from the next token of the request that wrote it), from a multiple of `prefill_chunk` (so the
  rest is computed exactly as without the cache), and prefills the rest.
- **Advance by what was committed.** A step commits 1 .. K+1 tokens per row (`StepOutput`); the
  scheduler reads that count and hands each request exactly those tokens. KV use counts committed
  tokens only (rejected drafts' entries are stale, `mtp_jax.cache`).
- **Stops.** Stop tokens (EOS unless `ignore_eos`, plus the request's) and `max_tokens` are cut on
  device, inside the accepted block (`engine.commit`). Stop strings are matched on the host in the
  detokenized text, token by token, so one that completes inside an accepted block ends the output
  exactly there; the tokens after it are dropped and the slot is released at once. A stop token's
  text and a stop string are not part of the output text (OpenAI's and vLLM's default).
- **Cancellation** (`abort`) frees the slot and the pages before the next step; the other rows are
  untouched (rows never read each other's pages).

Thread use: `add_request` and `abort` may be called from any thread; `step` from one thread at a
time (`mtp_jax.serving.AsyncEngine` runs it in a background thread for the HTTP server).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
from jax.sharding import Mesh
from tokenizers import Tokenizer

from mtp_jax.decode.request import check_request
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState
from mtp_jax.model import Transformer
from mtp_jax.serving.grammar import GrammarCompiler, GrammarMatcher
from mtp_jax.serving.outputs import FINISH_REASONS, RequestMetrics, RequestOutput
from mtp_jax.serving.pages import PageAllocator
from mtp_jax.serving.paging import RowPages, prefix_caching_default
from mtp_jax.serving.requests import ServedRequest
from mtp_jax.serving.rows import DeviceRows
from mtp_jax.serving.scoring import PromptLogprobs, PromptScorer
from mtp_jax.serving.speculation import SpeculationPolicy
from mtp_jax.validation import is_integer

__all__ = ["FINISH_REASONS", "QueueFull", "RequestMetrics", "RequestOutput", "ServingEngine"]


class QueueFull(RuntimeError):
    """`add_request` when `max_queue` requests are already waiting (the server answers 429)."""


@dataclasses.dataclass
class _Staging:
    """The request being prefilled, chunk by chunk, in its own row state: `prompt` is what the device
    prefills (the request's prompt, and after a preemption the tokens it had received too)."""

    request: ServedRequest
    state: DecodeState
    slot: int
    prompt: list[int]
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
      max_batch: B, rows one step computes (requests decoding at once). max_length: S, most tokens of
        one request (prompt + output), default `config.max_position_embeddings`. num_pages: N, KV pages
        per layer (what the KV memory holds: N x page_size tokens in all), default B x ceil(S / P), the
        memory of B dense rows. page_size: P, positions per page (>= 1). prefix_caching: reuse cached
        prompt pages (default: on where the model allows it; True raises ValueError where it does not:
        recurrent layers, method "vanilla"). page_buckets: the block-table widths in pages the
        step compiles for (`mtp_jax.serving.paging.RowPages`; default 1, 4, 16, ... and the widest).
        speculative_policy: "fixed" (every step verifies K drafts) or "adaptive" (K chosen per step from
        0 .. K by measured acceptance and step times, `mtp_jax.serving.speculation`). max_logprobs: N, the
        most likely tokens a request may ask for per output token (`add_request(logprobs=)`; vLLM's
        `max_logprobs`); a step computes the top N only when a running request asked for them
        (a program of its own: warm-up compiles both).
        prefill_chunk: C, prompt tokens per prefill call
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
        num_pages: int | None = None,
        page_size: int = 16,
        prefix_caching: bool | None = None,
        page_buckets: Sequence[int] | None = None,
        speculative_policy: str = "fixed",
        max_logprobs: int = 0,
        prefill_chunk: int = 64,
        max_queue: int = 256,
        mesh: Mesh | None = None,
        clock: Callable[[], float] = time.perf_counter,
        stats=None,
    ):
        config = model.config
        max_length = config.max_position_embeddings if max_length is None else max_length
        k = 0 if speculative is None else speculative.num_speculative_tokens
        if not is_integer(page_size) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        if is_integer(max_batch) and is_integer(max_length) and num_pages is None:
            num_pages = max_batch * -(-max_length // page_size)
        for name, value, low in (
            ("max_batch", max_batch, 1),
            ("max_length", max_length, 2),
            ("num_pages", num_pages, 1),
            ("prefill_chunk", prefill_chunk, max(1, k + 1)),
            ("max_queue", max_queue, 1),
        ):
            if not is_integer(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if max_length > config.max_position_embeddings:
            raise ValueError(
                f"max_length={max_length} exceeds config.max_position_embeddings={config.max_position_embeddings}"
            )
        self.model, self.speculative, self.tokenizer, self.mesh = model, speculative, tokenizer, mesh
        self.max_batch, self.max_length, self.prefill_chunk = int(max_batch), int(max_length), int(prefill_chunk)
        self.max_queue, self.clock, self.stats = int(max_queue), clock, stats
        self.num_speculative_tokens = k
        self.pages = PageAllocator(
            int(num_pages),
            int(page_size),
            prefix_caching=prefix_caching_default(model, speculative, prefix_caching),
            salt=repr(config),  # what changes a page's KV besides its tokens: the model and its dtypes
        )
        self.paging = RowPages(
            self.pages,
            max_length=self.max_length,
            num_speculative_tokens=k,
            prefill_chunk=self.prefill_chunk,
            buckets=page_buckets,
        )
        self.speculation = SpeculationPolicy(speculative_policy, k)
        self.rows = DeviceRows(
            model,
            speculative,
            mesh=mesh,
            max_batch=self.max_batch,
            max_length=self.max_length,
            prefill_chunk=self.prefill_chunk,
            paging=self.paging,
            variants=self.speculation.variants,
            max_logprobs=max_logprobs,
        )
        self.num_preemptions = 0
        self.last_num_drafts = k  # the drafts the last decode step verified
        self._slots: list[ServedRequest | None] = [None] * self.max_batch
        self._waiting: collections.deque[ServedRequest] = collections.deque()
        self._staging: _Staging | None = None
        self._aborts: set[str] = set()
        self._ids: set[str] = set()  # every request not yet finished
        self._lock = threading.Lock()
        self._counter = itertools.count()
        self._admissions = itertools.count()  # admission order: the newest request is preempted first
        self._grammars: GrammarCompiler | None = None  # structured output's compiler (`_grammar`)
        self._scorer: PromptScorer | None = None  # prompt logprobs (`prompt_logprobs`)

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
        logprobs: int = 0,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        response_format: Mapping | None = None,
        structured_outputs: Mapping | None = None,
    ) -> str:
        """Queues a request; returns its id. Any thread.

        prompt: token ids. max_tokens: tokens to generate, default all the slot holds (max_length -
        prompt length). sampling: default greedy (its seed is used as given). stop_token_ids: ids
        that end the output (kept as its last token), besides the model's EOS ids unless
        `ignore_eos`; at most `MAX_STOP_TOKENS` (16) in all. stop: strings that end the output
        (excluded from the text; needs a tokenizer). oracle_tokens: with method "oracle" only (and
        required there), the sequence its drafts replay, prompt first (at most max_length ids).
        logprobs: the most likely tokens (0 .. `max_logprobs`) reported with each output token
        (`RequestOutput.top_logprobs`), computed on device from the raw logits at its position.
        skip_special_tokens: leave special tokens out of the text (as `Tokenizer.decode`; a stop token is
        never in it). include_stop_str_in_output: a matched stop string ends the text after it.
        response_format: structured output, OpenAI's (`{"type": "json_object"}`, `{"type": "json_schema",
        "json_schema": {"schema": ...}}`; `mtp_jax.serving.grammar`, needs a tokenizer): at every verify
        position the tokens its grammar forbids after the drafts before it are masked, so output with
        speculation is as without, and the output ends when its JSON is complete (the EOS ids are then
        the only tokens allowed; not with min_tokens, which forbids them). structured_outputs: vLLM's
        (exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`), the same way; not with
        response_format.

        Raises TypeError / ValueError naming the argument (prompt not token ids, prompt + max_tokens
        over max_length or over what `num_pages` hold, too many stop tokens, stop strings without a
        tokenizer, a response_format the grammar engine cannot compile, a request_id in use, ...) and
        `QueueFull` when `max_queue` requests wait already.
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
            oracle=self.rows.oracle,
            oracle_tokens=oracle_tokens,
            num_speculative_tokens=self.num_speculative_tokens,
            num_logprobs=logprobs,
            max_logprobs=self.max_logprobs,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=include_stop_str_in_output,
        )
        if response_format is not None or structured_outputs is not None:
            request.grammar = self._grammar(response_format, structured_outputs, request.sampling)
        need = self.pages.pages_for(self.paging.reach(len(request.prompt) + request.max_tokens))
        if need > self.num_pages:
            raise ValueError(
                f"prompt ({len(request.prompt)} tokens) + max_tokens ({request.max_tokens}) needs {need} KV pages "
                f"of {self.page_size} tokens; the pool has num_pages={self.num_pages}"
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

    def prompt_logprobs(self, prompt: Sequence[int]) -> PromptLogprobs:
        """Each prompt token's raw logprob given the tokens before it, its rank and the `max_logprobs` most likely
        tokens there (`mtp_jax.serving.scoring`: one more forward of the prompt, outside the step). Any thread.
        Raises ValueError for a prompt that is not 1 .. max_length - 1 token ids of the vocabulary."""
        prompt = check_request(self.model.config, [prompt], max_new_tokens=1, max_length=self.max_length).prompts[0]
        if self._scorer is None:
            self._scorer = PromptScorer(self.rows.decode, self.max_logprobs)
        return self._scorer.score(prompt)

    def _grammar(
        self, response_format: Mapping | None, structured_outputs: Mapping | None, sampling: SamplingParams
    ) -> GrammarMatcher | None:
        """A matcher of the request's grammar (None for plain text); its compiler is built on first use (~20 ms
        for a 4k vocabulary, ~0.4 s for 32k) and caches the grammars it compiles."""
        name = "response_format" if structured_outputs is None else "structured_outputs"
        if response_format is not None and structured_outputs is not None:
            raise ValueError("structured_outputs cannot be combined with response_format: give one")
        if self.tokenizer is None:
            raise ValueError(f"{name} needs a tokenizer (ServingEngine(tokenizer=...))")
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.model.config.vocab_size, self.model.config.eos_token_ids, any_whitespace=False
            )
        try:
            if structured_outputs is None:
                compiled = self._grammars.compile(response_format)
            else:
                compiled = self._grammars.compile_structured_outputs(structured_outputs)
        except ValueError as error:
            message = str(error)  # (named for the server's 400)
            raise ValueError(message if message.startswith(name) else f"{name}: {message}") from None
        if compiled is not None and sampling.min_tokens:
            raise ValueError(
                f"min_tokens cannot be combined with {name}: once its grammar is complete only the EOS ids may "
                "follow, which min_tokens forbids"
            )
        return None if compiled is None else compiled.matcher()

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
    def max_logprobs(self) -> int:
        """N, the most likely tokens a request may ask for per output token (`add_request(logprobs=)`)."""
        return self.rows.max_logprobs

    @property
    def num_pages(self) -> int:
        """N, KV pages in the pool (per layer)."""
        return self.pages.num_pages

    @property
    def page_size(self) -> int:
        """P, positions per KV page."""
        return self.pages.page_size

    @property
    def prefix_caching(self) -> bool:
        """Whether cached prompt pages are reused."""
        return self.pages.prefix_caching

    @property
    def kv_cache_usage(self) -> float:
        """KV pages held by requests / num_pages, in [0, 1] (vLLM's `kv_cache_usage_perc`); cached prefix
        pages nobody holds count as free."""
        return self.pages.usage

    def compiled_counts(self) -> dict[str, int]:
        """How many times each jitted call has compiled (tests check nothing compiles after warm-up)."""
        return self.rows.compiled_counts()

    # ------------------------------------------------------------------------------------------
    # The engine step

    def step(self) -> list[RequestOutput]:
        """One engine iteration: aborts; one decode step of every slot; prefill work (up to `prefill_chunk`
        prompt tokens: several short prompts or one chunk of a long one) and the insertion of a prefilled
        request. Returns what each request received, in this order (a request appears at most once)."""
        outputs: list[RequestOutput] = []
        self._apply_aborts(outputs)
        if any(r is not None for r in self._slots):
            self._decode_step(outputs)
        self._prefill(outputs)
        if self.stats is not None:
            for out in outputs:
                if out.finished:
                    self.stats.on_finished(out)
            self.stats.on_step(self, outputs)
        return outputs

    def warm_up(self) -> None:
        """Compiles every jitted call: serves throwaway requests to the end (a prompt of three chunks and
        one of a single token, so every prefill kind runs), then runs a step and both prefill kinds at
        every block-table width of `page_buckets` with no page bound (nothing written), again until a
        pass compiles nothing (a safety net: on a mesh, should a call return some array with another spec
        than it was given, the next call compiles once more); afterwards `step` never compiles. The
        throwaway requests bypass `max_queue` and are not reported to `stats`; the pages they used go
        back free, their prefixes uncached. Call before taking requests (raises RuntimeError if some are
        unfinished)."""
        if self.has_unfinished():
            raise RuntimeError("warm_up runs before any request: this engine has unfinished requests")
        pool = self.num_pages * self.page_size - self.num_speculative_tokens - 3  # a prompt the pool holds
        long = max(1, min(2 * self.prefill_chunk + 1, self.max_length - 1, pool))  # the longest, if shorter
        prompts = [[0] * long, [0]]
        stats, max_queue, caching = self.stats, self.max_queue, self.pages.prefix_caching
        self.stats, self.max_queue, self.pages.prefix_caching = None, max(max_queue, len(prompts)), False
        try:
            for n in range(3):
                before = self.compiled_counts()
                ids = [
                    self.add_request(
                        p,
                        max_tokens=min(2, self.max_length - len(p)),
                        ignore_eos=True,
                        request_id=f"warm-up-{n}-{i}",
                        oracle_tokens=p if self.rows.oracle else None,
                    )
                    for i, p in enumerate(prompts)
                ]
                while any(i in self._ids for i in ids):
                    self.step()
                self.rows.warm_widths()
                if self.compiled_counts() == before:
                    return
        finally:
            self.stats, self.max_queue, self.pages.prefix_caching = stats, max_queue, caching
            self.speculation.reset()  # its step times included compiling

    def _apply_aborts(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            waiting = [r for r in self._waiting if r.id in aborts]
            for r in waiting:
                self._waiting.remove(r)
        for r in waiting:
            outputs.append(self._finish(r, "abort", [], []))
        if self._staging is not None and self._staging.request.id in aborts:
            outputs.append(self._finish(self._staging.request, "abort", [], []))
            self._staging = None
        released = [slot for slot, r in enumerate(self._slots) if r is not None and r.id in aborts]
        for slot in released:
            outputs.append(self._finish(self._slots[slot], "abort", [], []))
        self.rows.release(released)

    def _reserve_running(self) -> None:
        """Pages for every running row's next step; the newest requests are preempted while some row
        cannot get them."""
        for r in sorted((r for r in self._slots if r is not None), key=lambda r: r.admitted):
            while r.slot is not None and not self.pages.reserve(r.id, self.paging.reach(r.length)):
                self._preempt_newest()

    def _preempt_newest(self) -> None:
        """The most recently admitted running or prefilling request gives up its pages and its slot and
        waits at the head of the queue (its received tokens become part of the prompt it is prefilled
        with when re-admitted)."""
        running = [r for r in self._slots if r is not None]
        if self._staging is not None:
            running.append(self._staging.request)
        newest = max(running, key=lambda r: r.admitted)
        self.pages.release(newest.id)
        if self._staging is not None and newest is self._staging.request:
            self._staging = None
        else:
            self.rows.release([newest.slot])
            self._slots[newest.slot], newest.slot = None, None
        newest.metrics.num_preemptions += 1
        self.num_preemptions += 1
        with self._lock:
            self._waiting.appendleft(newest)

    def _decode_step(self, outputs: list[RequestOutput]) -> None:
        self._reserve_running()
        running = [r for r in self._slots if r is not None]
        if not running:
            return
        width = self.paging.width(max(self.paging.reach(r.length) for r in running))
        chosen, start = self.speculation.choose(width), self.clock()
        # Adaptive plain steps draft nothing; the first step after them that would verify drafts is a plain
        # step that drafts (not timed: the policy's choice stays pending until it runs).
        redraft = chosen > 0 and self.rows.drafts_stale
        k = 0 if redraft else chosen
        draft_next = chosen > 0 or not self.rows.plain_steps_skip_drafts
        top_logprobs = any(r.num_logprobs for r in running)
        step = self.rows.step(self._slots, width, k, draft_next=draft_next, top_logprobs=top_logprobs)
        num, tokens, logprobs, accepted, done = (
            step.num_committed,
            step.tokens,
            step.logprobs,
            step.num_accepted,
            step.done,
        )
        now = self.clock()
        self.last_num_drafts = k
        released = []
        for slot, r in enumerate(self._slots):
            if r is None:
                continue
            n = int(num[slot])
            r.drafts = step.drafts[slot]
            tops = _top_logprobs(r, step.top_logprobs[slot, :n], step.top_tokens[slot, :n])
            out = self._absorb(
                r, tokens[slot, :n].tolist(), logprobs[slot, :n].tolist(), n, int(accepted[slot]), now, k, tops
            )
            r.metrics.count_step(k, out.num_accepted)
            outputs.append(out)
            if out.finished and not done[slot]:  # a stop string: the device row still runs
                released.append(slot)
            if not out.finished:
                self.paging.offer(r)
        if not redraft:  # timed with the host's share (detokenizing, stop strings), which larger blocks amortize
            self.speculation.observe(k, width, self.clock() - start, [int(accepted[r.slot]) for r in running])
        self.rows.release(released)

    def _prefill(self, outputs: list[RequestOutput]) -> None:
        """Prefill work for this step: chunks of up to `prefill_chunk` prompt tokens in all while
        slots decode (several short prompts, or one chunk of a long one); when none does, one chunk and then
        whole prompts while they fit the rest of the chunk's budget."""
        budget = self.prefill_chunk if any(r is not None for r in self._slots) else None  # None: unbounded
        while budget is None or budget > 0:
            if self._staging is None and not self._admit():
                return
            staging = self._staging
            tokens = min(self.prefill_chunk, len(staging.prompt) - staging.start)
            if budget is not None and tokens > budget and staging.start == 0 and budget < self.prefill_chunk:
                return  # a new prompt that would overrun this step's budget waits for the next step
            final = staging.start + self.prefill_chunk >= len(staging.prompt)
            staging.state = self.rows.prefill(
                staging.state, staging.request, staging.prompt, staging.start, final=final
            )
            staging.start += self.prefill_chunk
            budget = self.prefill_chunk - tokens if budget is None else budget - tokens
            if final:
                self._staging = None
                outputs.append(self._first_token(staging))

    def _admit(self) -> bool:
        """Starts prefilling the oldest waiting request into a free slot and its pages (a prefix of
        them from the prefix cache); False when there is no free slot, no waiting request or not
        enough free pages for its prompt (plus one page per running row, so they can grow)."""
        free = [slot for slot, r in enumerate(self._slots) if r is None]
        with self._lock:
            if not free or not self._waiting:
                return False
            request = self._waiting[0]
        prompt = request.prompt + request.token_ids  # after a preemption: what it had received, too
        start = self.paging.cached_prefix(prompt)
        if start:
            self.pages.adopt(request.id, prompt, start)
        reach, running = self.paging.reach(len(prompt)), sum(r is not None for r in self._slots)
        need = self.pages.pages_for(reach) - start // self.page_size  # pages still to take
        if self.pages.num_free_pages - running < need or not self.pages.reserve(request.id, reach):
            if start:
                self.pages.release(request.id)
            return False  # (an idle engine always admits: add_request checked that the request fits the pool)
        with self._lock:
            self._waiting.popleft()
        request.admitted = next(self._admissions)
        if request.metrics.scheduled_time is None:
            request.metrics.scheduled_time = self.clock()
        request.pages_final, request.metrics.num_cached_tokens = start, start
        self.paging.admitted(prompt, start)
        state = self.rows.staging(prompt, request.max_tokens - len(request.token_ids), request)
        self._staging = _Staging(request=request, state=state, slot=free[0], prompt=prompt, start=start)
        return True

    def _first_token(self, staging: _Staging) -> RequestOutput:
        """The prefill's committed token handed out; the row enters its slot unless it finished."""
        r = staging.request
        token, logprob, values, ids, r.drafts = self.rows.first_token(staging.state, len(staging.prompt))
        out = self._absorb(r, [token], [logprob], 1, 0, self.clock(), 0, _top_logprobs(r, values[None], ids[None]))
        if not out.finished:  # (finished: by the device's rules, or a stop string; either way it stays out)
            self.rows.insert(staging.state, staging.slot)
            r.slot = staging.slot
            self._slots[staging.slot] = r
            self.paging.offer(r)
        return out

    # ------------------------------------------------------------------------------------------
    # Host-side bookkeeping

    def _absorb(self, r: ServedRequest, tokens: list[int], logprobs: list[float], num_committed: int,
                num_accepted: int, now: float, num_drafts: int = 0, tops=()) -> RequestOutput:  # fmt: skip
        """Hands `tokens` (and their `tops`) to `r` up to its first stop condition; returns what it received."""
        taken = r.take(tokens, now)
        accepted = min(num_accepted, taken)
        return self._output(
            r, tokens[:taken], logprobs[:taken], r.text_delta(), num_committed, accepted, now, num_drafts, tops[:taken]
        )

    def _output(
        self, r: ServedRequest, tokens, logprobs, text, num_committed, num_accepted, now, num_drafts=0, tops=()
    ) -> RequestOutput:
        """`r`'s output; a finished request leaves its slot, its pages and the unfinished ids."""
        if r.finish_reason is not None:
            r.metrics.finished_time = now
            if r.slot is not None:
                self._slots[r.slot] = None
            if self.pages.holds(r.id):
                self.pages.release(r.id)
            with self._lock:
                self._ids.discard(r.id)
        return r.output(tokens, logprobs, text, num_committed, num_accepted, num_drafts, tops)

    def _finish(self, r: ServedRequest, reason: str, tokens, logprobs) -> RequestOutput:
        r.finish_reason = reason
        return self._output(r, tokens, logprobs, r.text_delta() if reason != "abort" else "", 0, 0, self.clock())


def _top_logprobs(r: ServedRequest, values: np.ndarray, ids: np.ndarray) -> list[list[tuple[int, float]]]:
    """Per position, the `r.num_logprobs` most likely (token id, raw logprob) pairs of `values` / `ids`
    ([n, N], most likely first); [] when it asked for none."""
    m = r.num_logprobs
    if not m:
        return []
    return [list(zip(i[:m].tolist(), v[:m].tolist(), strict=True)) for v, i in zip(values, ids, strict=True)]
