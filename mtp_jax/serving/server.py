"""An OpenAI-compatible HTTP server around `ServingEngine` (FastAPI + uvicorn; `mtp-jax serve`).

Endpoints:

- `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI's request fields (see
  `mtp_jax.serving.protocol` for what is supported), a JSON response, or with `"stream": true`
  server-sent events `data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n` (`text_completion` /
  `chat.completion.chunk` objects; with `stream_options.include_usage` a last chunk carries
  `usage` and no choices). `finish_reason` is "stop" (EOS, a stop token or a stop string) or
  "length" (max_tokens); `stop_reason` (vLLM's) names the stop string or token id. `usage`
  counts the engine's tokens: a stop token counts as a completion token though its text is not
  in the output, tokens after a stop string do not count.
- `GET /v1/models` (and `/v1/models/{id}`): the one served model. `GET /health`: 200 while the
  engine thread runs, else 503. `GET /metrics`: Prometheus text (`PrometheusMetrics`), when given.

Limits before work: a request body over `max_request_bytes` (default `DEFAULT_MAX_REQUEST_BYTES`,
4 MiB; `mtp-jax serve --max-request-bytes`) is refused with 413 `request_too_large`, from its
Content-Length before a byte is read, or once that many bytes have come (a chunked body). A prompt
longer than the engine's `max_length` holds is refused before it is tokenized (`PromptLimits`: token
ids, or characters of text). Parsing, checking, chat templating and tokenizing run in a worker thread
(`asyncio.to_thread`; tokenizing through `encode_batch`, which releases the GIL, where `encode` holds
it for the whole text), so a large or malformed request does not delay another's stream or `/health`.

Errors carry OpenAI's body `{"error": {"message", "type", "param", "code"}}`: 400 for a body that
is not a JSON object, a field that is unknown or not implemented (`protocol.NOT_IMPLEMENTED`: never
ignored), a value out of range (sampling values, a prompt that does not fit `max_length`, too many
stop tokens: `param` names it); 413 for a body too large; 404 `model_not_found` for another model
name; 429 `queue_full` when `max_queue` requests wait already; 503 when the engine thread is not
running. A client that disconnects (or closes a stream) aborts its request, which frees its slot
before the next engine step. Handlers only await their request's queue and worker thread: nothing
blocks the event loop while the engine thread computes.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from mtp_jax.serving import protocol, responses
from mtp_jax.serving.async_engine import AsyncEngine, EngineError, RequestStream
from mtp_jax.serving.chat_template import ChatTemplate, ChatTemplateArgumentError
from mtp_jax.serving.limits import PromptLimits, RequestError, error_body, short_json
from mtp_jax.serving.outputs import RequestOutput
from mtp_jax.serving.prometheus import CONTENT_TYPE, PrometheusMetrics
from mtp_jax.serving.protocol import ChatCompletionRequest, CompletionRequest
from mtp_jax.serving.scheduler import QueueFull
from mtp_jax.serving.scoring import PromptLogprobs

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20  # a 160k-token prompt as token ids (~7 bytes each) or text, with room

# The parameter an engine / SamplingParams message is about, first match wins.
_PARAM_PATTERNS = (
    (r"\blogit_bias\b", "logit_bias"),
    (r"^min_tokens\b", "min_tokens"),
    (r"^response_format\b", "response_format"),
    (r"^structured_outputs\b", "structured_outputs"),
    (r"^repetition_penalty\b", "repetition_penalty"),
    (r"^frequency_penalty\b", "frequency_penalty"),
    (r"^presence_penalty\b", "presence_penalty"),
    (r"^min_p\b", "min_p"),
    (r"\bmax_new_tokens\b|\bmax_tokens\b", "max_tokens"),
    (r"\bprompt\b", "prompt"),
    (r"^temperature\b", "temperature"),
    (r"^top_k\b", "top_k"),
    (r"^top_p\b", "top_p"),
    (r"^seed\b", "seed"),
    (r"\bstop tokens?\b|\bstop_token", "stop_token_ids"),
    (r"^stop\b", "stop"),
)


class _ErrorResponse(JSONResponse):
    """JSON in ASCII: an error may quote what the client sent, even a lone surrogate (not UTF-8)."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def _error(
    status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> JSONResponse:
    return _ErrorResponse(error_body(message, type, param, code), status_code=status)


def refusal(error: Exception, prompt_param: str = "prompt") -> JSONResponse:
    """The error response for a request the server or the engine refused."""
    if isinstance(error, RequestError):
        return _error(error.status, error.message, error.type, error.param, error.code)
    if isinstance(error, QueueFull):
        return _error(429, str(error), "rate_limit_error", None, "queue_full")
    if isinstance(error, EngineError):
        return _error(503, str(error), "server_error", None, "engine_unavailable")
    message = re.sub(r"\bprompt 0\b", "the prompt", str(error)).replace("max_new_tokens", "max_tokens")
    param = next((p for pattern, p in _PARAM_PATTERNS if re.search(pattern, message)), None)
    if param == "prompt" and prompt_param != "prompt":
        param, message = prompt_param, message.replace("the prompt", f"the prompt (the rendered {prompt_param})")
    if param is not None and param not in message:
        message = f"{param}: {message}"
    return _error(400, message, param=param)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, at most `limit` bytes. Raises RequestError 413 `request_too_large` when its
    Content-Length says more (nothing is read) or, for a chunked body, once more has come (uvicorn
    discards the rest after the response)."""

    def too_large(size: str) -> RequestError:
        return RequestError(
            f"the request body is {size} bytes: this server accepts at most {limit} "
            "(max_request_bytes; mtp-jax serve --max-request-bytes)",
            status=413,
            code="request_too_large",
        )

    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(length)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that abort their requests however the response ends (client gone included)."""

    def __init__(self, events: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._request_streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._request_streams:
                stream.abort()


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read already: the next ASGI message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of the n choices' streams as they come, each with its choice's index. Raises EngineError
    as the streams do."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except EngineError as error:
            await queue.put((index, error))
        await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class _Collected:
    """A whole choice's outputs."""

    def __init__(self):
        self.text, self.token_ids, self.logprobs, self.top_logprobs, self.last = [], [], [], [], None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.top_logprobs += out.top_logprobs
        self.last = out


def _usage(lasts: list[RequestOutput], n: int) -> dict:
    """The usage of a request's choices, n per prompt: each prompt once, every choice's completion tokens."""
    prompts = sum(out.prompt_tokens for out in lasts[::n])
    return responses.usage(prompts, sum(out.completion_tokens for out in lasts))


class _OpenAIServer:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: Tokenizer,
        model_name: str,
        chat_template: ChatTemplate,
        max_request_bytes: int,
        limits: PromptLimits,
    ):
        self.engine, self.tokenizer, self.model_name, self.chat_template = engine, tokenizer, model_name, chat_template
        self.max_request_bytes, self.limits = max_request_bytes, limits

    def model_card(self, created: int) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": created,
            "owned_by": "mtp-jax",
            "max_model_len": self.engine.engine.max_length,
        }

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise RequestError(
                f"the model {short_json(name)} does not exist; this server serves {short_json(self.model_name)}",
                "model",
                status=404,
                code="model_not_found",
            )

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids; `encode_batch` releases the GIL while it works (`encode` does not)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _submit(self, body, prompts: list[list[int]], request_id: str) -> list[RequestStream]:
        """One engine request per choice, n per prompt in prompt order (ids `request_id`, or `request_id`-i
        for several), choice j of a prompt sampled with seed + j; all or none."""
        n, streams = body.num_choices, []
        try:
            for p, prompt_ids in enumerate(prompts):
                for j in range(n):
                    rid = request_id if n * len(prompts) == 1 else f"{request_id}-{p * n + j}"
                    streams.append(self.engine.add_request(prompt_ids, request_id=rid, **body.engine_kwargs(j)))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    async def _collect(self, streams: list[RequestStream], request: Request) -> list[_Collected] | None:
        """All the choices' outputs; None when the client disconnected first (the requests are aborted)."""

        async def drain():
            collected = [_Collected() for _ in streams]
            async for index, out in _merged(streams):
                collected[index].add(out)
            return collected

        task, watch = asyncio.ensure_future(drain()), asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            return task.result() if task.done() else None
        finally:
            task.cancel()
            watch.cancel()
            for stream in streams:
                stream.abort()

    # ------------------------------------------------------------------------------------------
    # /v1/completions

    def completion_prompt(self, raw: bytes) -> tuple[CompletionRequest, list[list[int]]]:
        """The request of a raw body and its prompts' token ids (a worker thread's job: its time grows with
        the body). Raises RequestError naming the field."""
        body = protocol.parse_request(CompletionRequest, raw, self.limits)
        self._check_model(body.model)
        body.check_choices()
        body.check_streamed_prompt_logprobs()
        return body, [
            body.truncated(self._encode(p) if isinstance(p, str) else p, self.limits.max_length) for p in body.prompt
        ]

    def _echoes(self, body: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Per choice, its prompt's text when the request asks for it back (`echo`), else ""."""
        texts = [
            (
                p
                if isinstance(p, str) and body.truncate_prompt_tokens is None
                else self.tokenizer.decode(ids, skip_special_tokens=False)
            )
            if body.echo
            else ""
            for p, ids in zip(body.prompt, prompts, strict=True)
        ]
        return [text for text in texts for _ in range(body.num_choices)]

    def _prompt_scores(self, body, prompts: list[list[int]]) -> list[PromptLogprobs] | None:
        """Each prompt's logprobs when the request asks for them (`num_prompt_logprobs`; a worker thread's job:
        one more forward of each prompt), else None."""
        if body.num_prompt_logprobs() is None:
            return None
        return [self.engine.engine.prompt_logprobs(ids) for ids in prompts]

    def _completion_logprobs(self, body: CompletionRequest, token_ids, logprobs, top, offset: int) -> dict | None:
        if body.logprobs is None:
            return None
        return responses.completion_logprobs(self.tokenizer, token_ids, logprobs, offset, top)

    async def completions(self, request: Request) -> Response:
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            raw = await read_body(request, self.max_request_bytes)
            body, prompts = await asyncio.to_thread(self.completion_prompt, raw)
            scores = await asyncio.to_thread(self._prompt_scores, body, prompts)
            streams = self._submit(body, prompts, request_id)
        except (RequestError, QueueFull, EngineError, ValueError, TypeError) as error:
            return refusal(error)
        echoes = self._echoes(body, prompts)
        if body.stream:
            return _EventStream(self._completion_events(body, streams, request_id, created, echoes), streams)
        try:
            done = await self._collect(streams, request)
        except EngineError as error:
            return refusal(error)
        if done is None:
            return Response(status_code=499)  # nobody reads it
        choices = []
        for i, c in enumerate(done):
            prompt, score = prompts[i // body.num_choices], scores and scores[i // body.num_choices]
            logprobs = self._completion_logprobs(body, c.token_ids, c.logprobs, c.top_logprobs, len(echoes[i]))
            if body.echo and logprobs is not None:
                echoed = responses.echoed_logprobs(self.tokenizer, prompt, score, body.logprobs)
                logprobs = responses.joined_logprobs(echoed, logprobs)
            asked = body.prompt_logprobs
            choices.append(
                responses.completion_choice(
                    i,
                    echoes[i] + "".join(c.text),
                    c.last.finish_reason,
                    c.last.stop_reason,
                    logprobs,
                    None if asked is None else responses.prompt_logprobs(self.tokenizer, prompt, score, asked),
                )
            )
        usage = _usage([c.last for c in done], body.num_choices)
        return JSONResponse(responses.completion_response(request_id, self.model_name, choices, usage, created=created))

    async def _completion_events(
        self, body: CompletionRequest, streams: list[RequestStream], request_id: str, created: int, echoes: list[str]
    ) -> AsyncIterator[str]:
        offsets, lasts = [0] * len(streams), [None] * len(streams)

        def chunk(index: int, text: str, out: RequestOutput | None = None, logprobs: dict | None = None) -> str:
            choice = responses.completion_choice(
                index, text, out and out.finish_reason, out and out.stop_reason, logprobs
            )
            return _sse(responses.completion_response(request_id, self.model_name, [choice], None, created=created))

        try:
            for i, echo in enumerate(echoes):
                if echo:
                    yield chunk(i, echo)
            async for i, out in _merged(streams):
                lasts[i], logprobs = out, None
                if out.token_ids:
                    logprobs = self._completion_logprobs(
                        body, out.token_ids, out.logprobs, out.top_logprobs, offsets[i]
                    )
                    if logprobs is not None:
                        offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                if out.text or out.finished or logprobs:
                    yield chunk(i, out.text, out, logprobs)
            if body.include_usage:
                yield _sse(
                    responses.usage_chunk(
                        "text_completion", request_id, self.model_name, _usage(lasts, body.num_choices), created=created
                    )
                )
        except EngineError as error:
            yield _sse(error_body(str(error), "server_error", None, "engine_unavailable"))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------------------------------
    # /v1/chat/completions

    def chat_prompt(self, raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        """The request of a raw body and the token ids of its messages rendered by the chat template with
        its `add_generation_prompt`, `continue_final_message` and `chat_template_kwargs` (a worker
        thread's job). Raises RequestError naming the field: the template's argument it refuses, else
        `messages`."""
        body = protocol.parse_request(ChatCompletionRequest, raw, self.limits)
        self._check_model(body.model)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        arguments = body.chat_template_arguments()
        body.check_streamed_prompt_logprobs()
        try:
            text = self.chat_template.render(messages, **arguments)
            self.limits.check_text(text, "the rendered prompt")
        except ChatTemplateArgumentError as error:
            raise RequestError(str(error), error.param) from None
        except ValueError as error:
            raise RequestError(f"messages: {error}", "messages") from None
        return body, body.truncated(self._encode(text, self.chat_template.add_special_tokens), self.limits.max_length)

    def _chat_logprobs(self, body: ChatCompletionRequest, token_ids, logprobs, top) -> dict | None:
        if not body.logprobs or not token_ids:
            return None
        return responses.chat_logprobs(self.tokenizer, token_ids, logprobs, top)

    async def chat_completions(self, request: Request) -> Response:
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        try:
            raw = await read_body(request, self.max_request_bytes)
            body, prompt = await asyncio.to_thread(self.chat_prompt, raw)
            scores = await asyncio.to_thread(self._prompt_scores, body, [prompt])
            streams = self._submit(body, [prompt], request_id)
        except (RequestError, QueueFull, EngineError, ValueError, TypeError) as error:
            return refusal(error, prompt_param="messages")
        if body.stream:
            return _EventStream(self._chat_events(body, streams, request_id, created), streams)
        try:
            done = await self._collect(streams, request)
        except EngineError as error:
            return refusal(error)
        if done is None:
            return Response(status_code=499)
        choices = [
            responses.chat_choice(
                i,
                "".join(c.text),
                c.last.finish_reason,
                c.last.stop_reason,
                self._chat_logprobs(body, c.token_ids, c.logprobs, c.top_logprobs) if body.logprobs else None,
            )
            for i, c in enumerate(done)
        ]
        usage = _usage([c.last for c in done], body.num_choices)
        asked = body.prompt_logprobs
        prompt_logprobs = None if asked is None else responses.prompt_logprobs(self.tokenizer, prompt, scores[0], asked)
        return JSONResponse(
            responses.chat_response(
                request_id, self.model_name, choices, usage, created=created, prompt_logprobs_=prompt_logprobs
            )
        )

    async def _chat_events(
        self, body: ChatCompletionRequest, streams: list[RequestStream], rid: str, created: int
    ) -> AsyncIterator[str]:
        lasts = [None] * len(streams)
        try:
            for i in range(len(streams)):
                role = {"role": "assistant", "content": ""}
                yield _sse(responses.chat_chunk(rid, self.model_name, role, created=created, index=i))
            async for i, out in _merged(streams):
                lasts[i] = out
                logprobs = self._chat_logprobs(body, out.token_ids, out.logprobs, out.top_logprobs)
                if out.text or out.finished or logprobs:
                    delta = {"content": out.text} if out.text else {}
                    yield _sse(
                        responses.chat_chunk(
                            rid,
                            self.model_name,
                            delta,
                            out.finish_reason,
                            out.stop_reason,
                            logprobs,
                            created=created,
                            index=i,
                        )
                    )
            if body.include_usage:
                yield _sse(
                    responses.usage_chunk(
                        "chat.completion.chunk", rid, self.model_name, _usage(lasts, body.num_choices), created=created
                    )
                )
        except EngineError as error:
            yield _sse(error_body(str(error), "server_error", None, "engine_unavailable"))
        yield "data: [DONE]\n\n"


def build_app(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    metrics: PrometheusMetrics | None = None,
    *,
    chat_template: ChatTemplate | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    limits: PromptLimits | None = None,
) -> FastAPI:
    """The FastAPI app of the endpoints above over `engine` (started and stopped by the caller, see
    `serve`); `chat_template` defaults to the plain one (`ChatTemplate.from_model_dir` reads a
    model's). `max_request_bytes`: the largest request body (bytes, 413 above); `limits`: what a
    prompt may hold before it is tokenized, default `PromptLimits.for_tokenizer(tokenizer,
    engine.engine.max_length)`. Raises ValueError for `max_request_bytes` < 1."""
    if not (isinstance(max_request_bytes, int) and max_request_bytes >= 1):
        raise ValueError(f"max_request_bytes must be an int >= 1 (bytes), got {max_request_bytes!r}")
    limits = limits or PromptLimits.for_tokenizer(tokenizer, engine.engine.max_length, engine.engine.max_logprobs)
    server = _OpenAIServer(engine, tokenizer, model_name, chat_template or ChatTemplate(), max_request_bytes, limits)
    created = int(time.time())
    app = FastAPI(title="mtp-jax", summary="OpenAI-compatible completions with MTP speculative decoding")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):  # FastAPI's 422 as OpenAI's 400
        return refusal(protocol.validation_error(error.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        return _error(error.status_code, str(error.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, error: Exception):  # a bug: still OpenAI's shape
        return _error(500, f"internal error: {type(error).__name__}: {error}", "server_error", code="internal_error")

    # The bodies are read and parsed by the handlers (within limits, off the event loop), not by FastAPI.
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [server.model_card(created)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            return _error(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return server.model_card(created)

    @app.get("/health")
    async def health():
        if engine.is_running:
            return {"status": "ok"}
        return _error(
            503, f"the engine is not running: {engine.error or 'stopped'}", "server_error", code="engine_unavailable"
        )

    if metrics is not None:

        @app.get("/metrics")
        async def prometheus():
            return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one). Raises OSError (address in use, ...)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family)


def serve(
    engine: AsyncEngine,
    tokenizer: Tokenizer,
    model_name: str,
    *,
    metrics: PrometheusMetrics | None = None,
    chat_template: ChatTemplate | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    log_level: str = "info",
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Serves `build_app(...)` with uvicorn until interrupted (Ctrl-C, SIGTERM): on `sock` (default
    `bind(host, port)`), calls `on_listening(url)`, starts the engine thread, and shuts it down at the
    end (in-flight requests get 5 seconds, then are cancelled and aborted). Closes the socket."""
    app = build_app(
        engine, tokenizer, model_name, metrics, chat_template=chat_template, max_request_bytes=max_request_bytes
    )
    sock = bind(host, port) if sock is None else sock
    host = sock.getsockname()[0]
    name = f"[{host}]" if ":" in host else host
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
    engine.start()
    try:
        if on_listening is not None:
            on_listening(f"http://{name}:{sock.getsockname()[1]}")
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sock.close()
