"""Structured output: the host grammar layer (`mtp_jax.serving.grammar`) on the demo tokenizer, and the device's
`apply_token_bitmask` (`mtp_jax.decode.grammar_mask`) against a NumPy reference.

The oracle for the speculative masks is a fresh matcher stepped through the same tokens one at a time.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer

from mtp_jax.decode.grammar_mask import apply_token_bitmask, bitmask_width, unpack_token_bitmask
from mtp_jax.serving.grammar import GrammarCompiler, unpack_bitmask

TOKENIZER = Path(__file__).resolve().parents[1] / "mtp_jax" / "assets" / "demo" / "tokenizer.json"
EOS = 0  # the demo's eos_token_id (config.json), "<|endoftext|>"
V = 4100  # > the tokenizer's 4096 ids and not a multiple of 32: padding ids and a partial last word

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["alpha", "beta", 3]},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
            "required": ["id", "active"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "score", "tags", "owner"],
    "additionalProperties": False,
}
DOCUMENT = '{"name": "ab c", "kind": "beta", "score": -1.5e3, "tags": [1, 22], "owner": {"id": 7, "active": true}}'


def _response_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": strict}}


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, V, [EOS])


@pytest.fixture(scope="module")
def grammar(compiler):
    return compiler.compile(_response_format(SCHEMA))


@pytest.fixture(scope="module")
def document_ids(tokenizer):
    return tokenizer.encode(DOCUMENT).ids


def _mask(matcher):
    out = np.zeros(bitmask_width(V), np.int32)
    matcher.fill_mask(out)
    return out


def _allowed(matcher):
    return np.flatnonzero(unpack_bitmask(_mask(matcher), V))


def _everything():
    """What "everything allowed" means: every id of the tokenizer (4096), no padding id."""
    allowed = np.zeros(V, bool)
    allowed[:4096] = True
    return allowed


def _pack(allowed):
    bits = np.zeros(32 * bitmask_width(V), np.uint8)
    bits[:V] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


def _oracle(grammar, prefix, drafts):
    """Masks for positions 0..K by stepping a fresh matcher one token at a time (all-allowed after a rejection)."""
    matcher = grammar.matcher()
    assert matcher.accept(prefix) == len(prefix)
    rows, rejected = [_mask(matcher)], False
    for token in drafts:
        rejected = rejected or matcher.accept([token]) != 1
        rows.append(_pack(_everything()) if rejected else _mask(matcher))
    return np.stack(rows)


def _check_document(value):
    assert list(value) == ["name", "kind", "score", "tags", "owner"]  # the schema's order
    assert isinstance(value["name"], str) and len(value["name"]) <= 8
    assert value["kind"] in ("alpha", "beta", 3)
    assert isinstance(value["score"], int | float) and not isinstance(value["score"], bool)
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in value["tags"])
    assert list(value["owner"]) == ["id", "active"]
    assert isinstance(value["owner"]["id"], int) and isinstance(value["owner"]["active"], bool)


@pytest.mark.parametrize("policy", ["lowest", "seeded"])
def test_walk_through_allowed_tokens_yields_a_valid_document(tokenizer, policy):
    """Taking an allowed id at every step until a stop token ends the grammar gives JSON that fits the schema."""
    compact = GrammarCompiler(tokenizer, V, [EOS], any_whitespace=False)  # free whitespace could go on forever
    matcher = compact.compile(_response_format(SCHEMA)).matcher()
    rng, tokens = np.random.default_rng(1), []
    while not matcher.is_terminated:
        assert len(tokens) < 2000, "the walk did not end"
        allowed = _allowed(matcher)
        assert allowed.size and allowed.max() < 4096  # never a padding id
        token = int(allowed[0] if policy == "lowest" else rng.choice(allowed))
        assert matcher.accept([token]) == 1
        tokens.append(token)
    assert tokens[-1] == EOS and EOS not in tokens[:-1]
    _check_document(json.loads(tokenizer.decode(tokens[:-1])))


def test_document_tokens_are_accepted_then_only_eos(grammar, document_ids):
    matcher = grammar.matcher()
    assert matcher.accept(document_ids) == len(document_ids)
    assert matcher.is_complete and not matcher.is_terminated
    assert _allowed(matcher).tolist() == [EOS]  # a complete object cannot be extended
    assert matcher.accept([EOS, 5]) == 1 and matcher.is_terminated
    assert matcher.accept([EOS]) == 0 and _allowed(matcher).tolist() == [EOS]
    assert matcher.num_tokens == len(document_ids) + 1


def test_eos_is_refused_before_the_document_is_complete(grammar, document_ids):
    matcher = grammar.matcher()
    assert matcher.accept([EOS]) == 0
    assert matcher.accept(document_ids[:5] + [EOS]) == 5
    assert EOS not in _allowed(matcher) and not matcher.is_terminated


def test_accept_stops_before_an_invalid_token_and_stays_usable(grammar, document_ids, tokenizer):
    matcher = grammar.matcher()
    bad = tokenizer.encode("%").ids
    assert matcher.accept(document_ids[:3] + bad + document_ids[3:]) == 3
    for invalid in (4097, 10_000, -1):  # a padding id, past V, negative: refused, the matcher still works
        assert matcher.accept([invalid]) == 0
    assert matcher.error is None and matcher.num_tokens == 3
    assert matcher.accept(document_ids[3:]) == len(document_ids) - 3


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_fill_masks_equals_stepping_one_token_at_a_time(grammar, document_ids, k):
    tokens = document_ids + [EOS, 5]  # the drafts run into the stop token and past it
    for start in range(0, len(document_ids) + 1, 3):
        matcher = grammar.matcher()
        matcher.accept(tokens[:start])
        before = _mask(matcher)
        drafts = tokens[start : start + k]
        out = np.full((len(drafts) + 1, bitmask_width(V)), 123, np.int32)
        accepted = matcher.fill_masks(drafts, out)
        np.testing.assert_array_equal(out, _oracle(grammar, tokens[:start], drafts), err_msg=f"start {start}")
        assert accepted == min(len(drafts), len(document_ids) + 1 - start)  # the 5 after EOS is refused
        np.testing.assert_array_equal(_mask(matcher), before)  # unchanged
        assert matcher.num_tokens == start and not matcher.is_terminated


def test_a_rejected_draft_fills_everything_allowed_from_its_position(grammar, document_ids, tokenizer):
    matcher = grammar.matcher()
    matcher.accept(document_ids[:1])  # '{'
    bad = tokenizer.encode("%").ids[0]
    drafts = [document_ids[1], bad, document_ids[2], document_ids[3]]  # '"' then '%': no such key
    out = np.zeros((5, bitmask_width(V)), np.int32)
    assert matcher.fill_masks(drafts, out) == 1
    rows = unpack_bitmask(out, V)
    assert not rows[1, bad]  # position 1 (after d_1) rejects d_2 ...
    for j in (2, 3, 4):  # ... so positions 2..K are never used: all tokenizer ids, no padding id
        np.testing.assert_array_equal(rows[j], _everything())
    np.testing.assert_array_equal(out, _oracle(grammar, document_ids[:1], drafts))
    assert matcher.num_tokens == 1 and matcher.error is None


def test_terminated_matcher_masks_only_stop_tokens(grammar, document_ids):
    matcher = grammar.matcher()
    matcher.accept(document_ids + [EOS])
    out = np.zeros((3, bitmask_width(V)), np.int32)
    assert matcher.fill_masks([EOS, 1], out) == 0
    assert np.flatnonzero(unpack_bitmask(out[0], V)).tolist() == [EOS]
    np.testing.assert_array_equal(unpack_bitmask(out[1:], V), [_everything()] * 2)


def test_rollback_restores_masks(grammar, document_ids):
    matcher = grammar.matcher()
    masks = [_mask(matcher)]
    for token in document_ids + [EOS]:
        assert matcher.accept([token]) == 1
        masks.append(_mask(matcher))
    for n in (1, 2, 7, len(document_ids) + 1):  # across the stop token, and all the way back
        matcher.rollback(n)
        np.testing.assert_array_equal(_mask(matcher), masks[len(masks) - 1 - n], err_msg=f"rollback {n}")
        assert not matcher.is_terminated
        matcher.accept((document_ids + [EOS])[matcher.num_tokens :])
        assert matcher.is_terminated
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(len(document_ids) + 2)
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(-1)


def test_padding_ids_are_never_allowed(compiler, tokenizer):
    matcher = compiler.compile({"type": "json_object"}).matcher()
    matcher.accept(tokenizer.encode('{"a": "').ids)  # inside a string: nearly every token allowed
    mask = _mask(matcher)
    assert unpack_bitmask(mask, V)[:4096].sum() > 3000
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    assert not bits[4096:].any()  # ids 4096..4099 and the last word's 28 bits past V


def test_json_object_regex_grammar_and_choice(compiler, tokenizer):
    def walk(grammar, text):
        matcher = grammar.matcher()
        ids = tokenizer.encode(text).ids
        return matcher.accept(ids + [EOS]) == len(ids) + 1

    assert compiler.compile({"type": "text"}) is None
    assert walk(compiler.compile({"type": "json_object"}), '{"x": [1, {"y": null}]}')
    assert not walk(compiler.compile({"type": "json_object"}), "[1, 2]")
    assert walk(compiler.compile_regex(r"\d{3}-[a-z]+"), "123-abc")
    assert not walk(compiler.compile_regex(r"\d{3}-[a-z]+"), "12-abc")
    assert walk(compiler.compile_grammar('start: "yes" | "no"'), "no")  # Lark
    assert walk(compiler.compile_grammar('root ::= "yes" | "no"'), "yes")  # GBNF
    assert walk(compiler.compile_choice(["red", "green"]), "green")
    assert not walk(compiler.compile_choice(["red", "green"]), "blue")


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "foo"}}}, "invalid JSON schema"),
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": {"$ref": "#/nope"}}}, "invalid JSON schema"),
        (_response_format({"type": "string", "format": "no-such-format"}, strict=True), "no-such-format"),
        ({"type": "json_schema", "json_schema": {"name": "t"}}, "schema is required"),
        ({"type": "json_schema", "json_schema": {"name": "t", "schema": [1]}}, "must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a boolean"),
        ({"type": "xml"}, "must be one of"),
        ("json_object", "must be an object"),
    ],
)
def test_invalid_response_formats_raise_value_error(compiler, bad, match):
    with pytest.raises(ValueError, match=match):
        compiler.compile(bad)


def test_invalid_regex_and_grammar_raise_value_error(compiler):
    with pytest.raises(ValueError, match="invalid regex"):
        compiler.compile_regex("(?<=a)b")
    with pytest.raises(ValueError, match="invalid grammar"):
        compiler.compile_grammar("start: undefined_rule")
    with pytest.raises(ValueError, match="choices"):
        compiler.compile_choice([])


def test_non_strict_schema_ignores_unknown_keywords_with_a_warning(compiler):
    grammar = compiler.compile(_response_format({"type": "string", "format": "no-such-format"}, strict=False))
    assert any("no-such-format" in w for w in grammar.warnings)


def test_compiled_grammars_are_cached_by_canonical_json(tokenizer):
    compiler = GrammarCompiler(tokenizer, V, [EOS], cache_size=2)
    a = compiler.compile(_response_format({"type": "object", "properties": {"a": {"type": "integer"}}}))
    spaced = json.loads(json.dumps(_response_format({"type": "object", "properties": {"a": {"type": "integer"}}})))
    assert compiler.compile(spaced) is a
    reordered = compiler.compile(_response_format({"properties": {"a": {"type": "integer"}}, "type": "object"}))
    assert reordered is not a  # key order is meaningful (properties come in declared order): not merged
    compiler.compile({"type": "json_object"})  # evicts the least recently used (a)
    assert compiler.cached() == 2
    assert compiler.compile(spaced) is not a


def test_compiler_rejects_bad_vocab_and_stop_ids(tokenizer):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        GrammarCompiler(tokenizer, 4000, [EOS])
    with pytest.raises(ValueError, match="empty"):
        GrammarCompiler(tokenizer, V, [])
    with pytest.raises(ValueError, match="ids of the tokenizer"):
        GrammarCompiler(tokenizer, V, [4097])


def test_fill_masks_checks_its_buffer(grammar):
    matcher = grammar.matcher()
    for out in (
        np.zeros((2, bitmask_width(V)), np.int32),  # K+1 = 3 rows needed
        np.zeros((3, bitmask_width(V)), np.int64),
        np.zeros((3, bitmask_width(V) + 1), np.int32),
        np.zeros((bitmask_width(V), 3), np.int32).T,
    ):
        with pytest.raises(ValueError, match="out must be"):
            matcher.fill_masks([1, 2], out)


@pytest.mark.parametrize("vocab", [100, 128])
def test_apply_token_bitmask_matches_numpy(vocab):
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((2, 3, vocab)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(2, 3, bitmask_width(vocab)), dtype=np.int64).astype(np.int32)
    bitmask[0, 0] = -1  # a row without a grammar
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[..., :vocab].astype(bool)
    expected = np.where(allowed, logits, -np.inf)
    got = jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask))
    np.testing.assert_array_equal(np.asarray(got), expected)
    np.testing.assert_array_equal(np.asarray(unpack_token_bitmask(jnp.asarray(bitmask), vocab)), allowed)
    np.testing.assert_array_equal(unpack_bitmask(bitmask, vocab), allowed)  # host and device agree
    with pytest.raises(ValueError):
        apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask[..., :-1]))


def test_propose_keeps_the_valid_drafts_then_the_forced_tokens(tokenizer):
    """`propose` (compact JSON, as the serving engine compiles): the drafts the grammar accepts stay; from the
    first it rejects, the tokens it forces there (after '{' the key '"name"' is forced: the schema's first
    required property, in order) replace them, as many as fit; the rest stay; the matcher is unchanged."""
    grammar = GrammarCompiler(tokenizer, V, [EOS], any_whitespace=False).compile(_response_format(SCHEMA))
    document_ids = tokenizer.encode(json.dumps(json.loads(DOCUMENT), separators=(",", ":"))).ids
    bad = tokenizer.encode("%").ids[0]
    matcher = grammar.matcher()
    before = _mask(matcher)
    proposed = matcher.propose([document_ids[0], bad, bad, bad, bad, bad])  # '{' valid, then garbage
    assert proposed[0] == document_ids[0] and proposed[4:] == [bad, bad]
    assert tokenizer.decode(proposed[:4]) == '{"name":' and grammar.matcher().accept(proposed[:4]) == 4
    np.testing.assert_array_equal(_mask(matcher), before)
    assert matcher.num_tokens == 0
    assert matcher.propose(document_ids[:4]) == document_ids[:4]  # valid drafts: unchanged
    free = grammar.matcher()
    free.accept(tokenizer.encode('{"name": "').ids)  # inside a string nothing is forced
    assert free.propose([bad, bad]) == [bad, bad]


def test_propose_fills_the_masks_fill_masks_gives_its_drafts(tokenizer):
    """`propose(drafts, out)` writes, in the same walk, the masks `fill_masks` gives for the drafts it returns:
    random drafts (valid, invalid, the stop token) from every position of a compact document."""
    grammar = GrammarCompiler(tokenizer, V, [EOS], any_whitespace=False).compile(_response_format(SCHEMA))
    document = tokenizer.encode(json.dumps(json.loads(DOCUMENT), separators=(",", ":"))).ids + [EOS]
    rng = np.random.default_rng(0)
    for start in range(len(document)):
        for k in (0, 1, 3, 5):
            matcher = grammar.matcher()
            matcher.accept(document[:start])
            drafts = [
                int(rng.integers(0, 4096)) if rng.random() < 0.4 else document[min(start + i, len(document) - 1)]
                for i in range(k)
            ]
            out = np.zeros((k + 1, bitmask_width(V)), np.int32)
            proposed = matcher.propose(drafts, out)
            expected = np.zeros_like(out)
            assert matcher.fill_masks(proposed, expected) >= 0 and matcher.num_tokens == min(start, len(document))
            np.testing.assert_array_equal(out, expected, err_msg=f"start {start}, drafts {drafts}")
