"""`mtp_jax.serving.async_engine.AsyncEngine` alone, over a fake engine (no model): it idles without work,
aborts the requests of consumers that leave or are cancelled, and surfaces the engine thread's errors."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from mtp_jax.serving import RequestMetrics, RequestOutput
from mtp_jax.serving.async_engine import AsyncEngine, EngineError


def wait_for(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class FakeEngine:
    """The ServingEngine calls AsyncEngine makes; each step hands every request one token, forever (an
    aborted one gets its "abort" output at the next step, as ServingEngine's)."""

    def __init__(self, fail_at_step: int | None = None):
        self.running, self.aborting, self.aborted = set(), set(), []
        self.steps, self.fail_at_step = 0, fail_at_step
        self.lock = threading.Lock()

    def add_request(self, prompt, *, request_id, max_tokens=None):
        with self.lock:
            self.running.add(request_id)

    def abort(self, request_id):
        with self.lock:
            self.aborted.append(request_id)
            if request_id not in self.running:
                return False
            self.aborting.add(request_id)
            return True

    def has_unfinished(self):
        with self.lock:
            return bool(self.running)

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("device lost")
        time.sleep(0.001)
        with self.lock:
            ids, self.running = [(i, i in self.aborting) for i in self.running], self.running - self.aborting
            self.aborting = set()
        return [
            RequestOutput(
                request_id=i,
                token_ids=[] if gone else [1],
                logprobs=[] if gone else [0.0],
                text="" if gone else "a",
                num_committed=1,
                num_accepted=0,
                prompt_tokens=1,
                completion_tokens=self.steps,
                finish_reason="abort" if gone else None,
                stop_reason=None,
                metrics=RequestMetrics(arrival_time=0.0, num_speculative_tokens=0),
            )
            for i, gone in ids
        ]


def test_async_engine_idles_without_work_and_aborts_cancelled_consumers():
    fake = FakeEngine()
    engine = AsyncEngine(fake)
    engine.start()
    time.sleep(0.2)
    assert fake.steps == 0 and engine.is_running  # waits on its condition, no busy loop

    async def consume(n):
        got = []
        # aclosing: the generator is closed while this loop runs (left to the garbage collector, its
        # finalizer would later schedule aclose() on a closed loop: "Event loop is closed")
        async with contextlib.aclosing(engine.generate([1], request_id="r", max_tokens=None)) as stream:
            async for out in stream:
                got.append(out.text)
                if len(got) == n:
                    break  # leaving the loop aborts
        return got

    async def cancelled():
        task = asyncio.ensure_future(consume(10**9))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    assert asyncio.run(consume(3)) == ["a"] * 3
    wait_for(lambda: not fake.has_unfinished())
    assert fake.aborted == ["r"]
    asyncio.run(cancelled())
    wait_for(lambda: not fake.has_unfinished())
    assert fake.aborted == ["r", "r"]
    steps = fake.steps
    time.sleep(0.1)
    assert fake.steps == steps  # idle again
    engine.shutdown()
    assert not engine.is_running
    with pytest.raises(EngineError, match="shut down"):
        asyncio.run(consume(1))


def test_async_engine_surfaces_engine_thread_errors():
    engine = AsyncEngine(FakeEngine(fail_at_step=3))
    engine.start()

    async def consume():
        async with contextlib.aclosing(engine.generate([1], request_id="r")) as stream:
            async for _ in stream:
                pass

    with pytest.raises(EngineError, match="device lost"):
        asyncio.run(consume())
    assert not engine.is_running and isinstance(engine.error, RuntimeError)
    with pytest.raises(EngineError, match="device lost"):
        asyncio.run(consume())  # refused at once: the thread is gone
    engine.shutdown()
