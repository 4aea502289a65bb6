"""Structured output under speculation (`ServingEngine.add_request(response_format=)`, `mtp_jax.serving.grammar`):
every verify position's target is masked by the grammar after the drafts before it, so greedy output with MTP
speculation equals greedy output without, token for token, and every output parses and validates against its
schema; rows without a grammar in the same batch are untouched; nothing compiles after warm-up.

The demo model (a small code model) writes the JSON; the compact whitespace the engine uses keeps it from
looping on newlines, and the schema bounds its strings.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from test_serving_engine import drain

from mtp_jax import SamplingParams, SpeculativeConfig, generate, load_pretrained
from mtp_jax.serving import ServingEngine

S = 192
EAGLE = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["function", "class", "module"]},
        "args": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "integer"}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "args", "ok", "score", "inner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA, "strict": True}}
TEXTS = ["def parse(x):\n    return", "import os\n", "class A:\n", "# data\n"]


def check(value, schema: dict, where: str = "$") -> None:
    """Asserts `value` satisfies `schema` (the keywords `SCHEMA` uses)."""
    if "enum" in schema:
        assert value in schema["enum"], where
        return
    kind = schema["type"]
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "integer": int, "number": (int, float)}
    assert isinstance(value, types[kind]) and (kind == "boolean" or not isinstance(value, bool)), where
    if kind == "object":
        assert set(schema["required"]) <= set(value), where
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"]), where
        for key, item in value.items():
            check(item, schema["properties"][key], f"{where}.{key}")
    elif kind == "array":
        assert len(value) <= schema.get("maxItems", len(value)), where
        for i, item in enumerate(value):
            check(item, schema["items"], f"{where}[{i}]")
    elif kind == "string":
        assert len(value) <= schema.get("maxLength", len(value)), where
    else:
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), where


@pytest.fixture(scope="module")
def engines():
    model, tokenizer = load_pretrained()
    built = {}
    for name, spec in (("plain", None), ("eagle", EAGLE)):
        engine = ServingEngine(model, spec, tokenizer=tokenizer, max_batch=4, max_length=S, prefill_chunk=32)
        engine.warm_up()
        built[name] = engine
    return model, tokenizer, built, built["eagle"].compiled_counts()  # (the counts are all engines')


def test_greedy_structured_output_with_speculation_equals_plain_and_validates(engines):
    """Four constrained greedy requests and one unconstrained in one batch (more requests than slots: some
    wait and enter later), eagle K = 3 and plain: the same tokens; each constrained output is JSON that
    validates and ends with EOS; the unconstrained one equals `generate` alone; eagle accepts more than one
    draft a step under the grammar (its forced tokens replace the drafts it rejects; the counts add up); no
    step compiled after warm-up."""
    model, tokenizer, built, warm = engines
    prompts = [tokenizer.encode(t).ids for t in TEXTS]
    results = {}
    for name, engine in built.items():
        ids = [engine.add_request(p, max_tokens=120, response_format=FORMAT) for p in prompts]
        free = engine.add_request(prompts[0], max_tokens=20)
        outputs = drain(engine)
        assert engine.compiled_counts() == warm
        results[name] = [[t for o in outputs[i] for t in o.token_ids] for i in ids]
        for i in ids:
            text = "".join(o.text for o in outputs[i])
            assert outputs[i][-1].finish_reason == "stop" and outputs[i][-1].stop_reason is None, text
            check(json.loads(text), SCHEMA)
        assert [t for o in outputs[free] for t in o.token_ids] == generate(
            model, [prompts[0]], max_new_tokens=20, max_length=S, speculative=EAGLE
        ).tokens[0]
        if name == "eagle":
            for i in ids:
                metrics = outputs[i][-1].metrics
                assert sum(o.num_accepted for o in outputs[i]) == metrics.num_accepted
                assert metrics.num_accepted <= metrics.num_drafts
            accepted = sum(outputs[i][-1].metrics.num_accepted for i in ids)
            steps = sum(outputs[i][-1].metrics.num_steps for i in ids)
            assert accepted / steps > 1.0  # the grammar's forced tokens as drafts (`propose`); without: ~0.1
    assert results["eagle"] == results["plain"]


def test_sampled_structured_output_validates(engines):
    """Sampled rows (temperature 0.9, distinct seeds) under eagle: every output still parses and validates
    (the residual and bonus samples come from the masked target), and they differ from one another."""
    _, tokenizer, built, _ = engines
    engine = built["eagle"]
    prompt = tokenizer.encode(TEXTS[0]).ids
    ids = [
        engine.add_request(
            prompt, max_tokens=150, response_format=FORMAT, sampling=SamplingParams(temperature=0.9, seed=seed)
        )
        for seed in range(4)
    ]
    outputs = drain(engine)
    texts = ["".join(o.text for o in outputs[i]) for i in ids]
    for text in texts:
        check(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1


def test_formats_the_engine_cannot_serve_are_refused_by_name(engines):
    model, tokenizer, built, _ = engines
    engine = built["plain"]
    prompt = tokenizer.encode(TEXTS[1]).ids
    bad = [
        ({"type": "xml"}, "response_format.type must be one of"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema is required"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 3}}}, "response_format"),
    ]
    for response_format, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, max_tokens=8, response_format=response_format)
    with pytest.raises(ValueError, match="min_tokens cannot be combined with response_format"):
        engine.add_request(prompt, max_tokens=8, response_format=FORMAT, sampling=SamplingParams(min_tokens=2))
    assert engine.num_waiting == 0 and not engine.has_unfinished()
    text = engine.add_request(prompt, max_tokens=8, response_format={"type": "text"})  # no grammar: plain text
    assert [t for o in drain(engine)[text] for t in o.token_ids] == generate(
        model, [prompt], max_new_tokens=8, max_length=S
    ).tokens[0]
    assert np.all(np.asarray(engine.rows.state.done))


def test_replaced_drafts_are_verified_with_a_one_hot_q():
    """`replace_drafts`: tokens replaced where the host proposes one (>= 0), their q one-hot (a deterministic
    proposal, accepted with probability p(d)); the drafter's drafts and q elsewhere."""
    import jax.numpy as jnp

    from mtp_jax.decode.drafters import DraftState
    from mtp_jax.decode.step import replace_drafts

    q = jnp.full((2, 3, 5), 0.2)
    draft = DraftState(tokens=jnp.asarray([[1, 2, 3], [4, 0, 1]]), probs=q, caches=(), hidden_window=q, oracle_tokens=q)
    out = replace_drafts(draft, jnp.asarray([[-1, 4, -1], [0, 0, 0]]))
    np.testing.assert_array_equal(out.tokens, [[1, 4, 3], [0, 0, 0]])
    np.testing.assert_array_equal(out.probs[0, 1], np.eye(5)[4])
    np.testing.assert_array_equal(out.probs[0, 0], q[0, 0])
    np.testing.assert_array_equal(out.probs[1], np.eye(5)[[0, 0, 0]])


def test_structured_outputs_regex_choice_and_grammar(engines):
    """vLLM's `structured_outputs` under eagle: a regex's full match, one of the choices, a Lark grammar's
    sentence, a JSON schema given as text; more than one kind, or with response_format, is refused by name."""
    _, tokenizer, built, _ = engines
    engine = built["eagle"]
    prompt = tokenizer.encode(TEXTS[0]).ids
    constraints = {
        "regex": {"regex": "[a-z]{2,5}_[0-9]{2}"},
        "choice": {"choice": ["yes", "no", "maybe"]},
        "grammar": {"grammar": 'start: "x = " NUM ";"\nNUM: /[0-9]{1,3}/'},
        "json": {
            "json": json.dumps(
                {
                    "type": "object",
                    "properties": {"a": {"type": "boolean"}},
                    "required": ["a"],
                    "additionalProperties": False,
                }
            )
        },
    }
    ids = {name: engine.add_request(prompt, max_tokens=24, structured_outputs=c) for name, c in constraints.items()}
    outputs = drain(engine)
    texts = {name: "".join(o.text for o in outputs[i]) for name, i in ids.items()}
    assert re.fullmatch("[a-z]{2,5}_[0-9]{2}", texts["regex"]), texts
    assert texts["choice"] in ("yes", "no", "maybe") and re.fullmatch(r"x = [0-9]{1,3};", texts["grammar"]), texts
    assert isinstance(json.loads(texts["json"])["a"], bool)
    for bad, message in (
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"xml": "a"}, "unknown: xml"),
        ({"regex": "("}, "structured_outputs: invalid regex"),
    ):
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, max_tokens=4, structured_outputs=bad)
    with pytest.raises(ValueError, match="structured_outputs cannot be combined with response_format"):
        engine.add_request(prompt, max_tokens=4, structured_outputs={"regex": "a"}, response_format=FORMAT)
