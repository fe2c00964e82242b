"""The HTTP app: OpenAI's chat-completions API over the ChatService.

    POST   /v1/chat/completions   a reply; "stream": true sends it as server-sent events
    GET    /v1/models             the model served, and BASE:NAME per switchable adapter (and /v1/models/{id})
    GET    /health                status, backend, seats taken and busy
    GET    /v1/seats[/{name}]     the seats (cabinlm's own): names, turns, cache occupancy, last turn
    DELETE /v1/seats/{name}       free a seat (its conversation and saved files are forgotten)
    GET    /v1/metrics.json       the live figures: every seat's cache, the process's RSS (metrics.py)
    GET    /metrics               the same in Prometheus' text exposition format
    GET    /                      the page (web/: plain HTML, JS and CSS over the endpoints above;
                                  its files under /static/); --no-ui leaves both out

Every error is OpenAI's JSON error object ({"error": {"message", "type", "param", "code"}}) with a
4xx status when the request is at fault (400 bad request, 404 unknown model / seat / path, 405, 409
seat busy, 413 body too large), 503 when every seat is taken, 500 for a bug (logged with its
traceback). The server keeps serving after any of them. A client that leaves before its request's body
arrived is logged in one line (no answer is sent: nobody is there to read it).

A request's body is decoded and checked (admission.py: what it would feed, by characters and then by
tokens) in a thread of its own before it may claim a seat or take the model; the event loop never
parses, tokenizes or runs the model.

Web stack: Starlette on uvicorn. Starlette is the small ASGI toolkit FastAPI itself is built on:
routing, request streams, and a StreamingResponse that notices a client that went away, which is
what server-sent events need. FastAPI's additions (pydantic request models, OpenAPI pages) would
answer a malformed request with its own 422 "detail" list that every handler would have to rewrite
into OpenAI's error object; schema.py checks requests itself, once, in the words OpenAI clients
expect. uvicorn is the reference ASGI server: HTTP/1.1 through h11 (pure Python, nothing to compile
for a car's CPU), keep-alive, graceful shutdown on SIGTERM. Both are maintained by the Encode /
Kludex projects and pull in only anyio, h11 and click.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio.to_thread
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from cabinlm.contract.errors import CabinlmError
from cabinlm.serve import metrics, replies
from cabinlm.serve.request_error import RequestError, encodable
from cabinlm.serve.service import STOPPING, ChatService, Turn

log = logging.getLogger("cabinlm.serve")

MAX_BODY_BYTES = 64 * 1024 * 1024  # a long history with a few camera frames as data URLs fits
WEB = ("cabinlm.serve", "web")  # the page's files: package data, found wherever the package is installed
# The page runs only its own files: a reply's text that slipped past the page's escaping could run no
# script and load nothing from elsewhere. Frames are shown from data: URLs the page made.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def error_response(e: Exception) -> JSONResponse:
    if isinstance(e, RequestError):
        headers = {"x-should-retry": "false"} if e.status == 503 else None  # the openai client would retry a 503
        return JSONResponse(e.body(), status_code=e.status, headers=headers)
    if isinstance(e, CabinlmError):
        body = {"error": {"message": encodable(str(e)), "type": "server_error", "param": None, "code": None}}
    else:
        body = {"error": {"message": "internal error (see the server log)", "type": "server_error", "param": None,
                          "code": None}}  # fmt: skip
    return JSONResponse(body, status_code=500)


def _errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint's exceptions as OpenAI error objects."""

    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except RequestError as e:
            return error_response(e)
        except ClientDisconnect:  # it sent part of its request and left: nothing failed here
            log.warning("%s %s: the client left before its request arrived whole", request.method, request.url.path)
            return Response(status_code=499)  # nobody reads it; the access log tells what happened
        except CabinlmError as e:
            log.error("%s %s: %s", request.method, request.url.path, e)
            return error_response(e)
        except Exception as e:
            log.exception("%s %s failed", request.method, request.url.path)
            return error_response(e)

    return run


async def read_body(request: Request) -> bytes:
    """The request's body, at most MAX_BODY_BYTES (ClientDisconnect when the client leaves part-way)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(f"the request body is {length} bytes, more than {MAX_BODY_BYTES}", status=413,
                           code="body_too_large")  # fmt: skip
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise RequestError(f"the request body is more than {MAX_BODY_BYTES} bytes", status=413,
                               code="body_too_large")  # fmt: skip
    return bytes(body)


def decode_json(body: bytes) -> Any:
    if not body:
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise RequestError(f"the request body is not valid JSON ({e})", code="invalid_json") from e


async def _stop_when_gone(request: Request, turn: Turn) -> None:
    """Until cancelled: a client that goes away (before its reply starts streaming, or while a
    non-streamed reply is generated) stops its turn at the next token."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            turn.client_gone = True
            turn.cancel()
            return


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class TurnStream(StreamingResponse):
    """Server-sent events of one turn. However the response ends (done, client gone, server stopping),
    the turn is told to stop: a no-op when it is done, the end of the reply when it is not."""

    def __init__(self, turn: Turn, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        self.turn = turn

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.turn.cancel()


async def _events(turn: Turn, cid: str, model: str, created: int,
                  token_bytes: Callable[[int], tuple[str, bytes | None]]) -> AsyncIterator[str]:  # fmt: skip
    request = turn.request
    yield _sse(replies.chunk(cid, model, created, {"role": "assistant", "content": ""}))
    streamed_args: dict[int, str] = {}  # tool calls streamed so far: index -> arguments sent
    pending: list = []  # scores of tokens not yet sent (logprobs): they go with the next chunk
    sent = 0  # scores sent

    def take_scores() -> dict | None:
        """The pending scores as a chunk's logprobs (None where there are none)."""
        nonlocal pending, sent
        if not pending:
            return None
        scores, sent, pending = replies.logprobs(pending, token_bytes), sent + len(pending), []
        return scores

    def with_scores(delta: dict) -> str:
        return _sse(replies.chunk(cid, model, created, delta, scores=take_scores()))

    while True:
        kind, value = await turn.next()
        if kind == "scores":
            pending.extend(value)
        elif kind == "delta":
            yield with_scores({"content": value})
        elif kind == "call":
            piece, index, text = value
            streamed_args[index] = streamed_args.get(index, "") + (text if piece == "args" else "")
            yield with_scores(replies.call_piece(piece, index, text))
        elif kind == "done" and value.cancelled:  # the client is still here: the server is stopping
            yield _sse(STOPPING.body())
            return
        elif kind == "done":
            # the scores of tokens held back (a stop string's start that was not one, a call opener)
            # go with what follows; those of a stop string's own tokens are not returned
            pending = list(value.logprobs[sent:]) if value.logprobs is not None else []
            if value.calls:  # content the opener's hold-back kept, then the calls
                if value.content.startswith(value.streamed) and len(value.content) > len(value.streamed):
                    yield with_scores({"content": value.content[len(value.streamed):]})
                for delta in replies.call_deltas(value, streamed_args):
                    yield with_scores(delta)
            elif request.calls_tools and value.result.reply.startswith(value.streamed) \
                    and len(value.result.reply) > len(value.streamed):
                # a tool call's opener held back, but no call followed it (cut by max_tokens): it is text
                yield with_scores({"content": value.result.reply[len(value.streamed):]})
            yield _sse(replies.final_chunk(cid, model, created, value, take_scores()))
            if request.include_usage:
                usage = replies.usage(value, turn.seat.name)
                yield _sse(replies.chunk(cid, model, created, usage_block=usage))
            yield "data: [DONE]\n\n"
            return
        elif kind == "error":  # after the headers went out: OpenAI's error object as an event
            if not isinstance(value, RequestError):
                log.error("seat %s: the turn failed mid-stream: %r", turn.seat.name, value)
            yield _sse(json.loads(error_response(value).body))
            return


def create_app(service: ChatService, ui: bool = True) -> Starlette:
    """The HTTP app over service; ui: serve the page at / (False: / is a 404)."""
    model_id = service.model_id
    registry = metrics.registry(service)

    @_errors
    async def completions(request: Request) -> Response:
        raw = await read_body(request)
        admitted = await anyio.to_thread.run_sync(lambda: service.admit(decode_json(raw)))
        chat = admitted.request
        turn = await service.start(admitted)
        cid = replies.completion_id()
        watcher = asyncio.create_task(_stop_when_gone(request, turn))
        try:
            kind, value = await turn.next()  # "started" once the prompt is in the cache, or "error"
            if kind == "error" and turn.client_gone:
                return Response(status_code=499)  # stopped while its history was fed: nobody reads it
            if kind == "error":
                raise value
            if chat.stream:
                watcher.cancel()  # from here the streamed response listens for the client itself
                return TurnStream(turn, _events(turn, cid, model_id, int(time.time()), service.token_bytes))
            while kind != "done":
                kind, value = await turn.next()
                if kind == "error":
                    raise value
            if value.cancelled:
                if turn.client_gone:
                    return Response(status_code=499)  # nobody reads it; the access log tells what happened
                raise STOPPING  # the client is still here: the server is stopping
            return JSONResponse(replies.completion(cid, model_id, value, replies.usage(value, turn.seat.name),
                                                   service.token_bytes))  # fmt: skip
        except BaseException:
            turn.cancel()  # this handler is gone (cancelled, or failing): the reply stops at its next token
            raise
        finally:
            watcher.cancel()

    @_errors
    async def models(request: Request) -> Response:
        return JSONResponse(replies.models(service.served, service.started, service.device))

    @_errors
    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if name not in service.served:
            raise RequestError(f"the model {name!r} is not served here; this server serves "
                               f"{', '.join(repr(m) for m in service.served)}", status=404, param="model",
                               code="model_not_found")  # fmt: skip
        return JSONResponse(replies.model(name, service.started, service.device))

    @_errors
    async def health(request: Request) -> Response:
        return JSONResponse(service.health())

    @_errors
    async def seats(request: Request) -> Response:
        listed = [s.describe() for s in service.seats.seats.values()]
        return JSONResponse({"object": "list", "data": listed, "total": service.seats.total,
                             "free": service.seats.total - len(listed)})  # fmt: skip

    @_errors
    async def seat(request: Request) -> Response:
        name = request.path_params["name"]
        if request.method == "DELETE":
            service.free(name)
            return JSONResponse({"name": name, "deleted": True})
        found = service.seats.seats.get(name)
        if found is None:
            raise RequestError(f"no seat is named {name!r} (GET /v1/seats lists them)", status=404,
                               code="seat_not_found")  # fmt: skip
        return JSONResponse(found.describe())

    @_errors
    async def metrics_json(request: Request) -> Response:
        return JSONResponse(metrics.snapshot(service))

    @_errors
    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        what = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}  # fmt: skip
        what = encodable(what.get(exc.status_code, str(exc.detail)))
        body = {"error": {"message": what, "type": "invalid_request_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        await anyio.to_thread.run_sync(service.close)  # replies in flight end at their next token

    routes: list[BaseRoute] = [
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/seats", seats, methods=["GET"]),
        Route("/v1/seats/{name}", seat, methods=["GET", "DELETE"]),
        Route("/v1/metrics.json", metrics_json, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ]
    if ui:
        static = StaticFiles(packages=[WEB])
        index = Path(static.all_directories[0]) / "index.html"

        async def page(request: Request) -> Response:
            return FileResponse(index, headers=PAGE_HEADERS)

        routes += [Route("/", page, methods=["GET"]), Mount("/static", static, name="static")]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)


class _Server(uvicorn.Server):
    """uvicorn's server that, asked to stop (Ctrl-C, SIGTERM), first ends every reply in flight at its
    next token: its client hears at once (an error event, or a 503) and its seat is saved, instead of
    the connection being cut when the graceful-shutdown timeout runs out."""

    def __init__(self, config: uvicorn.Config, service: ChatService) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.stop()
        super().handle_exit(sig, frame)


def run_server(service: ChatService, host: str, port: int, graceful_s: float = 10, ui: bool = True) -> None:
    """Serve until SIGINT / SIGTERM (uvicorn's log on stderr); ui: the page at /."""
    config = uvicorn.Config(create_app(service, ui), host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=graceful_s)  # fmt: skip
    _Server(config, service).run()
