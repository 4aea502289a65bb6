"""`mtp_jax.serving.ServingEngine`: continuous batching gives each request exactly what it gets alone.

Oracles: `mtp_jax.decode.generation` on the request alone (greedy: token for token; sampled: the same seed
gives the same tokens, the draws being keyed by row seed and position only); for acceptance
patterns, the "oracle" drafter replaying the greedy sequence with chosen tokens corrupted, so each
step accepts exactly the number of drafts the test picks. Greedy references are checked to decide
every token by a top-1/top-2 logit margin > 1e-3, far above the ~1e-6 by which a chunked prefill or
another batch size can move a logit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import SamplingParams, SpeculativeConfig, generate, load_pretrained
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.serving import QueueFull, ServingEngine

K = 3
S = 192
EAGLE = SpeculativeConfig(method="eagle", num_speculative_tokens=K)
ORACLE = SpeculativeConfig(method="oracle", num_speculative_tokens=K)
TEXTS = [
    "import os\n",
    "class Foo:\n    def __init__(self",
    "x = [",
    "from typing import",
    "def main(argv):\n    parser = argparse.ArgumentParser(description='x')\n    for i in range(10):\n"
    "        print(i)\n" * 3,
    "@dataclass\nclass",
]


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load_pretrained()
    prompts = [tokenizer.encode(t).ids for t in TEXTS]
    assert max(len(p) for p in prompts) > 64  # the long one takes several prefill chunks
    return model, tokenizer, prompts


def margins(model, sequence: list[int], prompt_length: int) -> np.ndarray:
    """Top-1 minus top-2 logit of the model at each position that predicted a generated token."""
    tokens = jnp.asarray([sequence])
    logits = model(tokens, jnp.arange(len(sequence))[None, :], model.init_cache(1, len(sequence)))[0][0]
    top = jnp.sort(logits[prompt_length - 1 : len(sequence) - 1], axis=-1)
    return np.asarray(top[:, -1] - top[:, -2])


def alone(model, prompt, max_tokens, spec=EAGLE, sampling=None, stop_tokens=None) -> list[int]:
    return generate(
        model,
        [prompt],
        max_new_tokens=max_tokens,
        max_length=S,
        speculative=spec,
        sampling=sampling,
        stop_tokens=stop_tokens,
    ).tokens[0]


def drain(engine: ServingEngine) -> dict[str, list]:
    """Steps to the end; every request's outputs in order."""
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


@pytest.mark.parametrize(
    "spec", [EAGLE, SpeculativeConfig(method="vanilla", num_speculative_tokens=K)], ids=["eagle", "vanilla"]
)
def test_chunked_prefill_equals_whole_prefill(demo, spec):
    """Prefilling a prompt in chunks fills the main and MTP caches and drafts as one prefill does."""
    model, _, prompts = demo
    prompt = prompts[4]
    engine = DecodeEngine(model, spec)
    whole, padded = engine.init_state([prompt], max_new_tokens=8, max_length=S)
    whole = engine.prefill(whole, padded)
    chunked, _ = engine.init_state([prompt], max_new_tokens=8, max_length=S)
    size = 16  # > K + 1; the last chunk is padded
    for start in range(0, len(prompt), size):
        chunk = np.zeros((1, size), np.int32)
        chunk[0, : len(prompt[start : start + size])] = prompt[start : start + size]
        chunked = engine.prefill(
            chunked, jnp.asarray(chunk), jnp.asarray([start], jnp.int32), final=start + size >= len(prompt)
        )
    live = len(prompt)  # committed P + 1: caches hold positions 0 .. P - 1
    assert int(chunked.lengths[0]) == int(whole.lengths[0]) == live + 1
    np.testing.assert_array_equal(chunked.tokens[0, : live + 1], whole.tokens[0, : live + 1])
    np.testing.assert_array_equal(chunked.draft.tokens, whole.draft.tokens)
    for a, b in zip(
        jax.tree.leaves((chunked.cache, chunked.draft.caches)),
        jax.tree.leaves((whole.cache, whole.draft.caches)),
        strict=True,
    ):
        np.testing.assert_allclose(a[0, :live], b[0, :live], rtol=1e-4, atol=1e-5)
    if spec.method == "vanilla":
        np.testing.assert_allclose(chunked.draft.hidden_window, whole.draft.hidden_window, rtol=1e-4, atol=1e-5)


def test_concurrent_requests_equal_alone_and_never_recompile(demo):
    """Different prompts, lengths, parameters and arrival times: each request gets what it gets alone."""
    model, tokenizer, prompts = demo
    engine = ServingEngine(model, EAGLE, tokenizer=tokenizer, max_batch=3, max_length=S, prefill_chunk=32)
    engine.warm_up()
    compiled = engine.compiled_counts()
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    plan = [  # (step at which it arrives, prompt index, max_tokens, sampling)
        (0, 0, 24, None),
        (0, 4, 30, None),
        (0, 1, 12, sampled),
        (2, 2, 40, None),
        (3, 3, 8, None),
        (5, 5, 20, SamplingParams(temperature=1.0, top_k=20, seed=3)),
        (9, 0, 16, sampled),
        (9, 4, 1, None),
    ]
    ids, outputs, step = {}, {}, 0
    while len(ids) < len(plan) or engine.has_unfinished():
        for arrival, i, max_tokens, sampling in plan:
            if arrival == step:
                ids[engine.add_request(prompts[i], max_tokens=max_tokens, sampling=sampling)] = (
                    i,
                    max_tokens,
                    sampling,
                )
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
        assert engine.num_running <= 3 + 1  # the slots and the one request prefilling
    assert engine.compiled_counts() == compiled  # (before the references below compile their own)
    assert engine.num_running == engine.num_waiting == 0 and engine.kv_cache_usage == 0
    for rid, (i, max_tokens, sampling) in ids.items():
        expected = alone(model, prompts[i], max_tokens, sampling=sampling)
        if sampling is None:
            assert margins(model, prompts[i] + expected, len(prompts[i])).min() > 1e-3
        got = outputs[rid]
        assert tokens_of(got) == expected, rid
        assert [o.finish_reason for o in got[:-1]] == [None] * (len(got) - 1)
        assert got[-1].finish_reason == ("stop" if expected[-1] in model.config.eos_token_ids else "length")
        assert got[-1].completion_tokens == len(expected)
        assert "".join(o.text for o in got) == tokenizer.decode(
            expected[:-1] if got[-1].finish_reason == "stop" else expected
        )


def oracle_sequence(reference: list[int], prompt_length: int, pattern: list[int]) -> list[int]:
    """`reference` (prompt first) with tokens corrupted so that step i accepts exactly pattern[i] drafts."""
    sequence = list(reference)
    length = prompt_length + 1  # the prefill commits the first token
    for accepted in pattern:
        if accepted < K:
            sequence[length + accepted] = (sequence[length + accepted] + 1) % 4096  # draft accepted+1 is wrong
        length += accepted + 1
    return sequence


def test_committed_count_equals_tokens_received_for_each_acceptance_pattern(demo):
    """Per step, the count the scheduler reads (1 .. K+1) is what the request received; rows sharing
    the batch with other acceptance patterns do not change it."""
    model, _, prompts = demo
    patterns = [[0, 1, 2, 3, 3, 0, 2, 1], [3, 3, 0, 0, 1, 2, 3, 1], [2, 0, 3, 1, 0, 3, 2, 2]]
    engine = ServingEngine(model, ORACLE, max_batch=3, max_length=S, prefill_chunk=32)
    ids = {}
    for prompt, pattern in zip(prompts[:3], patterns, strict=True):
        max_tokens = 1 + sum(a + 1 for a in pattern)
        reference = prompt + alone(model, prompt, max_tokens, spec=None, stop_tokens=[])
        ids[
            engine.add_request(
                prompt,
                max_tokens=max_tokens,
                ignore_eos=True,
                oracle_tokens=oracle_sequence(reference, len(prompt), pattern),
            )
        ] = (reference[len(prompt) :], pattern)
    outputs = drain(engine)
    for rid, (expected, pattern) in ids.items():
        got = outputs[rid]
        assert tokens_of(got) == expected
        first, steps = got[0], got[1:]
        assert (first.num_committed, len(first.token_ids), first.num_accepted) == (1, 1, 0)
        assert [o.num_committed for o in steps] == [a + 1 for a in pattern]
        assert [len(o.token_ids) for o in steps] == [a + 1 for a in pattern]
        assert [o.num_accepted for o in steps] == pattern
        metrics = got[-1].metrics
        assert metrics.committed_per_step == [1] + [a + 1 for a in pattern]
        assert (metrics.num_steps, metrics.num_drafts, metrics.num_accepted) == (
            len(pattern),
            K * len(pattern),
            sum(pattern),
        )
        assert metrics.accepted_per_position == [sum(a > j for a in pattern) for j in range(K)]
        assert got[-1].finish_reason == "length"


def full_acceptance(model, engine, prompt, max_tokens, **request):
    reference = prompt + alone(model, prompt, max_tokens + 8, spec=None, stop_tokens=[])
    rid = engine.add_request(prompt, max_tokens=max_tokens, oracle_tokens=reference, **request)
    return rid, reference[len(prompt) :]


def first_at(sequence: list[int], index: int) -> bool:
    return sequence.index(sequence[index]) == index


def test_stops_inside_an_accepted_block(demo):
    """Every draft accepted (K + 1 = 4 tokens a step): a cap, a stop token and a stop string each
    met at the second token of a block end the output exactly there; the stop string does not within
    min_tokens."""
    model, tokenizer, prompts = demo
    engine = ServingEngine(model, ORACLE, tokenizer=tokenizer, max_batch=2, max_length=S, prefill_chunk=32)
    prompt = prompts[2]  # its greedy continuation does not repeat itself at once
    # generated token 0 comes from the prefill; step 1 commits tokens 1..4, step 2 tokens 5..8.
    cap, expected = full_acceptance(model, engine, prompt, 6, ignore_eos=True)
    stop_index = next(i for i in (2, 6, 1, 3, 5, 7) if first_at(expected, i))  # inside a block, first there
    stop_token = expected[stop_index]
    stop_id, _ = full_acceptance(model, engine, prompt, 40, stop_token_ids=[stop_token], ignore_eos=True)
    outputs = drain(engine)

    got = outputs[cap]
    assert [o.num_committed for o in got] == [1, 4, 1] and tokens_of(got) == expected[:6]
    assert got[-1].finish_reason == "length"
    got = outputs[stop_id]
    assert tokens_of(got) == expected[: stop_index + 1]
    assert got[-1].num_committed == stop_index - (1 if stop_index < 5 else 5) + 1
    assert (got[-1].finish_reason, got[-1].stop_reason) == ("stop", stop_token)
    assert "".join(o.text for o in got) == tokenizer.decode(expected[:stop_index])  # the stop token's text is cut

    # A stop string completed by generated token 6 (second of step 2's block), first seen there.
    text = [tokenizer.decode(expected[:n]) for n in range(len(expected) + 1)]
    for end in (6, 2, 7, 3, 5, 1):
        start = len(text[end])  # the text that token `end` adds, plus what precedes it in its token
        stop = text[end + 1][max(start - 2, 0) :]
        if (
            stop
            and text[-1].find(stop) == len(text[end + 1]) - len(stop)
            and all(stop not in t for t in text[: end + 1])
        ):
            break
    else:
        pytest.fail("no usable stop string in the reference")
    rid, _ = full_acceptance(model, engine, prompt, 40, stop=[stop], ignore_eos=True)
    after, _ = full_acceptance(model, engine, prompts[3], 10, ignore_eos=True)  # reuses the freed slot
    outputs = drain(engine)
    got = outputs[rid]
    assert tokens_of(got) == expected[: end + 1]
    assert got[-1].num_committed == 4 and len(got[-1].token_ids) == end - (1 if end < 5 else 5) + 1 < 4
    assert (got[-1].finish_reason, got[-1].stop_reason) == ("stop", stop)
    assert got[-1].completion_tokens == end + 1
    assert "".join(o.text for o in got) == text[-1][: text[-1].find(stop)]
    assert tokens_of(outputs[after]) == alone(model, prompts[3], 10, spec=None, stop_tokens=[])
    assert engine.num_running == 0

    # The same stop string within min_tokens (vLLM's: stop strings are not matched before it): no stop there.
    sampling = SamplingParams(min_tokens=end + 2)
    rid, reference = full_acceptance(model, engine, prompt, 40, stop=[stop], ignore_eos=True, sampling=sampling)
    got = tokens_of(drain(engine)[rid])
    assert len(got) > end + 1 and got == reference[: len(got)]


def test_abort_frees_the_slot_and_leaves_the_others(demo):
    model, tokenizer, prompts = demo
    engine = ServingEngine(model, EAGLE, tokenizer=tokenizer, max_batch=2, max_length=S, prefill_chunk=32)
    keep = engine.add_request(prompts[0], max_tokens=40, ignore_eos=True)
    cancel = engine.add_request(prompts[2], max_tokens=40, ignore_eos=True)
    waiting = engine.add_request(prompts[3], max_tokens=20, ignore_eos=True)  # no free slot yet
    outputs: dict[str, list] = {}
    for _ in range(4):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert engine.abort(cancel) and not engine.abort("no-such-request")
    step = engine.step()
    aborted = [o for o in step if o.request_id == cancel]
    assert len(aborted) == 1 and aborted[0].finish_reason == "abort" and aborted[0].token_ids == []
    for out in step:
        outputs.setdefault(out.request_id, []).append(out)
    assert waiting in outputs  # the freed slot went to the waiting request in that same step
    outputs_rest = drain(engine)
    for rid, outs in outputs_rest.items():
        outputs.setdefault(rid, []).extend(outs)
    assert tokens_of(outputs[keep]) == alone(model, prompts[0], 40, stop_tokens=[])
    assert tokens_of(outputs[waiting]) == alone(model, prompts[3], 20, stop_tokens=[])
    assert not engine.abort(cancel)  # finished requests cannot be aborted twice


def test_queue_and_argument_errors(demo):
    model, _, prompts = demo
    engine = ServingEngine(model, EAGLE, max_batch=1, max_length=64, prefill_chunk=16, max_queue=2)
    engine.add_request(prompts[0], max_tokens=4)
    engine.add_request(prompts[0], max_tokens=4, request_id="mine")
    with pytest.raises(QueueFull, match="max_queue=2"):
        engine.add_request(prompts[0], max_tokens=4)
    engine.step()  # one leaves the queue for the slot
    with pytest.raises(ValueError, match="request_id 'mine' is already in use"):
        engine.add_request(prompts[0], max_tokens=4, request_id="mine")
    with pytest.raises(ValueError, match="max_tokens=62 does not fit"):
        engine.add_request(prompts[0], max_tokens=62)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.add_request(prompts[0], max_tokens=4, stop=["\n"])
    with pytest.raises(TypeError, match="stop must be a list of strings"):
        engine.add_request(prompts[0], max_tokens=4, stop="\n")
    with pytest.raises(ValueError, match="oracle_tokens is required"):
        engine.add_request(prompts[0], max_tokens=4, oracle_tokens=[1, 2])
    with pytest.raises(ValueError, match="at most 16 stop tokens"):
        engine.add_request(prompts[0], max_tokens=4, stop_token_ids=range(1, 17))
    with pytest.raises(TypeError, match="prompt 0 is a str"):
        engine.add_request("import os", max_tokens=4)
    with pytest.raises(ValueError, match="prefill_chunk must be an int >= 4"):
        ServingEngine(model, EAGLE, max_batch=1, max_length=64, prefill_chunk=3)
    with pytest.raises(ValueError, match="max_length=4096 exceeds"):
        ServingEngine(model, None, max_length=4096)
    with pytest.raises(ValueError, match="max_queue must be an int >= 1"):
        ServingEngine(model, None, max_length=64, max_queue=0)


def test_warm_up_edges_bypass_the_queue_and_stats(demo):
    """warm_up works for the smallest slots and queue, and reports nothing to the stats listener."""

    class Recorder:
        calls = 0

        def on_step(self, engine, outputs):
            self.calls += 1

        def on_finished(self, output):
            self.calls += 1

    model, _, prompts = demo
    recorder = Recorder()
    engine = ServingEngine(model, EAGLE, max_batch=1, max_length=4, prefill_chunk=4, max_queue=1, stats=recorder)
    engine.warm_up()
    assert recorder.calls == 0 and not engine.has_unfinished() and engine.max_queue == 1
    rid = engine.add_request([5], max_tokens=3, ignore_eos=True)
    assert rid == "req-0"  # warm-up requests take no ids from the counter
    outputs = drain(engine)
    assert (
        tokens_of(outputs[rid])
        == generate(model, [[5]], max_new_tokens=3, max_length=4, speculative=EAGLE, stop_tokens=[]).tokens[0]
    )
    assert recorder.calls > 0
    tiny = ServingEngine(model, None, max_batch=1, max_length=2, prefill_chunk=1)
    tiny.warm_up()  # one prompt token and one generated: nothing to decode, still no error
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.add_request([5], max_tokens=1)
        engine.warm_up()


def test_serving_example_runs(capsys):
    """examples/serving.py: staggered requests over fewer slots, each checked against `generate` alone."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "serving.py"
    spec = importlib.util.spec_from_file_location("serving_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--max-tokens", "8"])
    assert "every request got exactly what generate gives it alone" in capsys.readouterr().out


def test_top_logprobs_are_the_models_log_softmax_at_each_position(demo):
    """`add_request(logprobs=n)`: for every token, from the prefill's and from accepted drafts, bonus and
    residual tokens alike, the n most likely tokens equal the top n of a log-softmax of a full forward
    over the sequence, the first of them the greedy token with its logprob; a request asking for none
    gets none, and more than `max_logprobs` is refused."""
    model, tokenizer, prompts = demo
    engine = ServingEngine(
        model, EAGLE, tokenizer=tokenizer, max_batch=2, max_length=S, max_logprobs=5, page_size=16,
        page_buckets=(S // 16,),
    )  # fmt: skip
    asks = {
        engine.add_request(prompts[0], max_tokens=24, logprobs=3): 3,
        engine.add_request(prompts[2], max_tokens=24): 0,
    }
    got = {i: ([], [], []) for i in asks}
    accepted = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens, logprobs, tops = got[out.request_id]
            tokens += out.token_ids
            logprobs += out.logprobs
            tops += out.top_logprobs
            accepted += out.num_accepted
    assert accepted > 5  # tokens from accepted drafts are among those checked
    for (rid, n), prompt in zip(asks.items(), (prompts[0], prompts[2]), strict=True):
        tokens, logprobs, tops = got[rid]
        if not n:
            assert tops == []
            continue
        sequence = prompt + tokens
        logits = model(jnp.asarray([sequence]), jnp.arange(len(sequence))[None, :], model.init_cache(1, len(sequence)))[
            0
        ][0]
        want = jax.nn.log_softmax(logits[len(prompt) - 1 : len(sequence) - 1].astype(jnp.float32), axis=-1)
        values, ids = jax.lax.top_k(want, n)
        assert len(tops) == len(tokens) == 24
        np.testing.assert_array_equal([[t for t, _ in top] for top in tops], np.asarray(ids))
        np.testing.assert_allclose([[v for _, v in top] for top in tops], np.asarray(values), atol=1e-4)
        assert [top[0][0] for top in tops] == tokens  # greedy: the most likely token
        np.testing.assert_allclose([top[0][1] for top in tops], logprobs, atol=1e-6)
    with pytest.raises(ValueError, match=r"logprobs must be an int in 0 \.\. 5"):
        engine.add_request(prompts[0], max_tokens=4, logprobs=6)
