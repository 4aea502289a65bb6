"""Structured output, host side: grammars from OpenAI `response_format` and token bitmasks for verification.

Flow: one `GrammarCompiler` per server (built from the `tokenizers.Tokenizer`, the model's vocab_size and
the stop/EOS ids) -> `compile(response_format)` -> `CompiledGrammar` (cached in an LRU keyed by the
canonical JSON of the request) -> `CompiledGrammar.matcher()` per request -> every decode step:
`GrammarMatcher.fill_masks(drafts, out)` before verification (one [K+1, W] bitmask per row), then
`GrammarMatcher.accept(committed_tokens)` after it. The device applies the masks with
`mtp_jax.decode.grammar_mask.apply_token_bitmask`, which does not import this module or its engine.

Accepted forms:

- OpenAI `response_format`: `{"type": "text"}` (no grammar: `compile` returns None, no mask),
  `{"type": "json_object"}` (any JSON object), `{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}, "strict": ...}}`. With `"strict": true` every schema keyword must be enforced or the
  compile fails; otherwise (OpenAI's default) keywords the engine does not implement (an unknown
  `format`, say) are ignored with a warning (`CompiledGrammar.warnings`) and the rest is enforced.
- vLLM-style structured outputs: `compile_regex` (the whole output matches the pattern; Rust `regex`
  syntax, no look-around or back-references), `compile_grammar` (a Lark grammar, or a GBNF/EBNF one in
  llama.cpp's syntax, converted to Lark), `compile_choice` (exactly one of the strings).

JSON objects follow the schema's own semantics (`additionalProperties` absent allows extra keys, as JSON
Schema says), their properties in the schema's declared order (the engine enforces it, as OpenAI's
structured outputs write them; so the cache key, the schema's compact JSON, keeps the key order:
reordered schemas compile apart). Whitespace between JSON tokens is free unless the compiler is built
with `any_whitespace=False` (then compact: "," and ":" with no spaces). A complete JSON value cannot be
followed by anything but a stop token.

Bitmask layout (xgrammar's and llguidance's): int32 [..., W], W = ceil(V / 32), V the model's vocab_size;
bit i of word w (`(mask[w] >> i) & 1`, i in 0..31) set means token 32*w + i is allowed. Bits of ids >= the
tokenizer's size (padding rows of the embedding) and past V in the last word are never set.

Stop tokens: the compiler's `stop_token_ids` (the model's EOS ids) are allowed exactly when the text so far
is a complete match; when the grammar is finished (a complete value that cannot be extended, e.g. a
closing brace) they are the only allowed tokens. A stop token is never grammar text. Once one is accepted
the matcher is terminated and its mask allows only the stop tokens again (the row has ended anyway).

Engine: llguidance 1.9.1 (`LLMatcher`), picked over xgrammar 0.2.8 by measurement (benchmarks/bench_grammar.py;
results/grammar_cpu_2026-12-03.md and _bpe32k.md; a schema with nested objects, enums, arrays and numbers;
the demo tokenizer, V = 4096 / a 32k byte-level BPE; 2 shared cores; per-step figures are medians (p90)
per call for one row, walking a valid document):

| | llguidance 1.9.1 | xgrammar 0.2.8 |
|---|---:|---:|
| import | 0.03 s, +5 MB, no dependencies | 2.7 s, +236 MB (imports torch, transformers) |
| tokenizer info, once per server | 20 / 395 ms | 6 / 84 ms |
| compile the schema, cold | 0.9 / 1.1 ms | 2.9 / 10.6 ms |
| compile `json_object` | 0.4 / 0.5 ms | 2.7 / 7.2 ms |
| new matcher per request | 1.2 us | 2.8 us |
| memory per compiled grammar (RSS) | ~170 / 70 KB | ~90 / 26 KB |
| fill_masks K=0 | 6.9 (11) / 16 (28) us | 1.9 (3.8) / 3.3 (21) us |
| fill_masks K=3 (4 masks, 3 advances, 1 rollback) | 25 (31) / 55 (79) us | 9 (15) / 18 (62) us |
| accept one token; roll back 3 | 2.0 / 3.5 us; 0.6 / 0.9 us | 1.1 us; 0.5 us |
| rollback depth | unlimited (2,400 tokens tried) | unlimited (`max_rollback_tokens` deprecated) |

xgrammar fills masks 2-4x faster (it precomputes token masks per grammar state when compiling, hence its 3-10x
slower compiles, which sit on a request's time to first token; llguidance defers some lexer work to the first
masks instead: a fresh grammar's first 167-token walk took 2-3.6 ms against 1.4 ms after), but both stay well
under 0.1 ms per row and step at K = 3, against demo decode steps of 15-270 ms on this CPU. The deciding costs
are elsewhere: xgrammar requires torch, transformers and triton at run time (torch is only the optional
`parity` extra here) and loads torch on import; llguidance is one self-contained wheel, builds its tokenizer
from the `tokenizer.json` string (`LLTokenizer(json, n_vocab=V, eos_token=stops)`, no transformers; xgrammar's
`TokenizerInfo(vocab_list, VocabType.BYTE_LEVEL, vocab_size=V, stop_token_ids=...)` works too), compiles
lazily (a template matcher per grammar, copied per request), reports grammar errors and warnings as text, and
computes masks with the GIL released (so a batch's masks can overlap the device step; `LLExecutor` also fills
a batch's masks with drafts on several threads). Sources followed: the packages' docstrings and type stubs
(`llguidance/_lib.pyi`, `llguidance/numpy.py`, `xgrammar/matcher.py`, `xgrammar/tokenizer_info.py`).

Behaviours of the engine this module hides (measured, llguidance 1.9.1): an invalid token passed to
`consume_token` puts the matcher in a permanent error state that rollback cannot leave, so tokens are fed
with `try_consume_tokens`, which stops before a bad token, except an id >= V, which errors there too: ids
are range-checked here first; a stop token consumed once the grammar is finished is accepted but not counted
by the engine's rollback (rolling back 1 then undoes the closing brace), so stop tokens are kept out of the
engine and tracked here.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import llguidance
import numpy as np
import tokenizers

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "bitmask_width", "unpack_bitmask"]

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's `structured_outputs`


def bitmask_width(vocab_size: int) -> int:
    """W = ceil(vocab_size / 32): the int32 words of one token bitmask."""
    return (int(vocab_size) + 31) // 32


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Expands an int32 bitmask [..., W] to bool [..., vocab_size] (True = allowed); for tests and debugging.

    Raises ValueError if W != ceil(vocab_size / 32) or the dtype is not int32.
    """
    bitmask = np.asarray(bitmask)
    if bitmask.dtype != np.int32 or bitmask.shape[-1:] != (bitmask_width(vocab_size),):
        raise ValueError(
            f"bitmask must be int32 [..., {bitmask_width(vocab_size)}] for vocab_size {vocab_size}, "
            f"got {bitmask.dtype} {bitmask.shape}"
        )
    as_bytes = np.ascontiguousarray(bitmask).astype("<i4", copy=False).view(np.uint8)
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


class CompiledGrammar:
    """One compiled grammar, shared by every request that asks for it; `matcher()` gives each its own state.

    Attributes: `key` (the canonical JSON it was compiled from, the cache key), `warnings` (the engine's
    warnings, e.g. ignored schema keywords), `vocab_size` (V), `bitmask_width` (W). Immutable: nothing here
    changes after compilation, so it may be shared across threads.
    """

    def __init__(self, key: str, template: llguidance.LLMatcher, compiler: GrammarCompiler):
        self.key = key
        self.warnings: tuple[str, ...] = tuple(template.get_grammar_warnings())
        self.vocab_size = compiler.vocab_size
        self.bitmask_width = compiler.bitmask_width
        self.stop_token_ids = compiler.stop_token_ids
        self._template = template  # never advanced: only deep-copied
        self._stop_row = compiler._stop_row
        self._all_row = compiler._all_row

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (a copy of a template: microseconds)."""
        return GrammarMatcher(self)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.key[:80]!r}{'...' if len(self.key) > 80 else ''})"


class GrammarCompiler:
    """Compiles `response_format`s (and regex / grammar / choice constraints) for one tokenizer and model.

    Args:
      tokenizer: the server's `tokenizers.Tokenizer` (its JSON is read once; it is not modified).
      vocab_size: the model's vocabulary V (rows of the output head), >= the tokenizer's size; ids from the
        tokenizer's size up to V are never allowed.
      stop_token_ids: the ids that end a completion (the model's EOS ids), at least one, each a token of the
        tokenizer: allowed when the text is a complete match, and then the only ones allowed once the
        grammar is finished.
      cache_size: compiled grammars kept (least recently used evicted), >= 1.
      any_whitespace: free whitespace between JSON tokens (the engine's default); False: compact JSON.

    Raises ValueError if vocab_size is smaller than the tokenizer's size, stop_token_ids is empty or holds an
    id outside the tokenizer, or cache_size < 1. Building takes ~20 ms for the demo's 4k vocabulary and ~0.4 s
    for 32k (the engine's token trie); do it once per server. `compile*` methods are thread-safe.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = 64,
        any_whitespace: bool = True,
    ):
        spec = json.loads(tokenizer.to_str())
        spec["padding"] = spec["truncation"] = None  # a padded encode would break the engine's tokenizer
        self.tokenizer_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.vocab_size = int(vocab_size)
        if self.vocab_size < self.tokenizer_size:
            raise ValueError(f"vocab_size {self.vocab_size} is smaller than the tokenizer's {self.tokenizer_size} ids")
        stops = tuple(dict.fromkeys(int(t) for t in stop_token_ids))
        if not stops:
            raise ValueError("stop_token_ids is empty: a finished grammar would allow no token at all")
        if any(not 0 <= t < self.tokenizer_size for t in stops):
            raise ValueError(
                f"stop_token_ids {list(stops)} must be ids of the tokenizer (0..{self.tokenizer_size - 1})"
            )
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.stop_token_ids = stops
        self.bitmask_width = bitmask_width(self.vocab_size)
        self.cache_size = int(cache_size)
        self._options: dict = {} if any_whitespace else {"whitespace_flexible": False}
        self._tokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=self.vocab_size, eos_token=list(stops))
        self._stop_row = _row_with(self.bitmask_width, stops)
        self._all_row = _row_with(self.bitmask_width, range(self.tokenizer_size))
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, response_format: Mapping) -> CompiledGrammar | None:
        """Compiles an OpenAI `response_format`; None for `{"type": "text"}` (no constraint).

        Raises ValueError (for a 400) on an unknown type, a missing or non-object `json_schema.schema`, a
        non-boolean `strict`, or a schema the engine cannot compile (the message says why).
        """
        if not isinstance(response_format, Mapping):
            raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.compile_json_schema({"type": "object"}, strict=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, Mapping):
                raise ValueError("response_format.json_schema must be an object with a 'schema'")
            if "schema" not in spec:
                raise ValueError("response_format.json_schema.schema is required")
            strict = spec.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise ValueError(f"response_format.json_schema.strict must be a boolean, got {strict!r}")
            return self.compile_json_schema(spec["schema"], strict=bool(strict))
        raise ValueError(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")

    def compile_structured_outputs(self, spec: Mapping) -> CompiledGrammar:
        """Compiles vLLM's `structured_outputs`: exactly one of `json` (a JSON schema, as an object or its JSON
        text), `regex`, `choice` (a list of strings), `grammar` (Lark or GBNF) or `json_object: true`.

        Raises ValueError (for a 400) naming `structured_outputs` for anything else, or when the constraint
        does not compile."""
        if not isinstance(spec, Mapping):
            raise ValueError(f"structured_outputs must be an object, got {type(spec).__name__}")
        given = {key: value for key, value in spec.items() if value is not None and value is not False}
        unknown = sorted(set(given) - set(STRUCTURED_OUTPUT_KINDS))
        if unknown or len(given) != 1:
            raise ValueError(
                f"structured_outputs must give exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}"
                + (f"; unknown: {', '.join(unknown)}" if unknown else f"; got {len(given)}")
            )
        ((kind, value),) = given.items()
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as error:
                    raise ValueError(f"structured_outputs.json is not JSON: {error}") from None
            return self.compile_json_schema(value)
        if kind == "json_object":
            return self.compile_json_schema({"type": "object"})
        return {"regex": self.compile_regex, "choice": self.compile_choice, "grammar": self.compile_grammar}[kind](
            value
        )

    def compile_json_schema(self, schema: Mapping, *, strict: bool = True) -> CompiledGrammar:
        """Output = one JSON value valid against `schema` (a JSON Schema object).

        strict: every keyword must be enforced (else ValueError); False ignores keywords the engine does not
        implement, listing them in `warnings`. Raises ValueError if `schema` is not a JSON object or cannot be
        compiled.
        """
        if not isinstance(schema, Mapping):
            raise ValueError(f"the JSON schema must be an object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)  # key order kept: it is meaningful
        except (TypeError, ValueError) as error:
            raise ValueError(f"the JSON schema is not JSON-serialisable: {error}") from None
        options = dict(self._options, lenient=not strict)
        key = f'["json_schema",{text},{json.dumps(options, sort_keys=True, separators=(",", ":"))}]'

        def build() -> str:
            return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=options)

        return self._compiled(key, build, "JSON schema")

    def compile_regex(self, pattern: str) -> CompiledGrammar:
        """Output = a full match of `pattern` (Rust `regex` syntax). Raises ValueError if it does not compile."""
        if not isinstance(pattern, str):
            raise ValueError(f"the regex must be a string, got {type(pattern).__name__}")
        return self._compiled(
            json.dumps(["regex", pattern]), lambda: llguidance.grammar_from("regex", pattern), "regex"
        )

    def compile_grammar(self, grammar: str) -> CompiledGrammar:
        """Output = a sentence of `grammar`: Lark (start rule `start`), or GBNF/EBNF (`root ::= ...`, converted).

        Raises ValueError if it cannot be converted or compiled.
        """
        if not isinstance(grammar, str):
            raise ValueError(f"the grammar must be a string, got {type(grammar).__name__}")
        return self._compiled(
            json.dumps(["grammar", grammar]), lambda: llguidance.grammar_from("grammar", grammar), "grammar"
        )

    def compile_choice(self, choices: Sequence[str]) -> CompiledGrammar:
        """Output = exactly one of `choices` (non-empty strings). Raises ValueError on an empty or non-string list."""
        if isinstance(choices, str) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choices must be a non-empty list of non-empty strings, got {choices!r}")
        text = json.dumps(list(choices))
        return self._compiled(
            json.dumps(["choice", list(choices)]), lambda: llguidance.grammar_from("choice", text), "choice"
        )

    def cached(self) -> int:
        """How many compiled grammars the cache holds."""
        with self._lock:
            return len(self._cache)

    def _compiled(self, key: str, build, what: str) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            source = build()
        except ValueError as error:
            raise ValueError(f"invalid {what}: {error}") from None
        template = llguidance.LLMatcher(self._tokenizer, source, log_level=0)  # never raises: errors are state
        if template.is_error():
            raise ValueError(f"invalid {what}: {_first_lines(template.get_error())}")
        compiled = CompiledGrammar(key, template, self)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)  # another thread may have won the race
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled


class GrammarMatcher:
    """One request's position in its grammar; advance with `accept`, undo with `rollback`, read masks.

    Not thread-safe (one per request, driven by the scheduler). `num_tokens` counts accepted tokens,
    a stop token included.
    """

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self._matcher = grammar._template.deep_copy()
        self._stops = frozenset(grammar.stop_token_ids)
        self._vocab_size = grammar.vocab_size
        self._row_bytes = 4 * grammar.bitmask_width
        self._consumed = 0  # tokens inside the engine (stop tokens never enter it)
        self._ended = False  # a stop token has been accepted

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (a stop token counts one)."""
        return self._consumed + self._ended

    @property
    def is_terminated(self) -> bool:
        """True once a stop token has been accepted: the grammar is done and `accept` takes nothing more."""
        return self._ended

    @property
    def is_complete(self) -> bool:
        """True if the text so far is a complete match (a stop token may come next), or it has come."""
        return self._ended or self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """The engine's error if a resource limit was hit (then masks allow only stop tokens); else None."""
        return _first_lines(self._matcher.get_error()) if self._matcher.is_error() else None

    def accept(self, tokens: Sequence[int]) -> int:
        """Advances through committed `tokens` in order; returns how many were valid (a prefix).

        Stops before the first token the grammar rejects (the matcher stays at the state after the valid
        prefix, and the invalid token leaves no trace); a stop token is valid when the text is a complete
        match, and terminates the matcher: the tokens after it are not accepted. Ids outside [0, V) are
        invalid. With masks applied, every committed token is valid: fewer means a bug upstream.
        """
        if self._ended:
            return 0
        tokens = [int(t) for t in tokens]
        cut = len(tokens)
        for i, token in enumerate(tokens):
            if token in self._stops or not 0 <= token < self._vocab_size:  # kept out of the engine
                cut = i
                break
        if cut:
            valid = self._matcher.try_consume_tokens(tokens[:cut])
            self._consumed += valid
            if valid < cut:
                return valid
        if cut < len(tokens) and tokens[cut] in self._stops and self._matcher.is_accepting():
            self._ended = True
            return cut + 1
        return cut

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (a stop token included); no limit on the depth.

        Raises ValueError if num_tokens < 0 or > `num_tokens`.
        """
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_tokens} accepted")
        if num_tokens and self._ended:
            self._ended, num_tokens = False, num_tokens - 1
        if num_tokens:
            if not self._matcher.rollback(num_tokens):
                raise RuntimeError(f"grammar engine failed to roll back: {self.error}")
            self._consumed -= num_tokens

    def fill_mask(self, out: np.ndarray) -> None:
        """Writes the next token's bitmask for the current state into `out`, int32 [W], C-contiguous.

        Terminated: only the stop tokens. Raises ValueError on a wrong shape, dtype or layout.
        """
        _check_out(out, (self.grammar.bitmask_width,))
        self._fill(out.reshape(1, -1), out.ctypes.data, 0)

    def fill_masks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """Fills the bitmasks of one row's K+1 verify positions; the matcher is unchanged afterwards.

        Args:
          drafts: the K draft tokens d_1..d_K proposed after the committed text (K >= 0).
          out: int32 [K+1, W], C-contiguous, writable. Row 0 gets the mask for the current state (what may
            follow the committed text: checks d_1 and samples the correction/bonus there); row j (1..K) the
            mask for the state after d_1..d_j, obtained by advancing through the drafts and rolling back.
            At the first draft d_j the grammar rejects, rows j..K are filled with "everything allowed" (every
            id of the tokenizer): verification rejects d_j at position j-1, whose mask excludes it, so
            positions j..K are never used, and no state exists to mask them by. A stop draft d_j the
            grammar accepts gets row j = the stop tokens only; nothing follows a stop token, so any later
            draft counts as rejected and its rows are "everything allowed" (the row ends at d_j anyway).

        Returns how many leading drafts the grammar accepts (0..K). Raises ValueError on a wrong `out`.
        """
        drafts = [int(t) for t in drafts]
        _check_out(out, (len(drafts) + 1, self.grammar.bitmask_width))
        rows = out.reshape(-1, self.grammar.bitmask_width)
        address = out.ctypes.data
        self._fill(rows, address, 0)
        advanced = 0
        for j, token in enumerate(drafts, start=1):
            if not self._advance(token):
                rows[j:] = self.grammar._all_row
                break
            advanced += 1
            self._fill(rows, address, j)
        self.rollback(advanced)
        return advanced

    def propose(self, drafts: Sequence[int], out: np.ndarray | None = None) -> list[int]:
        """Drafts for the next verify pass, and their masks: the longest prefix of `drafts` the grammar
        accepts, then the tokens it forces after that prefix (llguidance's fast-forward tokens: JSON keys,
        punctuation) in place of the drafts there, as many as fit; the rest unchanged (rejected at
        verification unless valid). A drafter that does not see the grammar mostly proposes text it forbids;
        forced tokens are verified like any draft (a deterministic proposal: lossless). `out` (int32 [K+1, W],
        optional) gets what `fill_masks(returned drafts, out)` would write, in the same walk. The matcher is
        unchanged afterwards."""
        drafts = [int(t) for t in drafts]
        if out is None:
            out = np.empty((len(drafts) + 1, self.grammar.bitmask_width), np.int32)
        _check_out(out, (len(drafts) + 1, self.grammar.bitmask_width))
        rows, address = out.reshape(-1, self.grammar.bitmask_width), out.ctypes.data
        self._fill(rows, address, 0)
        advanced, forced = 0, False
        for j in range(len(drafts)):
            valid = self._advance(drafts[j])
            if not valid and not forced and not self._ended:  # the first rejected draft: forced tokens from here
                forced = True
                tokens = list(self._matcher.compute_ff_tokens())[: len(drafts) - j]
                drafts[j : j + len(tokens)] = tokens
                valid = bool(tokens) and self._advance(drafts[j])
            if not valid:
                rows[j + 1 :] = self.grammar._all_row
                break
            advanced += 1
            self._fill(rows, address, j + 1)
        self.rollback(advanced)
        return drafts

    def _advance(self, token: int) -> bool:
        """`accept((token,)) == 1`, without the list handling (the speculative loop's step)."""
        if token in self._stops:
            if self._ended or not self._matcher.is_accepting():
                return False
            self._ended = True
            return True
        if self._ended or not 0 <= token < self._vocab_size or self._matcher.try_consume_tokens([token]) != 1:
            return False
        self._consumed += 1
        return True

    def _fill(self, rows: np.ndarray, address: int, row: int) -> None:
        """Row `row` of `rows` ([R, W] view of a checked buffer starting at `address`) for the current state."""
        if self._ended:
            rows[row] = self.grammar._stop_row
        else:
            self._matcher.unsafe_compute_mask_ptr(address + row * self._row_bytes, self._row_bytes)


def _row_with(width: int, ids) -> np.ndarray:
    """An int32 [width] bitmask with exactly `ids` set."""
    bits = np.zeros(width * 32, dtype=np.uint8)
    bits[np.fromiter(ids, dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def _check_out(out: np.ndarray, shape: tuple[int, ...]) -> None:
    # The engine writes through a raw pointer: the buffer must be exactly what it expects.
    if not (
        isinstance(out, np.ndarray)
        and out.dtype == np.int32
        and out.shape == shape
        and out.flags.c_contiguous
        and out.flags.writeable
    ):
        got = f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out must be a writable C-contiguous int32 array of shape {shape}, got {got}")


def _first_lines(message: str, lines: int = 6) -> str:
    """The head of an engine error (it may append a dump of the parser state)."""
    return "\n".join(message.strip().splitlines()[:lines])
