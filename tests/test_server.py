"""The OpenAI-compatible server (`mtp_jax.serving.server`, `async_engine`, `protocol`, `chat_template`,
`mtp-jax serve`): the official `openai` client against a real uvicorn server over the demo model.

One module fixture loads the demo model, builds one eagle K=3 engine (4 slots of 256 tokens,
prefill chunks of 32), warms it up and serves it on a free port. Expected values come from
`mtp_jax.decode.generation` (the same speculative config) or from the same request sent alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import openai  # the official client, a test dependency (pyproject's `test` extra)
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from test_async_engine import wait_for

from mtp_jax import SamplingParams, generate
from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR, load_pretrained
from mtp_jax.cli import build_parser, main
from mtp_jax.cli.serve import run_serve
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.serving import RequestOutput, ServingEngine
from mtp_jax.serving.async_engine import AsyncEngine
from mtp_jax.serving.chat_template import ChatTemplate, ChatTemplateArgumentError, plain_prompt
from mtp_jax.serving.limits import PromptLimits, RequestError, longest_token_chars, short_json
from mtp_jax.serving.prometheus import PrometheusMetrics
from mtp_jax.serving.protocol import (
    IGNORED_FIELDS,
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
    parse_request,
)
from mtp_jax.serving.server import DEFAULT_MAX_REQUEST_BYTES, bind, build_app

SPEC = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
MAX_LENGTH = 256
MAX_LOGPROBS = 5
MODEL = "demo"
PROMPT = "import os\n\n\ndef "
EOS_AT_ONCE = "if __name__ == '__main__':\n    main()\n"  # the demo model's greedy output is EOS alone


class RecordingEngine(ServingEngine):
    """A ServingEngine that keeps every output it hands out (tests read what it did, aborts included)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outputs: list[RequestOutput] = []
        self.busy_slots: list[int] = []  # per step, the slots held by requests after it

    def step(self):
        outputs = super().step()
        self.outputs.extend(outputs)
        self.busy_slots.append(sum(r is not None for r in self._slots))
        return outputs


@contextlib.contextmanager
def running(app):
    """Serves `app` with uvicorn in a background thread on a free 127.0.0.1 port; yields the base URL."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        gc.collect()  # async generators of streams that clients left, finalized while their loop still runs
        time.sleep(0.1)
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive()


@dataclasses.dataclass
class Served:
    model: object
    tokenizer: object
    engine: RecordingEngine
    async_engine: AsyncEngine
    url: str
    client: openai.OpenAI
    warm_counts: dict


@pytest.fixture(scope="module")
def served():
    model, tokenizer = load_pretrained()
    metrics = PrometheusMetrics(MODEL, SPEC.num_speculative_tokens, max_model_len=MAX_LENGTH)
    engine = RecordingEngine(
        model, SPEC, tokenizer=tokenizer, max_batch=4, max_length=MAX_LENGTH, prefill_chunk=32, stats=metrics,
        max_logprobs=MAX_LOGPROBS,
    )  # fmt: skip
    engine.warm_up()
    warm_counts = engine.compiled_counts()
    async_engine = AsyncEngine(engine)
    async_engine.start()
    with running(build_app(async_engine, tokenizer, MODEL, metrics)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        yield Served(model, tokenizer, engine, async_engine, url, client, warm_counts)
    async_engine.shutdown()
    assert not async_engine.is_running


def ids_of(served, text: str) -> list[int]:
    return served.tokenizer.encode(text).ids


_GREEDY: dict = {}


def greedy_reference(served, prompt: str, max_tokens: int):
    """`generate`'s greedy tokens and logprobs for `prompt` (cached): the server's expected output."""
    key = (prompt, max_tokens)
    if key not in _GREEDY:
        result = generate(
            served.model, [ids_of(served, prompt)], max_new_tokens=max_tokens, max_length=MAX_LENGTH, speculative=SPEC
        )
        _GREEDY[key] = result.tokens[0], result.logprobs[0], result.finish_reasons[0]
    return _GREEDY[key]


def request(url: str, method: str, path: str, body=None) -> tuple[int, dict | str, str]:
    """A raw HTTP request (stdlib only): (status, the JSON body or the text, content type)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json"} if data is not None else {})
    response = conn.getresponse()
    payload, kind = response.read().decode(), response.getheader("content-type", "")
    conn.close()
    return response.status, (json.loads(payload) if "json" in kind else payload), kind


def complete(served, prompt, **kwargs):
    return served.client.completions.create(model=MODEL, prompt=prompt, **kwargs)


def completion_result(response) -> tuple[str, str, int, int]:
    choice = response.choices[0]
    return choice.text, choice.finish_reason, response.usage.prompt_tokens, response.usage.completion_tokens


def chat_result(response) -> tuple[str, str, int, int]:
    choice = response.choices[0]
    return choice.message.content, choice.finish_reason, response.usage.prompt_tokens, response.usage.completion_tokens


# ----------------------------------------------------------------------------------------------
# Completions against `generate`


@pytest.mark.parametrize("prompt", [PROMPT, EOS_AT_ONCE], ids=["length", "eos"])
def test_greedy_completion_matches_generate_plain_and_streamed(served, prompt):
    tokens, logprobs, reason = greedy_reference(served, prompt, 40)
    eos = served.model.config.eos_token_ids
    text = served.tokenizer.decode(tokens[:-1] if tokens[-1] in eos else tokens)
    expected_reason = "stop" if reason == "stop" else "length"
    assert (prompt == EOS_AT_ONCE) == (expected_reason == "stop")  # both finish reasons are exercised

    response = complete(served, prompt, max_tokens=40, temperature=0, logprobs=0)
    assert completion_result(response) == (text, expected_reason, len(ids_of(served, prompt)), len(tokens))
    assert response.object == "text_completion" and response.model == MODEL
    assert response.usage.total_tokens == len(ids_of(served, prompt)) + len(tokens)
    lp = response.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert len(lp.tokens) == len(tokens)

    chunks = list(
        complete(served, prompt, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "text_completion" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == expected_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert all(c.usage is None for c in chunks[:-1])


def test_top_logprobs_of_completions_and_chat(served):
    """Completions' logprobs=n and chat's top_logprobs=n: per token the n most likely tokens, most likely first;
    greedy, the first is the chosen token with its logprob (the engine's values are checked against a full
    forward in tests/test_serving_engine.py)."""
    tokens, logprobs, _ = greedy_reference(served, PROMPT, 40)
    lp = complete(served, PROMPT, max_tokens=40, temperature=0, logprobs=3).choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(logprobs, abs=1e-4) and len(lp.top_logprobs) == len(tokens)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        values = list(top.values())
        assert len(top) <= 3 and values == sorted(values, reverse=True)  # (two ids may share a text)
        assert top[token] == pytest.approx(chosen, abs=1e-6) and values[0] == pytest.approx(chosen, abs=1e-6)
    streamed = complete(served, PROMPT, max_tokens=40, temperature=0, logprobs=3, stream=True)
    assert [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs] == lp.top_logprobs

    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0, logprobs=True, top_logprobs=MAX_LOGPROBS
    )
    content = chat.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == MAX_LOGPROBS for c in content)
    for c in content:
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, pytest.approx(c.logprob, abs=1e-6))
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    plain = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=20, temperature=0, logprobs=True
    )
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


def test_n_choices_are_seeded_samples_and_echo_returns_the_prompt(served):
    """n choices: choice i samples with seed + i (choice 0 is the request with n = 1), so they differ and
    repeat; usage counts the prompt once and every choice's tokens; streamed chunks carry each choice's
    index. Several prompts: n choices each, in prompt order, each as the prompt alone. echo: the prompt's
    text first."""
    sampled = dict(max_tokens=16, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    three = complete(served, PROMPT, n=3, **sampled)
    texts = [c.text for c in three.choices]
    assert [c.index for c in three.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert [c.text for c in complete(served, PROMPT, n=3, **sampled).choices] == texts
    assert complete(served, PROMPT, **sampled).choices[0].text == texts[0]
    assert complete(served, PROMPT, **{**sampled, "seed": 8}).choices[0].text == texts[1]
    assert three.usage.completion_tokens == 3 * 16 and three.usage.prompt_tokens == len(ids_of(served, PROMPT))
    streamed = {0: "", 1: "", 2: ""}
    for chunk in complete(served, PROMPT, n=3, stream=True, **sampled):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert list(streamed.values()) == texts

    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_completion_tokens=12, temperature=1.0, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content != chat.choices[
        1
    ].message.content
    deltas = {0: "", 1: ""}
    for chunk in served.client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, max_completion_tokens=12, temperature=1.0, seed=3, stream=True
    ):
        deltas[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert list(deltas.values()) == [c.message.content for c in chat.choices]

    batch = complete(served, [PROMPT, ids_of(served, EOS_AT_ONCE), "x = "], n=2, **sampled)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices[:2]] == texts[:2]  # prompt 0's two choices: seeds 7 and 8
    for i, prompt in enumerate((EOS_AT_ONCE, "x = ")):
        alone = [c.text for c in complete(served, prompt, n=2, **sampled).choices]
        assert [c.text for c in batch.choices[2 + 2 * i : 4 + 2 * i]] == alone
    prompt_tokens = sum(len(ids_of(served, p)) for p in (PROMPT, EOS_AT_ONCE, "x = "))
    assert (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (prompt_tokens, 6 * 16)

    plain = complete(served, PROMPT, max_tokens=8, temperature=0).choices[0].text
    assert complete(served, PROMPT, max_tokens=8, temperature=0, echo=True).choices[0].text == PROMPT + plain
    ids = ids_of(served, PROMPT)
    echoed = complete(served, ids, max_tokens=8, temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in echoed) == served.tokenizer.decode(ids) + plain


def test_logit_bias_forces_and_forbids_tokens(served):
    """logit_bias on completions and chat (token id strings -> [-100, 100]): +100 makes a token the whole
    output, -100 on the greedy output's first token changes it; bad keys and values are a 400 naming it."""
    tokens, _, _ = greedy_reference(served, PROMPT, 40)
    x = ids_of(served, "x")[0]
    forced = complete(served, PROMPT, max_tokens=6, temperature=0, logit_bias={str(x): 100}, logprobs=0)
    assert forced.choices[0].text == served.tokenizer.decode([x] * 6)
    forbidden = complete(served, PROMPT, max_tokens=20, temperature=0, logit_bias={str(tokens[0]): -100}, logprobs=0)
    assert forbidden.choices[0].logprobs.tokens[0] != served.tokenizer.decode([tokens[0]])
    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=5, temperature=0, logit_bias={str(x): 100}
    )
    assert chat.choices[0].message.content == served.tokenizer.decode([x] * 5)
    cases = [
        ({"abc": 1}, "token ids"),
        ({str(x): 101}, "[-100, 100]"),
        ({"99999999": 1}, "vocab_size"),
        ({"9" * 5000: 1}, "token ids"),
        ({"01": 5, "1": -5}, "token 1 is given twice"),
        ({str(i): 1 for i in range(301)}, "at most 300"),
    ]
    for bias, message in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            complete(served, PROMPT, max_tokens=2, logit_bias=bias)
        assert raised.value.param == "logit_bias" and message in raised.value.body["message"]


def test_special_tokens_and_stop_strings_in_the_text_when_asked(served):
    """skip_special_tokens=false keeps special tokens in the text (EOS forced by logit_bias with ignore_eos:
    not a stop here); include_stop_str_in_output=true ends the text after the stop string, not before."""
    eos = served.model.config.eos_token_ids[0]
    forced = dict(max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    kept = complete(served, PROMPT, **forced, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert kept.choices[0].text == served.tokenizer.decode([eos] * 3, skip_special_tokens=False) != ""
    assert complete(served, PROMPT, **forced, extra_body={"ignore_eos": True}).choices[0].text == ""
    tokens, _, _ = greedy_reference(served, PROMPT, 40)
    text = served.tokenizer.decode(tokens)
    stop = text[10:14]
    cut = complete(served, PROMPT, max_tokens=40, temperature=0, stop=[stop]).choices[0].text
    kept = (
        complete(
            served, PROMPT, max_tokens=40, temperature=0, stop=[stop], extra_body={"include_stop_str_in_output": True}
        )
        .choices[0]
        .text
    )
    assert cut == text[: text.find(stop)] and kept == cut + stop


def test_stop_string_cuts_the_text_and_counts_tokens_to_it(served):
    tokens, _, _ = greedy_reference(served, PROMPT, 40)
    text = served.tokenizer.decode(tokens)
    start = next(i for i in range(len(text) // 2, len(text)) if text[i].isalpha())
    stop = text[start : start + 4]
    cut = text.find(stop)
    assert 0 < cut <= start
    # The tokens up to and including the one that completed the stop string.
    needed = next(n for n in range(1, len(tokens) + 1) if stop in served.tokenizer.decode(tokens[:n]))

    response = complete(served, PROMPT, max_tokens=40, temperature=0, stop=[stop, "never appears"])
    assert (response.choices[0].text, response.usage.completion_tokens) == (text[:cut], needed)
    assert response.choices[0].finish_reason == "stop" and response.choices[0].stop_reason == stop
    streamed = list(complete(served, PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"

    # A stop token id ends the output there: counted, its text left out.
    token = tokens[7]
    at = tokens.index(token)
    response = complete(served, PROMPT, max_tokens=40, temperature=0, extra_body={"stop_token_ids": [token]})
    assert (response.choices[0].text, response.usage.completion_tokens) == (
        served.tokenizer.decode(tokens[:at]),
        at + 1,
    )
    assert response.choices[0].stop_reason == token


def test_stream_is_server_sent_events_ending_with_done(served):
    status, text, kind = request(
        served.url,
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True},
    )
    assert status == 200 and kind.startswith("text/event-stream")
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: {") for e in events[:-2])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    tokens, _, _ = greedy_reference(served, PROMPT, 40)
    assert "".join(c["choices"][0]["text"] for c in chunks) == served.tokenizer.decode(tokens[:6])


# ----------------------------------------------------------------------------------------------
# Continuous batching through HTTP


def test_concurrent_staggered_requests_match_each_alone_without_recompiling(served):
    code = [
        "import os\n",
        "def add(a, b):\n",
        "class Point:\n    def __init__(self, x, y):\n",
        "for i in range(",
        "    return self.",
        "# Copyright\n",
        "try:\n    import json\nexcept ImportError:\n",
        "with open(",
        "def __repr__(self):\n        return ",
        "x = [",
        "if not isinstance(value, int):\n    raise ",
        "from collections import ",
        "    @property\n    def name(self):\n",
        "while True:\n",
        "def main(argv=None):\n    parser = argparse.ArgumentParser(description='Process some files and "
        "print a summary of what they hold, line by line, with counts.')\n",
        "async def fetch(",
    ]
    assert any(len(ids_of(served, c)) > 32 for c in code)  # a prompt of several prefill chunks
    requests = []
    for i, prompt in enumerate(code):
        kwargs = {"max_tokens": 8 + 3 * i, "temperature": 0}
        if i in (3, 10):  # sampled, seeded: the same draws in any batch
            kwargs.update(temperature=0.9, top_p=0.95, seed=1000 + i, extra_body={"top_k": 50})
        requests.append((prompt, kwargs))

    alone = [completion_result(complete(served, p, **kw)) for p, kw in requests]
    counts = served.engine.compiled_counts()

    def send(i):
        time.sleep(0.03 * i)  # staggered: requests arrive while others prefill and decode
        return completion_result(complete(served, requests[i][0], **requests[i][1]))

    steps = len(served.engine.busy_slots)
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(send, range(len(requests))))
    assert together == alone
    assert max(served.engine.busy_slots[steps:]) == served.engine.max_batch  # they did share the batch
    assert {r[1] for r in alone} >= {"length"}
    assert served.engine.compiled_counts() == counts
    for name in ("_step_with_output_jit", "_insert_jit"):
        assert counts[name] == served.warm_counts[name]  # nothing compiled since warm-up
    assert not served.engine.has_unfinished()


def test_async_client_requests_are_served_concurrently(served):
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=120)
    tokens, _, _ = greedy_reference(served, PROMPT, 40)

    async def run():
        async with client:
            return await asyncio.gather(
                *[client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0) for _ in range(6)]
            )

    texts = {r.choices[0].text for r in asyncio.run(run())}
    assert texts == {served.tokenizer.decode(tokens)}


def test_client_gone_mid_stream_or_mid_request_frees_the_slot(served):
    others = [("def add(a, b):\n", 30), ("class Point:\n", 35)]
    alone = [completion_result(complete(served, p, max_tokens=n, temperature=0)) for p, n in others]
    before = len(served.engine.outputs)
    parts = urllib.parse.urlsplit(served.url)
    body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": 220, "ignore_eos": True, "temperature": 0}

    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
    chunks = []
    while len(chunks) < 3:
        line = response.readline().decode()
        if line.startswith("data: "):
            chunks.append(json.loads(line[len("data: ") :]))
    streamed_id = chunks[0]["id"]
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(lambda p=p, n=n: completion_result(complete(served, p, max_tokens=n, temperature=0)))
            for p, n in others
        ]
        time.sleep(0.05)
        response.close()
        conn.close()  # the client goes away mid-stream
        # and a non-streaming request whose client goes away before the answer
        plain = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        plain.request("POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        longest_other = max(n for _, n in others)
        wait_for(
            lambda: any(
                o.request_id != streamed_id and o.completion_tokens > longest_other
                for o in served.engine.outputs[before:]
            )
        )  # it is decoding
        plain.close()
        assert [f.result() for f in futures] == alone  # the others are unchanged

    def aborted():
        return [o for o in served.engine.outputs[before:] if o.finish_reason == "abort"]

    wait_for(lambda: len(aborted()) == 2 and not served.engine.has_unfinished())
    assert streamed_id in {o.request_id for o in aborted()}
    assert all(o.completion_tokens < body["max_tokens"] for o in aborted())
    assert served.engine.num_running == 0 and served.engine.num_waiting == 0


# ----------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b'{"model": "demo", "prompt": ', 400, None),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x"}, 400, "model"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 129}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 0, "stream": True}, 400, "echo"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", [7, 1.5]]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 129}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": ["a"] * 3, "n": 50}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": [7] * 300}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x = 1\n" * 100}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**40}, 400, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True, "top_p": 0}, 400, "top_p"),
        ("/v1/completions", [1, 2], 400, None),
        # limits and overflows: refused, naming the field, never clamped
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2**63}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1e308}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": float("nan")}, 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2**40}, 400, "top_k"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [1] * 17}, 400, "stop_token_ids"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 20_000}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": "y" * 20_000}, 400, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["\udc00"]}, 400, "stop"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "guided_json": {}}, 400, "guided_json"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}},
            400,
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**40},
            400,
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 200}, 400, "n"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 6},
            400,
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x = 1\n" * 100}]},
            400,
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"model": "other", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            404,
            "model",
        ),
    ],
)
def test_bad_requests_get_openai_errors(served, path, body, status, param):
    got, payload, kind = request(served.url, "POST", path, body)
    assert (got, kind) == (status, "application/json")
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert (param or "JSON") in error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert not served.engine.has_unfinished()


def test_openai_client_raises_its_errors(served):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        complete(served, "x", temperature=-0.5)
    with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
        served.client.completions.create(model="nope", prompt="x")


def test_full_queue_is_429_queue_full(served):
    engine = ServingEngine(served.model, None, tokenizer=served.tokenizer, max_batch=1, max_length=64, max_queue=1)
    engine.add_request([1, 2, 3], max_tokens=4)  # fills the queue: the engine is never started, it stays waiting
    async_engine = AsyncEngine(engine)
    with running(build_app(async_engine, served.tokenizer, MODEL)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as raised:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        assert raised.value.status_code == 429
        for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}):
            status, payload, _ = request(url, "POST", "/v1/completions", {"model": MODEL, **body})
            assert status == 429
            assert payload["error"]["code"] == "queue_full" and payload["error"]["type"] == "rate_limit_error"
            assert "max_queue=1" in payload["error"]["message"]
        status, payload, _ = request(url, "GET", "/health")
        assert status == 503 and payload["error"]["code"] == "engine_unavailable"
        assert request(url, "GET", "/metrics")[0] == 404  # no metrics given
    assert engine.num_waiting == 1  # the refused requests left nothing behind


def test_penalties_min_p_and_min_tokens_change_the_output_as_generate_does(served):
    """presence, frequency and repetition penalties (completions and chat, greedy under the server's eagle
    speculation) give `generate`'s tokens with the same `SamplingParams`, which differ from the unpenalized
    ones; min_tokens keeps EOS off (a prompt whose greedy output is EOS at once); min_p with a tiny value
    at temperature 1 is greedy; out-of-range values are a 400 naming the field."""
    penalties = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    expected = generate(
        served.model, [ids_of(served, PROMPT)], max_new_tokens=24, max_length=MAX_LENGTH,
        sampling=SamplingParams(**penalties), speculative=SPEC,
    ).tokens[0]  # fmt: skip
    assert expected != greedy_reference(served, PROMPT, 24)[0][: len(expected)]
    out = complete(served, PROMPT, max_tokens=24, temperature=0, logprobs=0, extra_body=penalties)
    assert out.choices[0].logprobs.tokens == [served.tokenizer.decode([t]) for t in expected]
    streamed = complete(served, PROMPT, max_tokens=24, temperature=0, stream=True, extra_body=penalties)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    eos_tokens, _, eos_reason = greedy_reference(served, EOS_AT_ONCE, 8)
    assert eos_reason == "stop" and len(eos_tokens) == 1
    held = complete(served, EOS_AT_ONCE, max_tokens=8, temperature=0, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens >= 5
    tiny_min_p = complete(served, PROMPT, max_tokens=12, temperature=1.0, seed=3, extra_body={"min_p": 0.999})
    assert tiny_min_p.choices[0].text == complete(served, PROMPT, max_tokens=12, temperature=0).choices[0].text
    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0, presence_penalty=1.5,
        frequency_penalty=0.5, extra_body={"repetition_penalty": 1.3},
    )  # fmt: skip
    as_text = complete(served, plain_prompt(CHAT), max_tokens=10, temperature=0, extra_body=penalties)
    assert chat.choices[0].message.content == as_text.choices[0].text
    for field, value, message in (
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", -3.0, "[-2, 2]"),
        ("repetition_penalty", 0.0, "[1e-6, 1e6]"),
        ("min_p", 1.5, "[0, 1]"),
        ("min_tokens", 9, "at most max_tokens"),
        ("min_tokens", -1, ">= 0"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            complete(served, PROMPT, max_tokens=4, extra_body={field: value})
        assert raised.value.param == field and message in raised.value.body["message"], raised.value.body


def test_response_format_json_schema_and_json_object(served):
    """response_format through the openai client: a JSON schema (completions and chat, streamed too) gives
    JSON that validates, the same greedy text streamed or not (eagle speculation under the grammar), ending
    with "stop"; json_object starts an object where the unconstrained text does not; a schema the engine
    cannot compile, and min_tokens with a format, are a 400 naming the field."""
    schema = {
        "type": "object",
        "properties": {"kind": {"enum": ["function", "class"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["kind", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    out = complete(served, PROMPT, max_tokens=40, temperature=0, extra_body={"response_format": fmt})
    value = json.loads(out.choices[0].text)
    assert out.choices[0].finish_reason == "stop" and value["kind"] in ("function", "class") and 0 <= value["n"] <= 9
    assert set(value) == {"kind", "n"} and isinstance(value["n"], int)
    streamed = complete(served, PROMPT, max_tokens=40, temperature=0, stream=True, extra_body={"response_format": fmt})
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=40, temperature=0, response_format=fmt
    )
    as_text = complete(served, plain_prompt(CHAT), max_tokens=40, temperature=0, extra_body={"response_format": fmt})
    assert chat.choices[0].message.content == as_text.choices[0].text and json.loads(as_text.choices[0].text)
    free = complete(served, PROMPT, max_tokens=4, temperature=0).choices[0].text
    obj = complete(served, PROMPT, max_tokens=4, temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].text.startswith("{") and not free.startswith("{")
    tiny = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
    before = metric_values(served)
    assert complete(served, PROMPT, max_tokens=8, temperature=0, extra_body={"response_format": tiny}).choices[
        0
    ].text in ("true", "false")
    choice = complete(served, PROMPT, max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    after = metric_values(served)  # structured requests count as any other: two more that stopped
    stopped = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "stop"), ("model_name", MODEL)))
    assert after[stopped] - before.get(stopped, 0) == 2
    for body, param, message in (
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, "response_format", ""),
        ({"response_format": {"type": "yaml"}}, "response_format", "must be one of"),
        ({"response_format": fmt, "min_tokens": 2}, "min_tokens", "cannot be combined"),
        ({"structured_outputs": {"regex": "(", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ):
        with pytest.raises(openai.BadRequestError) as raised:
            complete(served, PROMPT, max_tokens=8, extra_body=body)
        assert raised.value.param == param and message in raised.value.body["message"], raised.value.body


def test_truncate_prompt_tokens_keeps_the_prompts_last_ids(served):
    """truncate_prompt_tokens k (vLLM's): the completion of a prompt cut to its last k ids, text or ids, and
    chat; echo returns the prompt used; -1 keeps what fits; 0 is a 400 naming the field."""
    ids = ids_of(served, PROMPT)
    cut = complete(served, ids[-5:], max_tokens=6, temperature=0)
    for prompt in (PROMPT, ids):
        out = complete(served, prompt, max_tokens=6, temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 5})
        assert out.usage.prompt_tokens == 5
        assert out.choices[0].text == served.tokenizer.decode(ids[-5:]) + cut.choices[0].text
    whole = complete(served, PROMPT, max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": -1})
    assert completion_result(whole) == completion_result(complete(served, PROMPT, max_tokens=6, temperature=0))
    chat_ids = ids_of(served, plain_prompt(CHAT))
    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": 4}
    )
    assert chat_result(chat)[0] == complete(served, chat_ids[-4:], max_tokens=6, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError) as raised:
        complete(served, PROMPT, max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
    assert raised.value.param == "truncate_prompt_tokens"


def test_prompt_logprobs_and_echo_with_logprobs(served):
    """prompt_logprobs n (vLLM's): null, then per prompt token its raw logprob, rank and the n most likely
    tokens, equal to a log-softmax of the model's logits over the prompt; chat puts them on the response;
    echo with logprobs n leads the logprobs object with the prompt's tokens (the first null) and then the
    output's, as without echo; neither is streamed (a 400 naming the field)."""
    ids = ids_of(served, PROMPT)
    logits = np.asarray(served.model.forward_full(jnp.asarray([ids]))[0][0, :-1], np.float64)
    top = logits.max(-1, keepdims=True)
    reference = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))  # [P - 1, V]
    chosen = reference[np.arange(len(ids) - 1), ids[1:]]
    out = complete(served, PROMPT, max_tokens=4, temperature=0, extra_body={"prompt_logprobs": 2})
    listed = out.choices[0].model_extra["prompt_logprobs"]
    assert len(listed) == len(ids) and listed[0] is None
    for j, position in enumerate(listed[1:]):
        best = np.argsort(-reference[j])[:2]
        assert {int(k) for k in position} == {ids[j + 1], *best.tolist()}
        entry = position[str(ids[j + 1])]
        assert abs(entry["logprob"] - chosen[j]) < 1e-4 and entry["rank"] == 1 + np.sum(reference[j] > chosen[j])
        assert entry["decoded_token"] == served.tokenizer.decode([ids[j + 1]])
        assert position[str(best[0])]["rank"] == 1
    plain = complete(served, PROMPT, max_tokens=4, temperature=0, logprobs=2)
    echoed = complete(served, PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    lp = echoed.choices[0].logprobs
    assert lp.tokens == [served.tokenizer.decode([t]) for t in ids] + plain.choices[0].logprobs.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1 : len(ids)], chosen, atol=1e-4)
    assert lp.token_logprobs[len(ids) :] == plain.choices[0].logprobs.token_logprobs
    assert lp.text_offset[len(ids)] == len(PROMPT) and echoed.choices[0].text == PROMPT + plain.choices[0].text
    chat = served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    for body, param in (({"prompt_logprobs": 1}, "prompt_logprobs"), ({"echo": True, "logprobs": 1}, "echo")):
        with pytest.raises(openai.BadRequestError) as raised:
            complete(served, PROMPT, max_tokens=2, stream=True, extra_body=body)
        assert raised.value.param == param
    with pytest.raises(openai.BadRequestError) as raised:
        complete(served, PROMPT, max_tokens=2, extra_body={"prompt_logprobs": MAX_LOGPROBS + 1})
    assert raised.value.param == "prompt_logprobs"


# ----------------------------------------------------------------------------------------------
# Every field honoured or refused; limits before work

# For each field the server does not implement, a value that asks for it.
ASKING = {
    "best_of": 3,
    "echo": True,
    "suffix": "\n",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": {"name": "f"},
    "chat_template": "{{ messages[0]['content'] }}",
    "reasoning_effort": "low",
    "verbosity": "low",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}
IGNORED = {  # a value for each accepted-and-ignored field
    "user": "u-1",
    "safety_identifier": "s-1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "parallel_tool_calls": False,
}
CHAT = [{"role": "user", "content": "def add(a, b):"}]


def test_the_lists_of_refused_and_ignored_fields_are_tested():
    assert set(ASKING) == set(NOT_IMPLEMENTED) and set(IGNORED) == set(IGNORED_FIELDS)
    completions, chat = set(CompletionRequest.model_fields), set(ChatCompletionRequest.model_fields)
    assert not set(IGNORED_FIELDS) & (completions | chat)
    assert set(NOT_IMPLEMENTED) & completions == {"echo"} and not set(NOT_IMPLEMENTED) & chat


@pytest.mark.parametrize("field", sorted(ASKING))
def test_a_field_not_implemented_is_refused_by_name(served, field):
    for create, kwargs, request_model in (
        (served.client.completions.create, {"prompt": "x"}, CompletionRequest),
        (served.client.chat.completions.create, {"messages": CHAT}, ChatCompletionRequest),
    ):
        if field in request_model.model_fields:
            continue  # implemented on this endpoint (echo: completions)
        with pytest.raises(openai.BadRequestError) as raised:
            create(model=MODEL, max_tokens=4, extra_body={field: ASKING[field]}, **kwargs)
        assert (raised.value.param, raised.value.type) == (field, "invalid_request_error")
        message = raised.value.body["message"]
        assert message.startswith(f"{field}: {short_json(ASKING[field])} is not supported"), message


def test_tools_are_refused_not_ignored(served):
    tools = ASKING["tools"]
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError, match="function calling") as raised:
            served.client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, tool_choice=choice)
        assert raised.value.param in {"tools", "tool_choice"}


def test_no_op_values_and_ignored_fields_are_accepted_and_change_nothing(served):
    no_ops = {name: (u.noop[0] if u.noop else None) for name, u in NOT_IMPLEMENTED.items()}
    assert no_ops["tools"] == []
    extra = {**no_ops, **IGNORED, "n": 1, "response_format": {"type": "text"}}
    plain = completion_result(complete(served, PROMPT, max_tokens=12, temperature=0))
    assert completion_result(complete(served, PROMPT, max_tokens=12, temperature=0, extra_body=extra)) == plain
    chat = [
        served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, **kwargs)
        for kwargs in ({}, {"extra_body": extra})
    ]
    assert chat[0].choices[0].message.content == chat[1].choices[0].message.content
    chunks = complete(
        served, PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_obfuscation": True}
    )
    assert "".join(c.choices[0].text for c in chunks) == plain[0]


def test_limits_are_named_in_the_refusals(served):
    limits = PromptLimits.for_tokenizer(served.tokenizer, MAX_LENGTH)
    assert limits.max_chars == MAX_LENGTH * longest_token_chars(served.tokenizer) > 1000
    cases = [
        ({"prompt": [7] * 300}, "prompt", f"at most {MAX_LENGTH - 1} fit"),
        ({"prompt": "x" * (limits.max_chars + 1)}, "prompt", f"at most {limits.max_chars} characters"),
        ({"prompt": "x", "max_tokens": 2**63}, "max_tokens", f"{2**63} is more than a request holds"),
        ({"prompt": "x", "temperature": 1e308}, "temperature", "float32"),
        ({"prompt": "x\ud800"}, "prompt", "lone surrogate U+D800 at character 1"),
    ]
    for body, param, message in cases:
        status, payload, _ = request(served.url, "POST", "/v1/completions", {"model": MODEL, **body})
        assert (status, payload["error"]["param"]) == (400, param) and message in payload["error"]["message"]
        assert str(2**31 - 1) not in payload["error"]["message"]
    status, payload, _ = request(served.url, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "\ud800": 1})
    assert status == 400 and payload["error"]["param"] == "\ud800"  # quoted back, in ASCII JSON


def test_request_body_over_the_limit_is_413_before_it_is_read(served):
    with pytest.raises(openai.APIStatusError) as raised:
        complete(served, "x" * (DEFAULT_MAX_REQUEST_BYTES + 1))
    assert (raised.value.status_code, raised.value.code) == (413, "request_too_large")
    assert str(DEFAULT_MAX_REQUEST_BYTES) in raised.value.message
    body = json.dumps({"model": MODEL, "prompt": "import os\n", "max_tokens": 2, "temperature": 0}).encode()
    with running(build_app(served.async_engine, served.tokenizer, MODEL, max_request_bytes=len(body))) as url:
        assert request(url, "POST", "/v1/completions", body)[0] == 200
        assert request(url, "POST", "/v1/completions", body + b" ")[0] == 413
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", iter([body, b" " * 100]), encode_chunked=True)  # no length
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
        conn.close()
    with pytest.raises(ValueError, match="max_request_bytes"):
        build_app(served.async_engine, served.tokenizer, MODEL, max_request_bytes=0)


# The attacker: the official client in another process (building large bodies there holds its own GIL,
# not this process's, where the server and the streams' client run). All four attacks at once.
ATTACKER = r"""
import json, sys, time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key="x", max_retries=0, timeout=60)
code = "x = 1\n"
attacks = [
    (client.completions.create, {"prompt": code * (10 * 2**20 // len(code))}),  # 10 MB: over the body limit
    (client.completions.create, {"prompt": [7] * 2_000_000}),  # 2M token ids in 4 MB: over max_length
    (client.completions.create, {"prompt": code * 500_000}),  # 3 MB of text: more than max_length tokens hold
    (client.chat.completions.create, {"messages": [{"role": "user", "content": code * 500_000}]}),
]


def send(attack):
    create, body = attack
    start = time.perf_counter()
    try:  # the body as extra_body, sent as is: the client's own type transform of 2M ids takes ~20 s
        create(model=sys.argv[2], max_tokens=4, **{key: [] for key in body}, extra_body=body)
        return [200, None, time.perf_counter() - start]
    except openai.APIStatusError as error:
        return [error.status_code, error.param, time.perf_counter() - start]


print("ready", flush=True)
sys.stdin.readline()
with ThreadPoolExecutor(len(attacks)) as pool:
    print(json.dumps(list(pool.map(send, attacks))), flush=True)
"""


def _stream_times(served, prompts: list[str], done: Callable[[], bool]) -> list[list[list[float]]]:
    """Per prompt, the chunk arrival times (perf_counter seconds) of each of its streamed completions: one
    thread per prompt, all at once, each streaming its prompt again and again until `done()` after one."""

    def one(prompt):
        runs = []
        while not runs or not done():
            chunks = complete(
                served, prompt, max_tokens=240, temperature=0, stream=True, extra_body={"ignore_eos": True}
            )
            runs.append([time.perf_counter() for _ in chunks])
        return runs

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _largest_gap(times: list[list[list[float]]]) -> float:
    """The longest wait between two chunks of one stream, after its first (which waits for admission)."""
    return max(b - a for runs in times for t in runs for a, b in zip(t[1:], t[2:], strict=False))


def test_huge_requests_are_refused_quickly_without_stalling_other_streams(served):
    prompts = ["import os\n", "def add(a, b):\n", "class Point:\n", "for i in range("]
    attacker = subprocess.Popen(
        [sys.executable, "-c", ATTACKER, f"{served.url}/v1", MODEL],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        baseline = _largest_gap(_stream_times(served, prompts, lambda: True))
        assert attacker.stdout.readline() == "ready\n"
        attacked = threading.Event()

        def attack_once_streaming():
            wait_for(lambda: served.engine.num_running == len(prompts))
            start = time.perf_counter()
            attacker.stdin.write("go\n")
            attacker.stdin.flush()
            results = json.loads(attacker.stdout.readline())
            attacked.set()
            return start, time.perf_counter(), results

        with ThreadPoolExecutor(1) as pool:
            attack = pool.submit(attack_once_streaming)
            times = _stream_times(served, prompts, attacked.is_set)  # they stream until the attack is over
            start, end, results = attack.result()
    finally:
        attacker.kill()
        attacker.wait()
    assert [r[:2] for r in results] == [[413, None], [400, "prompt"], [400, "prompt"], [400, "messages"]]
    assert all(seconds < 5 for _, _, seconds in results)  # refused quickly (unbounded, the 10 MB took 17 s)
    assert all(runs[0][0] < start + 1 and end < runs[-1][-1] for runs in times)  # the attack came as all streamed
    gap, bound = _largest_gap(times), 3 * baseline + 1.0  # the machine is shared and noisy: a wide margin
    assert gap < bound, (gap, baseline, results)
    assert not served.engine.has_unfinished()


# ----------------------------------------------------------------------------------------------
# Chat


def test_chat_with_the_plain_template_is_a_completion_of_the_rendered_prompt(served):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    rendered = "<|system|>\nYou write Python.\n<|user|>\ndef add(a, b):\n<|assistant|>\n"
    assert plain_prompt(messages) == rendered
    expected = completion_result(complete(served, rendered, max_tokens=30, temperature=0))

    chat = served.client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=30, temperature=0, logprobs=True
    )
    choice = chat.choices[0]
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    assert (
        choice.message.content,
        choice.finish_reason,
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    ) == expected
    assert len(choice.logprobs.content) == expected[3]

    chunks = list(
        served.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected[0]
    assert chunks[-2].choices[0].finish_reason == expected[1] and chunks[-1].usage.completion_tokens == expected[3]
    # content parts are joined
    parts = [{"type": "text", "text": "def add("}, {"type": "text", "text": "a, b):"}]
    chat = served.client.chat.completions.create(
        model=MODEL, messages=[messages[0], {"role": "user", "content": parts}], max_tokens=30, temperature=0
    )
    assert chat.choices[0].message.content == expected[0]


def test_chat_template_of_the_model_directory_is_used(served, tmp_path):
    model_dir = tmp_path / "chat-model"
    shutil.copytree(DEFAULT_MODEL_DIR, model_dir)
    template = (
        "{{ bos_token }}{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}# assistant:\n{% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "bos_token": {"content": "### "}, "eos_token": "<eos>"})
    )
    assert ChatTemplate.from_model_dir(DEFAULT_MODEL_DIR).source is None  # the demo model: plain template
    chat_template = ChatTemplate.from_model_dir(model_dir)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    rendered = "### # user: def add(a, b):\n# assistant:\n"
    assert chat_template.render(messages) == rendered
    expected = completion_result(complete(served, rendered, max_tokens=25, temperature=0))

    with running(build_app(served.async_engine, served.tokenizer, "chatty", chat_template=chat_template)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model="chatty", messages=messages, max_tokens=25, temperature=0)
        assert chat_result(chat) == expected
        # the template's arguments reach it: the prompt ends inside the final message, bos_token overridden
        prefill = [*messages, {"role": "assistant", "content": "    return"}]
        arguments = {"add_generation_prompt": False, "continue_final_message": True}
        arguments["chat_template_kwargs"] = {"bos_token": "", "unread": [1, {"a": None}]}
        continued = "# user: def add(a, b):\n# assistant:     return"
        assert chat_template.render(prefill, **arguments) == continued
        expected = completion_result(complete(served, continued, max_tokens=8, temperature=0))
        chat = client.chat.completions.create(
            model="chatty", messages=prefill, max_tokens=8, temperature=0, extra_body=arguments
        )
        assert chat_result(chat) == expected
    refusing = ChatTemplate("{{ raise_exception('only user messages') }}")
    with pytest.raises(ValueError, match="only user messages"):
        refusing.render(messages)


# A template that reads add_generation_prompt, a chat_template_kwargs variable and bos_token.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)
PREFILL = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]


def test_chat_template_arguments_change_the_rendered_prompt():
    template = ChatTemplate(THINKING_TEMPLATE, bos_token="<s>")
    head = "<s><|user|>Hi<|end|>\n<|assistant|>"
    cases = [
        ({}, head + "Sure, <|end|>\n<|assistant|>"),
        ({"add_generation_prompt": False}, head + "Sure, <|end|>\n"),
        ({"add_generation_prompt": False, "continue_final_message": True}, head + "Sure, "),
        ({"chat_template_kwargs": {"enable_thinking": False}}, head + "Sure, <|end|>\n<|assistant|><think></think>"),
        ({"chat_template_kwargs": {"enable_thinking": True}}, head + "Sure, <|end|>\n<|assistant|>"),
        ({"chat_template_kwargs": {"bos_token": "[BOS]"}}, "[BOS]" + head[3:] + "Sure, <|end|>\n<|assistant|>"),
        # vLLM merges the kwargs over its arguments: these two are apply_chat_template's
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, head + "Sure, <|end|>\n"),
        ({"chat_template_kwargs": {"add_generation_prompt": False, "continue_final_message": True}}, head + "Sure, "),
    ]
    for arguments, rendered in cases:
        assert template.render(PREFILL, **arguments) == rendered, arguments
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    # a template that trims the content: the cut trims too (transformers')
    trimming = ChatTemplate(THINKING_TEMPLATE.replace("m['content']", "m['content'] | trim"))
    assert trimming.render(PREFILL, **cont) == "<|user|>Hi<|end|>\n<|assistant|>Sure,"
    # the sentinel finds the final message's end where its text recurs after it ("end" in "<|end|>")
    ending = [PREFILL[0], {"role": "assistant", "content": "end"}]
    assert template.render(ending, **cont) == head + "end"
    # the plain template: no header without add_generation_prompt, no final newline to continue; kwargs unread
    plain = ChatTemplate()
    assert plain_prompt(PREFILL, add_generation_prompt=False) == "<|user|>\nHi\n<|assistant|>\nSure, \n"
    assert plain.render(PREFILL, **cont) == "<|user|>\nHi\n<|assistant|>\nSure, "
    thinking = {"chat_template_kwargs": {"enable_thinking": False, "bos_token": "x"}}
    assert (
        plain.render(PREFILL, **thinking)
        == plain_prompt(PREFILL)
        == "<|user|>\nHi\n<|assistant|>\nSure, \n<|assistant|>\n"
    )

    refused = [
        (template, {"continue_final_message": True}, "continue_final_message", "cannot both be true"),
        (plain, {"continue_final_message": True}, "continue_final_message", "cannot both be true"),
        (template, {"chat_template_kwargs": {"continue_final_message": True}}, "continue_final_message", "both"),
        (plain, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", 'may not set "messages"'),
        (template, {"chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs", '"chat_template"'),
        (template, {"chat_template_kwargs": {"add_generation_prompt": 0}}, "chat_template_kwargs", "must be a bool"),
        (template, {"chat_template_kwargs": [1]}, "chat_template_kwargs", "must be an object"),
        # the final message's content is not in the rendered text as it is: rewritten, or dropped
        (ChatTemplate("{{ messages[-1]['content'] | upper }}"), cont, "continue_final_message", "does not write"),
        (ChatTemplate("{{ messages[0]['content'] }}"), cont, "continue_final_message", "does not write"),
    ]
    for chat_template, arguments, param, message in refused:
        with pytest.raises(ChatTemplateArgumentError, match=message) as raised:
            chat_template.render(PREFILL, **arguments)
        assert raised.value.param == param and str(raised.value).startswith(f"{param}: ")


def test_chat_template_arguments_render_as_transformers_does():
    """The oracle: transformers' apply_chat_template rendering (the [parity] extra)."""
    chat_template_utils = pytest.importorskip(
        "transformers.utils.chat_template_utils", reason="the transformers oracle needs the [parity] extra"
    )
    templates = [THINKING_TEMPLATE, THINKING_TEMPLATE.replace("m['content']", "m['content'] | trim")]
    conversations = [PREFILL, [PREFILL[0], {"role": "assistant", "content": "end"}], PREFILL[:1]]
    cases = [(True, False, {}), (False, False, {}), (False, True, {}), (True, False, {"enable_thinking": False})]
    cases.append((False, True, {"enable_thinking": False, "bos_token": "[BOS]"}))
    for source in templates:
        for messages in conversations:
            for add, cont, kwargs in cases:
                variables = {"bos_token": "<s>", "eos_token": "</s>", **kwargs}
                (expected,), _ = chat_template_utils.render_jinja_template(
                    [messages], chat_template=source, add_generation_prompt=add, continue_final_message=cont,
                    **variables,
                )  # fmt: skip
                got = ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(
                    messages, add_generation_prompt=add, continue_final_message=cont, chat_template_kwargs=kwargs
                )
                assert got == expected, (source, messages, add, cont, kwargs)


def test_chat_template_fields_are_parsed_strictly():
    def parse(**fields):
        body = {"model": MODEL, "messages": CHAT, **fields}
        return parse_request(ChatCompletionRequest, json.dumps(body).encode())

    defaults = dict(add_generation_prompt=True, continue_final_message=False, chat_template_kwargs=None)
    assert parse().chat_template_arguments() == defaults
    nulls = dict.fromkeys(defaults)
    assert parse(**nulls).chat_template_arguments() == defaults
    fields = dict(add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"a": [1, None]})
    assert parse(**fields).chat_template_arguments() == fields
    # both sent true: vLLM's check, before rendering (both true by add_generation_prompt's default: render's)
    with pytest.raises(RequestError, match="cannot both be true") as raised:
        parse(add_generation_prompt=True, continue_final_message=True).chat_template_arguments()
    assert raised.value.param == "continue_final_message"
    for field, value, message in [
        ("add_generation_prompt", "false", "valid boolean"),
        ("add_generation_prompt", 0, "valid boolean"),
        ("continue_final_message", 1, "valid boolean"),
        (
            "chat_template_kwargs",
            [["enable_thinking", False]],
            r'must be an object of chat template variables, got \[\["',
        ),
        ("chat_template_kwargs", "enable_thinking", "must be an object"),
    ]:
        with pytest.raises(RequestError, match=message) as raised:
            parse(**{field: value})
        assert raised.value.param == field and raised.value.message.startswith(f"{field}: ")


def test_chat_template_fields_through_the_server(served):
    """The plain template: the prompt without the header, or ending inside the final message, is the
    completion of that text; refusals name the field."""
    create = served.client.chat.completions.create
    user = [{"role": "user", "content": "def add(a, b):"}]
    prefill = [*user, {"role": "assistant", "content": "    return"}]
    for messages, arguments, rendered in [
        (user, {"add_generation_prompt": False}, "<|user|>\ndef add(a, b):\n"),
        (
            prefill,
            {"add_generation_prompt": False, "continue_final_message": True},
            "<|user|>\ndef add(a, b):\n<|assistant|>\n    return",
        ),
    ]:
        expected = completion_result(complete(served, rendered, max_tokens=8, temperature=0))
        chat = create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=arguments)
        choice = chat.choices[0]
        assert (
            choice.message.content,
            choice.finish_reason,
            chat.usage.prompt_tokens,
            chat.usage.completion_tokens,
        ) == expected
    for extra, param, message in [
        ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),  # by default
        ({"add_generation_prompt": "no"}, "add_generation_prompt", "valid boolean"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "must be an object"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", 'may not set "messages"'),
    ]:
        with pytest.raises(openai.BadRequestError, match=message) as raised:
            create(model=MODEL, messages=prefill, max_tokens=4, extra_body=extra)
        assert (raised.value.param, raised.value.type) == (param, "invalid_request_error")
    assert not served.engine.has_unfinished()


# ----------------------------------------------------------------------------------------------
# The other endpoints


def metric_values(served) -> dict:
    """The server's /metrics samples: (name, sorted labels) -> value."""
    status, text, _ = request(served.url, "GET", "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_models_health_and_metrics(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    status, payload, _ = request(served.url, "GET", "/v1/models")
    assert status == 200 and payload["data"][0]["max_model_len"] == MAX_LENGTH
    assert request(served.url, "GET", "/v1/models/nope")[1]["error"]["code"] == "model_not_found"
    assert request(served.url, "GET", "/health")[:2] == (200, {"status": "ok"})
    assert request(served.url, "GET", "/nowhere")[0] == 404

    complete(served, PROMPT, max_tokens=5, temperature=0)
    assert request(served.url, "GET", "/metrics")[2].startswith("text/plain")
    values = metric_values(served)
    labels = (("engine", "0"), ("model_name", MODEL))
    assert values["vllm:request_success_total", tuple(sorted(labels + (("finished_reason", "length"),)))] >= 1
    assert values["vllm:spec_decode_num_drafts_total", labels] >= 1


# ----------------------------------------------------------------------------------------------
# mtp-jax serve


def test_serve_command_line(tmp_path, capsys):
    args = build_parser().parse_args(["serve"])
    assert (args.model_dir, args.speculative, args.max_batch, args.host, args.port, args.func) == (
        str(DEFAULT_MODEL_DIR),
        "eagle",
        8,
        "127.0.0.1",
        8000,
        run_serve,
    )
    assert args.max_request_bytes is None  # DEFAULT_MAX_REQUEST_BYTES
    args = build_parser().parse_args(
        [
            "serve",
            "some/dir",
            "--speculative",
            "none",
            "--num-speculative-tokens",
            "2",
            "--max-length",
            "512",
            "--prefill-chunk",
            "16",
            "--max-queue",
            "3",
            "--port",
            "0",
            "--served-model-name",
            "m",
            "--mesh",
            "data=1",
            "--max-request-bytes",
            "16MiB",
        ]
    )
    assert (
        args.model_dir,
        args.speculative,
        args.num_speculative_tokens,
        args.max_length,
        args.prefill_chunk,
        args.max_queue,
        args.served_model_name,
        args.mesh,
        args.max_request_bytes,
    ) == ("some/dir", "none", 2, 512, 16, 3, "m", "data=1", 16 * 2**20)
    assert main(["serve", str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "MODEL_DIR" in capsys.readouterr().err
