"""The proxy over HTTP: OpenAI-compatible endpoints on a uvicorn server in a background thread.

    server = ProxyServer(proxy, host="127.0.0.1", port=0).start()
    server.base_url          # http://127.0.0.1:<port>/v1  — OPENAI_BASE_URL of the executions
    server.stop()

Endpoints: `POST /v1/chat/completions` and `POST /v1/completions` (streaming or not), `GET /v1/models`,
`GET /health`; with an `admin` object (`gyre proxy`), `/gyre/executions` to open and end executions.
Every /v1 request needs an execution's key as a bearer token (or `x-api-key`); `X-Gyre-Role` may declare
the role of a fresh context. Refusals are OpenAI-style error JSON (`{"error": {message, type, param,
code}}`) with the HTTP status; an unexpected failure is a 500 with a one-line message, never a
traceback. Bodies over `max_request_bytes` are refused (413) before they are read whole. Keys are never
logged (uvicorn's access log is off; Gyre logs execution ids).
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, StreamingResponse

from .recorder import ProxyError

log = logging.getLogger("gyre.proxy")


def _error_response(err: ProxyError):
    return JSONResponse(err.body(), status_code=err.status)


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is refused with 413 (by Content-Length, or while
    it streams in)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_big = ProxyError(413, f"request body over {self.limit} bytes", code="request_too_large")
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error_response(too_big)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    raise _TooBig()
            return msg

        try:
            await self.app(scope, limited, send)
        except _TooBig:
            await _error_response(too_big)(scope, receive, send)


class _TooBig(Exception):
    pass


def make_app(proxy, max_request_bytes: int, admin=None):
    """The ASGI app of `proxy` (a `service.Proxy`); `admin` adds the /gyre/executions API."""
    app = FastAPI(title="Gyre recording proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ProxyError)
    async def _proxy_error(request, err: ProxyError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, err):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error_response(ProxyError(err.status_code, str(err.detail), type=kind))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, err):
        return _error_response(ProxyError(400, "invalid request"))

    @app.exception_handler(Exception)
    async def _unexpected(request, err: Exception):
        log.error("proxy: %s on %s: %s", type(err).__name__, request.url.path, err)
        return _error_response(ProxyError(500, f"internal error ({type(err).__name__})", type="server_error"))

    async def body_of(request: Request, empty: dict | None = None) -> dict:
        """The JSON object of the body (`empty` where there is no body and that is allowed)."""
        try:
            raw = await request.body()
        except _TooBig:
            raise ProxyError(413, f"request body over {max_request_bytes} bytes", code="request_too_large") from None
        if not raw and empty is not None:
            return empty
        try:
            body = json.loads(raw or b"null")
        except ValueError as exc:
            raise ProxyError(400, f"the body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "the request body must be a JSON object")
        return body

    def who(request: Request):
        return proxy.authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        who(request)
        return proxy.models()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "text")

    async def _serve(request: Request, kind: str):
        exe, key_role = who(request)
        body = await body_of(request)
        stream = bool(body.get("stream"))
        exe.admit(proxy.cfg.max_inflight)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        on_tokens = (lambda ids: loop.call_soon_threadsafe(q.put_nowait, ids)) if stream else None
        try:
            start = proxy.chat_call if kind == "chat" else proxy.text_call
            call = start(exe, key_role, request.headers.get("x-gyre-role"), body, on_tokens)
        except BaseException:
            exe.leave()
            raise
        if not stream:
            try:
                result = await asyncio.wrap_future(call.job.future)
                done = proxy.finish(call, result)
            except ProxyError:
                raise
            except Exception as exc:
                raise _engine_error(exc) from None
            finally:
                proxy.end_call(call)
            return JSONResponse(proxy.chat_response(call, done) if kind == "chat" else proxy.text_response(call, done))
        call.job.future.add_done_callback(lambda f: loop.call_soon_threadsafe(q.put_nowait, None))
        return _Stream(_events(call, kind, q, body), lambda: proxy.end_call(call))

    async def _events(call, kind: str, q: asyncio.Queue, body: dict):
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        ident = ("chatcmpl-" if chat else "cmpl-") + call.id

        def chunk(delta: dict | None = None, finish: str | None = None, text: str | None = None, **extra) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["delta"] = delta or {}
            else:
                choice["text"] = text or ""
            payload = {"id": ident, "object": obj, "created": call.created, "model": call.model, "choices": [choice],
                       **extra}
            return f"data: {json.dumps(payload)}\n\n"

        ids: list[int] = []
        sent = ""
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            while True:
                new = await q.get()
                if new is None:
                    break
                ids += new
                text = proxy.visible_text(call, ids, final=False)
                if len(text) > len(sent) and text.startswith(sent):
                    yield chunk({"content": text[len(sent):]}, text=text[len(sent):])
                    sent = text
            try:
                done = proxy.finish(call, call.job.future.result())
            except BaseException as exc:  # noqa: BLE001 - the engine failed: an error event ends the stream
                err = exc if isinstance(exc, ProxyError) else _engine_error(exc)
                yield f"data: {json.dumps(err.body())}\n\n"
                return
            rest = (done["content"] or "") if chat else done["text"]
            if done["tool_calls"]:
                rest = (done["content"] or "") if not sent else ""
            if rest.startswith(sent) and len(rest) > len(sent):
                yield chunk({"content": rest[len(sent):]}, text=rest[len(sent):])
            if done["tool_calls"]:
                yield chunk({"tool_calls": [{"index": i, **tc} for i, tc in enumerate(done["tool_calls"])]})
            yield chunk({}, done["finish_reason"])
            if (body.get("stream_options") or {}).get("include_usage"):
                payload = {"id": ident, "object": obj, "created": call.created, "model": call.model, "choices": [],
                           "usage": done["usage"]}
                yield f"data: {json.dumps(payload)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            proxy.end_call(call)          # a client that went away: the cell stops generating for it

    if admin is not None:
        _admin_routes(app, admin, body_of)
    return _BodyLimit(app, max_request_bytes)


class _Stream(StreamingResponse):
    """A server-sent-event response that runs `cleanup` however it ends — also when the client was gone before
    the first event (the body's generator then never starts, so its own `finally` never runs)."""

    def __init__(self, events, cleanup) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def _engine_error(exc: BaseException) -> ProxyError:
    """What a client is told of a failed call: the kind of failure; the detail goes to the log only."""
    from .pool import CallDropped, PoolStopped

    if isinstance(exc, PoolStopped):
        return ProxyError(503, "the proxy's engines are stopped", type="server_error", code="engine_stopped")
    if isinstance(exc, CallDropped):
        return ProxyError(400, "the call was let go (its execution ended)", code="execution_ended")
    log.error("proxy: a call failed in the engine: %s: %s", type(exc).__name__, exc)
    return ProxyError(500, f"the engine failed ({type(exc).__name__})", type="server_error")


def _admin_routes(app, admin, body_of) -> None:
    """/gyre/executions: open, list, show and end executions (bearer: the admin token)."""
    def check(request: Request) -> None:
        if not admin.authorized(request.headers.get("authorization")):
            raise ProxyError(401, "the /gyre API needs the proxy's admin token as a bearer token",
                             type="authentication_error", code="invalid_admin_token")

    @app.post("/gyre/executions")
    async def open_execution(request: Request):
        check(request)
        return admin.open(await body_of(request, empty={}))

    @app.get("/gyre/executions")
    async def list_executions(request: Request):
        check(request)
        return {"data": admin.list()}

    @app.get("/gyre/executions/{execution_id:path}")
    async def show_execution(execution_id: str, request: Request):
        check(request)
        return admin.show(execution_id)

    @app.post("/gyre/executions/{execution_id:path}/end")
    async def end_execution(execution_id: str, request: Request):
        check(request)
        return await asyncio.to_thread(admin.end, execution_id, await body_of(request, empty={}))


class ProxyServer:
    """uvicorn serving `make_app(proxy)` from a background thread, on a socket bound before it starts."""

    def __init__(self, proxy, host: str = "127.0.0.1", port: int = 0, max_request_bytes: int = 8 << 20,
                 admin=None) -> None:
        self.proxy, self.host = proxy, host
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: without, a response written in two pieces waited ~40 ms on the
        # client's delayed ACK (measured: 44 ms per request on loopback, 0.9 ms with it)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self._app = make_app(proxy, max_request_bytes, admin)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout_s: float = 30.0) -> "ProxyServer":
        import time

        import uvicorn

        config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=60, backlog=2048)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="gyre-proxy", daemon=True)
        self._thread.start()
        deadline = time.time() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.time() > deadline:
                raise RuntimeError(f"the proxy did not start on {self.url}")
            time.sleep(0.01)
        return self

    def alive(self) -> bool:
        """Serving: started, not told to stop, its thread running."""
        return (self._server is not None and not self._server.should_exit and self._thread is not None
                and self._thread.is_alive())

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> "ProxyServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
