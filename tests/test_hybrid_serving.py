"""`mtp_jax.serving.ServingEngine` on a Qwen3.5-shaped hybrid model (`speculative_helpers.HYBRID`: Gated
DeltaNet layers whose cache is a per-row recurrent state): concurrent greedy requests, prefilled in chunks and
admitted into slots freed by earlier requests while others are mid-generation, each get exactly the tokens
they get alone (`generate` on the request alone), plain and with eagle K=2.

The model has random weights (std 0.3, the `hybrid_models` fixture) so that the recurrent memory decides
tokens (`test_hybrid_speculative.test_random_weights_tokens_depend_on_the_recurrent_memory`): a request that
inherited anything of a slot's previous recurrent state, or of another row's, would decode differently. Every
reference token is decided by a top-1/top-2 logit margin > 1e-3, far above the < 1e-4 by which chunked prefill,
verification or another batch size move a logit of these models, so the token comparison is exact by construction.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import spec

from mtp_jax.decode.generation import generate
from mtp_jax.layers.gated_deltanet import RECURRENT_MAX_TOKENS
from mtp_jax.serving import ServingEngine

S = 64
MAX_BATCH = 2
CHUNK = 36  # > RECURRENT_MAX_TOKENS: a full prefill chunk takes the Gated DeltaNet's chunked form
PLAN = [  # (engine step at which it arrives, prompt length, max_tokens)
    (0, 5, 14),  # prefilled whole at step 0 (no slot decodes yet)
    (0, 45, 12),  # two chunks (36 + 9 tokens), at steps 1 and 2, while request 0 decodes
    (0, 12, 10),  # waits for a freed slot
    (3, 40, 16),  # waits; then two chunks into a freed slot while the other slot decodes
    (6, 3, 20),
    (9, 14, 8),
]


@nnx.jit
def _logits(model, tokens):
    return model.forward_full(tokens)[0]


def margins(model, sequence: list[int], prompt_length: int) -> np.ndarray:
    """Top-1 minus top-2 logit at each position that predicted a generated token (one padded forward)."""
    padded = np.zeros((1, S), np.int32)
    padded[0, : len(sequence)] = sequence
    logits = np.asarray(_logits(model, jnp.asarray(padded)))[0, prompt_length - 1 : len(sequence) - 1]
    top = np.sort(logits, axis=-1)
    return top[:, -1] - top[:, -2]


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "eagle2"])
def test_concurrent_requests_on_a_hybrid_model_equal_alone(hybrid_models, k):
    """Six requests on two slots (prompts of 3 to 45 tokens, the long ones prefilled in two chunks, each chunk
    36 wide: the Gated DeltaNet's chunked form, the last chunk's padding masked by `advance`), arriving at
    steps 0, 3, 6 and 9: requests wait, then take a slot another request freed while the other slot is
    mid-generation (at least three of them, checked below). Each request's tokens equal `generate` on it alone,
    every output but the last is unfinished and the last says "length"."""
    model = hybrid_models["dense"]["random"]
    sp = None if k == 0 else spec("eagle", k)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 8, n).tolist() for _, n, _ in PLAN]
    assert CHUNK > RECURRENT_MAX_TOKENS and max(len(p) for p in prompts) > CHUNK
    engine = ServingEngine(model, sp, max_batch=MAX_BATCH, max_length=S, prefill_chunk=CHUNK)
    ids, outputs, steps_of, step = {}, {}, {}, 0
    while len(ids) < len(PLAN) or engine.has_unfinished():
        for i, (arrival, _, max_tokens) in enumerate(PLAN):
            if arrival == step:
                ids[engine.add_request(prompts[i], max_tokens=max_tokens, ignore_eos=True)] = i
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            steps_of.setdefault(out.request_id, []).append(step)
        assert engine.num_running <= MAX_BATCH + 1  # the slots and the one request prefilling
        step += 1
    assert engine.num_running == engine.num_waiting == 0

    # Six requests through two slots: slots were reused; some request got its first token while another
    # one, admitted before it, still had tokens to come (admitted mid-generation).
    first = {rid: s[0] for rid, s in steps_of.items()}
    last = {rid: s[-1] for rid, s in steps_of.items()}
    mid_generation = [
        rid for rid in ids if any(first[o] < first[rid] < last[o] for o in ids if o != rid and ids[o] < ids[rid])
    ]
    assert len(mid_generation) >= 3, (first, last)

    for rid, i in ids.items():
        expected = generate(
            model, [prompts[i]], max_new_tokens=PLAN[i][2], max_length=S, speculative=sp, stop_tokens=[]
        ).tokens[0]
        assert margins(model, prompts[i] + expected, len(prompts[i])).min() > 1e-3, i
        got = outputs[rid]
        assert [t for out in got for t in out.token_ids] == expected, i
        assert [out.finish_reason for out in got] == [None] * (len(got) - 1) + ["length"]
        assert got[-1].completion_tokens == PLAN[i][2]
