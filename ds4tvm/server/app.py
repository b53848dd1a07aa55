"""HTTP routes of `ds4 serve` (Starlette, served by uvicorn): OpenAI chat/completions and
completions, Anthropic messages, models and health. Streaming answers are SSE; while a request
waits in the queue or its prompt is prefilled, keep-alive comments (OpenAI) or ping events
(Anthropic) keep proxies and clients from timing out."""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import sys
import threading

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from . import api
from .api import ApiError, Defaults
from .metrics import metrics_text

MAX_BODY = 16 << 20


class _ClientGone(Exception):
    pass


class _Events:
    """A job's events, read on the event loop with a timeout that never drops one: they wait in a
    deque, and a wait for the next is a bare future and a timer (a task and asyncio.wait per token
    were about a sixth of the loop's time under eight streams)."""

    def __init__(self, loop):
        self.loop, self.items, self._waiter = loop, collections.deque(), None

    def deliver(self, item) -> None:   # on the loop
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next(self, timeout: float):
        if not self.items:
            self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, _settle, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        return self.items.popleft() if self.items else None


def _settle(fut) -> None:
    if not fut.done():
        fut.set_result(None)


class _Inbox:
    """The generation threads' events on their way to one event loop: a thread that finds others
    already waiting adds its own to theirs, so a round of a batched decode wakes the loop once
    (each call_soon_threadsafe is a write to the loop's self-pipe and a pass of the loop)."""

    def __init__(self, loop):
        self.loop, self.lock, self.pending = loop, threading.Lock(), []

    def put(self, events: _Events, item) -> None:
        """Raises RuntimeError when the loop is gone."""
        with self.lock:
            self.pending.append((events, item))
            if len(self.pending) > 1:
                return   # the first of them woke the loop, which has not taken them yet
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self.lock:
                self.pending.clear()
            raise

    def _drain(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for events, item in pending:
            events.deliver(item)


def _sse(obj, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def key_checker(api_key: str | None):
    """check(request) raising a 401 ApiError unless the request carries api_key, as OpenAI clients
    send it (`Authorization: Bearer KEY`) or Anthropic's (`x-api-key: KEY`); compared in constant time."""
    want = api_key.encode() if api_key else None

    def check(request: Request) -> None:
        if want is None:
            return
        auth = request.headers.get("authorization", "")
        given = [auth[7:].strip() if auth[:7].lower() == "bearer " else "", request.headers.get("x-api-key", "")]
        # both compared always, so the time taken does not say which header was close
        ok = [hmac.compare_digest(g.encode(), want) for g in given]
        if not any(ok):
            raise ApiError(401, "invalid or missing API key: send Authorization: Bearer KEY or x-api-key: KEY",
                           code="invalid_api_key")

    return check


def return_large_buffers() -> None:
    """glibc raises its mmap threshold each time a large block is freed; from then on request bodies
    of megabytes are carved from the heap and stay resident (56 MiB after one 14 MiB prompt was
    refused). A fixed 1 MiB threshold gives every large buffer back to the system when it is freed."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD; not glibc: no such function, nothing to do
    except (OSError, AttributeError):
        pass


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:   # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:   # JSON escapes can spell a lone surrogate, which no tokenizer, template or answer can carry
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the request body holds a string that is not valid Unicode ({e.reason})") from None
    return body


def request_logger(log_format: str | None):
    """log(request, status, result=None, message=None): one line per answered request on stderr,
    as text or JSON (log_format "text" | "json"; None: silent)."""
    def log(request: Request, status: int, r=None, message: str | None = None) -> None:
        if log_format is None:
            return
        entry = {"method": request.method, "route": request.url.path, "status": status}
        if r is not None:
            rate = r.completion_tokens / r.seconds if r.seconds > 0 else 0.0
            entry.update(prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                         completion_tokens=r.completion_tokens, seconds=round(r.seconds, 3),
                         tokens_per_second=round(rate, 1), finish_reason=r.finish_reason,
                         **({"accept_rate": r.spec["accept_rate"]} if r.spec and "accept_rate" in r.spec else {}))
        if message is not None:
            entry["error"] = message
        if log_format == "json":
            line = json.dumps(entry, ensure_ascii=True)
        elif r is not None:
            line = (f"{request.method} {request.url.path} {status}: prompt {r.prompt_tokens} (cached "
                    f"{r.cached_tokens}), generated {r.completion_tokens} in {r.seconds:.2f} s "
                    f"({entry['tokens_per_second']} tok/s), finish {r.finish_reason}"
                    + (f", accepted {entry['accept_rate']:.2f}" if "accept_rate" in entry else ""))
        else:
            line = f"{request.method} {request.url.path} {status}" + (f": {message}" if message else "")
        print(f"ds4 serve: {line}", file=sys.stderr, flush=True)

    return log


class _Shape:
    """How one API writes a generation: the answer of a non-streamed request, and a stream's events
    (its head, each piece of text, the end, an error, the keep-alive)."""
    ping = ": keep-alive\n\n"

    def __init__(self, served: str, tok, opts: dict, job):
        self.served, self.tok, self.opts, self.job = served, tok, opts, job

    def head(self) -> list[str]:
        return []

    def error(self, e: ApiError) -> str:
        return _sse(e.openai()) + "data: [DONE]\n\n"


class _OpenAIShape(_Shape):
    """OpenAI's answers: an id of the API's prefix and a creation time, shared by every chunk."""
    prefix = ""

    def __init__(self, *args):
        super().__init__(*args)
        self.rid, self.created = api.new_id(self.prefix), api.now()


class _Chat(_OpenAIShape):
    make_job, prefix = staticmethod(api.chat_job), "chatcmpl-"

    def response(self, r) -> dict:
        return api.chat_response(r, self.rid, self.created, self.served, self.tok)

    def chunk(self, delta, finish=None) -> str:
        return _sse(api.chat_chunk(self.rid, self.created, self.served, delta, finish))

    def head(self) -> list[str]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def text(self, piece: str) -> str:
        return self.chunk({"content": piece})

    def done(self, r):
        if r.tool_calls:
            yield self.chunk({"tool_calls": [dict(c, index=i) for i, c in enumerate(api.openai_tool_calls(r))]})
        yield self.chunk({}, r.finish_reason)
        if self.opts["include_usage"]:
            yield _sse(dict(api.chat_chunk(self.rid, self.created, self.served, {}), choices=[],
                            usage=api.openai_usage(r)))
        yield "data: [DONE]\n\n"


class _Completion(_OpenAIShape):
    make_job, prefix = staticmethod(api.completion_job), "cmpl-"

    def response(self, r) -> dict:
        return api.completion_response(r, self.rid, self.created, self.served, self.tok)

    def text(self, piece: str) -> str:
        return _sse(api.completion_chunk(self.rid, self.created, self.served, piece))

    def done(self, r):
        yield _sse(api.completion_chunk(self.rid, self.created, self.served, "", r.finish_reason))
        if self.opts["include_usage"]:
            yield _sse(dict(api.completion_chunk(self.rid, self.created, self.served, ""), choices=[],
                            usage=api.openai_usage(r)))
        yield "data: [DONE]\n\n"


class _Message(_Shape):
    """Anthropic's messages: text in content block 0 (opened by the first piece), then one block per
    tool call."""
    make_job = staticmethod(api.messages_job)
    ping = _sse({"type": "ping"}, "ping")

    def __init__(self, *args):
        super().__init__(*args)
        self.mid, self.text_open = api.new_id("msg_"), False

    def response(self, r) -> dict:
        return api.message_response(r, self.mid, self.served)

    def error(self, e: ApiError) -> str:
        return _sse(e.anthropic(), "error")

    def head(self) -> list[str]:
        return [_sse({"type": "message_start", "message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.served, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": len(self.job.prompt), "output_tokens": 0}}}, "message_start")]

    def text(self, piece: str) -> str:
        out = ""
        if not self.text_open:
            self.text_open = True
            out = _sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                       "content_block_start")
        return out + _sse({"type": "content_block_delta", "index": 0,
                           "delta": {"type": "text_delta", "text": piece}}, "content_block_delta")

    def done(self, r):
        index = 0
        if self.text_open:
            yield _sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
            index = 1
        for block in api.anthropic_tool_blocks(r):
            yield _sse({"type": "content_block_start", "index": index,
                        "content_block": dict(block, input={})}, "content_block_start")
            yield _sse({"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                       "content_block_delta")
            yield _sse({"type": "content_block_stop", "index": index}, "content_block_stop")
            index += 1
        yield _sse({"type": "message_delta",
                    "delta": {"stop_reason": api.anthropic_stop_reason(r), "stop_sequence": r.stop_sequence},
                    "usage": api.anthropic_usage(r)}, "message_delta")
        yield _sse({"type": "message_stop"}, "message_stop")


class _Routes:
    """The route handlers over one service: generations take one path (generate) whatever API shape
    they answer in."""

    def __init__(self, service, served: str, defaults: Defaults, keepalive: float, log):
        self.service, self.served, self.defaults, self.keepalive, self.log = service, served, defaults, keepalive, log
        self._inbox: _Inbox | None = None

    async def read_body(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it is known to be too large: from its Content-Length,
        or while a chunked one is read, never held whole first."""
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY:
            raise ApiError(413, f"the request body has {size} bytes; at most {MAX_BODY} are accepted")
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > MAX_BODY:
                raise ApiError(413, f"the request body exceeds {MAX_BODY} bytes, the most accepted")
            parts.append(chunk)
        return b"".join(parts)

    async def prepare(self, request: Request, make_job):
        """make_job's (job, options) from the request's JSON. Parsing, rendering the template and
        tokenizing take seconds for a long prompt: they run on a worker thread (tokenizers releases
        the GIL), so one request never holds the event loop, other streams or /health."""
        raw = await self.read_body(request)
        return await asyncio.to_thread(lambda: make_job(parse_json(raw), self.service, self.served, self.defaults))

    def start(self, job) -> _Events:
        loop = asyncio.get_running_loop()
        if self._inbox is None or self._inbox.loop is not loop:
            self._inbox = _Inbox(loop)
        inbox, events = self._inbox, _Events(loop)

        def send(kind, payload):
            try:
                inbox.put(events, (kind, payload))
            except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
                job.cancelled.set()

        job.send = send
        self.service.submit(job)
        return events

    async def generate(self, request: Request, shape_of):
        job, opts = await self.prepare(request, shape_of.make_job)
        shape = shape_of(self.served, self.service.tok, opts, job)
        events = self.start(job)
        if not opts["stream"]:
            return JSONResponse(shape.response(await self.result(request, job, events)))
        return StreamingResponse(self.stream(request, job, events, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def result(self, request: Request, job, events: _Events):
        """Waits for a non-streamed job; a client that goes away cancels it."""
        try:
            while True:
                ev = await events.next(1.0)
                if ev is None:
                    if await request.is_disconnected():
                        raise _ClientGone()
                    continue
                kind, payload = ev
                if kind == "done":
                    self.log(request, 200, payload)
                    return payload
                if kind == "error":
                    status, message = payload
                    raise ApiError(status, message, kind="server_error" if status >= 500 else "invalid_request_error")
        finally:
            job.cancelled.set()

    async def stream(self, request: Request, job, events: _Events, shape: _Shape):
        try:
            for h in shape.head():
                yield h
            while True:
                ev = await events.next(self.keepalive)
                if ev is None:
                    yield shape.ping
                    continue
                kind, payload = ev
                if kind == "text":
                    yield shape.text(payload)
                elif kind == "done":
                    for part in shape.done(payload):
                        yield part
                    self.log(request, 200, payload)
                    return
                else:
                    status, message = payload
                    yield shape.error(ApiError(status, message, kind="server_error"))
                    return
        finally:  # finished, or the client disconnected mid-stream: stop generating
            job.cancelled.set()

    async def chat_completions(self, request: Request):
        return await self.generate(request, _Chat)

    async def completions(self, request: Request):
        return await self.generate(request, _Completion)

    async def messages(self, request: Request):
        return await self.generate(request, _Message)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.served, "object": "model", "created": api.now(),
                                                         "owned_by": "ds4tvm"}]})

    async def health(self, request: Request):
        s = self.service
        return JSONResponse({"status": "ok", "queued": s.jobs.qsize(), "running": s.running,
                             "parallel": s.parallel, "busy": s.running > 0})

    async def metrics(self, request: Request):
        return PlainTextResponse(metrics_text(self.service), media_type="text/plain; version=0.0.4")

    async def props(self, request: Request):
        s, d = self.service, self.defaults
        return JSONResponse({"model": self.served, "family": s.engine.manifest.family, "n_ctx": s.ctx,
                             "target": s.engine.manifest.target_name,
                             "drafter": s.drafter.NAME if s.drafter is not None else None,
                             "default_sampling": {"temperature": d.temperature, "top_p": d.top_p,
                                                  "top_k": d.top_k, "min_p": d.min_p}})

    def answered(self, make):
        """A route answered at once (no generation): JSON from make(body, service, served, defaults)."""
        async def route(request: Request):
            out = await self.prepare(request, make)
            self.log(request, 200)
            return JSONResponse(out)
        return route

    def error_body(self, request: Request, e: ApiError) -> JSONResponse:
        self.log(request, e.status, message=e.message[:200])
        anthropic = request.url.path.startswith("/v1/messages")
        return JSONResponse(e.anthropic() if anthropic else e.openai(), status_code=e.status)

    def exception_handlers(self) -> dict:
        async def on_api_error(request: Request, e: ApiError):
            return self.error_body(request, e)

        async def on_http_error(request: Request, e: HTTPException):
            return self.error_body(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))

        async def on_client_gone(request: Request, e: _ClientGone):
            return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)

        async def on_crash(request: Request, e: Exception):
            return self.error_body(request, ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                                     kind="server_error"))

        return {ApiError: on_api_error, HTTPException: on_http_error, _ClientGone: on_client_gone,
                Exception: on_crash}


def create_app(service, served: str, defaults: Defaults | None = None, keepalive: float = 5.0,
               api_key: str | None = None, log_format: str | None = None,
               cors_origins: tuple[str, ...] = ()) -> Starlette:
    """api_key: when set, every /v1 route needs it (key_checker); /health stays open. log_format:
    one line per request ("text" | "json"; None: none). cors_origins: origins a browser page may
    call from ("*": any)."""
    return_large_buffers()
    r = _Routes(service, served, defaults or Defaults(), keepalive, request_logger(log_format))
    check_key = key_checker(api_key)

    def guarded(handler):
        async def route(request: Request):
            check_key(request)
            return await handler(request)
        return route

    routes = [
        Route("/v1/models", guarded(r.models), methods=["GET"]),
        Route("/health", r.health, methods=["GET"]),
        Route("/v1/chat/completions", guarded(r.chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(r.completions), methods=["POST"]),
        Route("/v1/messages", guarded(r.messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(r.answered(api.count_tokens)), methods=["POST"]),
        Route("/tokenize", guarded(r.answered(api.tokenize)), methods=["POST"]),
        Route("/detokenize", guarded(r.answered(api.detokenize)), methods=["POST"]),
        Route("/props", guarded(r.props), methods=["GET"]),
        Route("/metrics", guarded(r.metrics), methods=["GET"]),
    ]
    middleware = []
    if cors_origins:
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware

        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["*"]))
    return Starlette(routes=routes, middleware=middleware, exception_handlers=r.exception_handlers())
