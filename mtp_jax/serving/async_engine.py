"""`ServingEngine` for asyncio: its steps run in one background thread, outputs reach coroutines.

    engine = AsyncEngine(ServingEngine(model, speculative, tokenizer=tokenizer))
    engine.start()
    async for out in engine.generate(prompt_ids, max_tokens=64):  # a RequestOutput per step
        print(out.text, end="")
    engine.shutdown()

The thread runs `ServingEngine.step` while any request is unfinished and sleeps on a condition
variable otherwise (no busy loop). Each request has its own `asyncio.Queue` on the loop that
submitted it; the thread feeds it with `loop.call_soon_threadsafe`. A consumer that goes away (the
HTTP client disconnected, its task was cancelled, it stopped iterating) aborts its request, which
frees the slot before the next step. An exception in the engine thread stops the thread and is
raised, as `EngineError`, in every waiting request, and `add_request` refuses new ones after it:
nothing waits forever.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Sequence

from mtp_jax.serving.scheduler import RequestOutput, ServingEngine


class EngineError(RuntimeError):
    """The engine thread failed or was shut down; the request cannot finish (the server answers 503)."""


class RequestStream:
    """The outputs of one request as an async iterator; ends after the output that finishes it.

    `abort()` cancels the request when it has not finished (a no-op after). Iterating raises
    `EngineError` when the engine thread failed or shut down before the request finished.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue):
        self._engine, self.request_id, self._queue = engine, request_id, queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise EngineError(f"request {self.request_id} cannot finish: {item}") from item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs a `ServingEngine` in a background thread for asyncio consumers (one per request).

    `start()` launches the thread (idempotent); `shutdown()` stops and joins it, and the requests
    still unfinished get `EngineError`. `add_request` / `generate` are called from a running event
    loop (any number of loops and threads); `engine` stays usable for inspection (`num_running`,
    `compiled_counts`, ...), but only the thread calls its `step`.
    """

    def __init__(self, engine: ServingEngine):
        self.engine = engine
        self._cond = threading.Condition()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None  # what ended the engine thread, if it failed

    # ------------------------------------------------------------------------------------------
    # Lifecycle

    def start(self) -> None:
        """Starts the engine thread (a no-op when it runs). Raises EngineError after `shutdown`."""
        with self._cond:
            if self._stopping:
                raise EngineError("the engine was shut down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mtp-jax-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Stops the thread after its current step and joins it (up to `timeout` seconds); requests
        still unfinished then get `EngineError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        self._fail_all(EngineError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        """The engine thread runs (started, not failed, not shut down)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping and self.error is None

    # ------------------------------------------------------------------------------------------
    # Requests

    def add_request(self, prompt: Sequence[int], *, request_id: str | None = None, **kwargs) -> RequestStream:
        """Queues a request (`ServingEngine.add_request`'s arguments); returns its `RequestStream`.

        Call from a running event loop: its outputs arrive on that loop. Raises at once what
        `ServingEngine.add_request` raises (TypeError / ValueError naming the argument, `QueueFull`)
        and EngineError when the engine thread failed or was shut down.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request_id or uuid.uuid4().hex
        with self._cond:  # the thread dispatches under this lock too: the queue is in place first
            if self.error is not None or self._stopping:
                raise EngineError(f"the engine is not running: {self.error or 'shut down'}")
            if request_id in self._queues:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._queues[request_id] = (loop, queue)
            try:
                self.engine.add_request(prompt, request_id=request_id, **kwargs)
            except BaseException:
                del self._queues[request_id]
                raise
            self._cond.notify_all()
        return RequestStream(self, request_id, queue)

    async def generate(self, prompt: Sequence[int], **kwargs) -> AsyncIterator[RequestOutput]:
        """The request's outputs, step by step (arguments as `add_request`; its errors are raised at the
        first iteration). Cancellation aborts the request; so does leaving the loop early, once the
        generator is closed: iterate it under `contextlib.aclosing(...)` so that happens at once, on
        the running loop (an async generator left to the garbage collector is closed later, perhaps
        after its loop has closed)."""
        stream = self.add_request(prompt, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> bool:
        """Cancels a request (any thread); False when no unfinished request has this id."""
        with self._cond:
            aborted = self.engine.abort(request_id)
            self._cond.notify_all()
        return aborted

    # ------------------------------------------------------------------------------------------
    # The engine thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self.engine.has_unfinished():
                        self._cond.wait()
                    if self._stopping:
                        return
                outputs = self.engine.step()
                with self._cond:
                    for out in outputs:
                        self._deliver(out.request_id, out, out.finished)
        except BaseException as error:  # surfaced to every waiting request, never swallowed
            self.error = error
            self._fail_all(error)

    def _deliver(self, request_id: str, item, last: bool) -> None:
        """Puts `item` on the request's queue (its loop's thread does); holds `_cond`."""
        entry = self._queues.pop(request_id, None) if last else self._queues.get(request_id)
        if entry is None:
            return
        loop, queue = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody will read it
            if not last:
                self._queues.pop(request_id, None)
                self.engine.abort(request_id)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            for request_id in list(self._queues):
                self._deliver(request_id, error, True)
