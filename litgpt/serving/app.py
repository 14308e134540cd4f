"""The HTTP layer of `litgpt serve`: a FastAPI app run by uvicorn (an asyncio server: a slow or idle client holds a
coroutine, not a thread).

Every route but /health needs `Authorization: Bearer KEY` when the server has an API key. A request's body must come
whole within --read_timeout and within MAX_BODY_BYTES; its answer within --request_timeout. A client that leaves
(streamed or not) cancels its sequences, which leave the batch before the engine's next pass. Errors have OpenAI's
shape; an error of ours is a 500 that says "internal error" and leaves its traceback in the server's log only.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from litgpt.serving import openai_api as api
from litgpt.serving.generation import Generation, GenerationFailed, RequestTimedOut, Service

MAX_BODY_BYTES = 8 << 20
log = logging.getLogger("litgpt.serve")


@dataclass(frozen=True)
class Limits:
    api_key: Optional[str]
    read_timeout: float


def internal_error() -> api.RequestError:
    return api.RequestError(500, "internal error", type="server_error", code="internal_error")


def timed_out() -> api.RequestError:
    return api.RequestError(408, "The request ran past the server's --request_timeout.", type="timeout_error",
                            code="request_timeout")


def error_response(error: api.RequestError) -> JSONResponse:
    headers = {}
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif error.status == 429:
        headers["Retry-After"] = "1"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_app(service: Service, limits: Limits) -> FastAPI:
    app = FastAPI(title="litgpt serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(api.RequestError, lambda request, error: error_response(error))
    app.add_exception_handler(HTTPException, lambda request, error: error_response(api.RequestError(
        error.status_code, f"No route {request.method} {request.url.path}: see /v1/models."
        if error.status_code in (404, 405) else str(error.detail), code="not_found")))

    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=error)
        return error_response(internal_error())

    app.add_exception_handler(Exception, unexpected)

    @app.get("/health")
    async def health() -> JSONResponse:
        failure = service.failure()
        stats = service.stats()
        body = {"status": "ok" if failure is None else "unavailable", "model": service.name, **stats,
                "requests_in_flight": stats["sequences_in_flight"]}
        if failure is not None:
            body["reason"] = failure
        return JSONResponse(body, status_code=200 if failure is None else 503)

    router = APIRouter(dependencies=[Depends(api_key_check(limits.api_key))])

    @router.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [api.model_card(name, service.created) for name in service.names]}

    @router.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        if name not in service.names:
            raise api.RequestError(404, f"The model {name!r} does not exist: this server serves {service.name!r}.",
                                   code="model_not_found")
        return api.model_card(name, service.created)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await respond(service, limits, request, chat=True)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await respond(service, limits, request, chat=False)

    app.include_router(router)
    return app


def api_key_check(key: Optional[str]):
    async def check(request: Request) -> None:
        if key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
            raise api.RequestError(401, "A valid API key is required: send 'Authorization: Bearer <key>'.",
                                   code="invalid_api_key")

    return check


async def read_body(request: Request, read_timeout: float) -> bytes:
    """The whole body, refused past MAX_BODY_BYTES (413) or when it is not in within `read_timeout` (408)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY_BYTES):
        raise api.RequestError(413, f"The request body must be at most {MAX_BODY_BYTES} bytes.", code="too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(read_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > MAX_BODY_BYTES:
                    raise api.RequestError(413, f"The request body must be at most {MAX_BODY_BYTES} bytes.",
                                           code="too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise api.RequestError(408, f"The request body did not arrive within {read_timeout:g} s (--read_timeout).",
                               code="request_timeout") from None
    return b"".join(chunks)


async def respond(service: Service, limits: Limits, request: Request, chat: bool) -> Response:
    body = api.parse_request(await read_body(request, limits.read_timeout), chat)
    generation, sampling = service.start(body, chat)
    if sampling.stream:
        events = stream_events(generation, sampling, chat, service.name)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await answer(generation, request, chat, service.name)


async def client_gone(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer(generation: Generation, request: Request, chat: bool, name: str) -> Response:
    collect, gone = asyncio.ensure_future(generation.collect()), asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():
            collect.cancel()
        generation.close()
    if not collect.done():  # the client left: nobody reads an answer
        return Response(status_code=499)
    try:
        texts, reasons = collect.result()
    except RequestTimedOut:
        raise timed_out() from None
    except GenerationFailed as error:
        log.error("a request failed: %s", error)
        raise internal_error() from None
    choices = [api.choice(chat, i, texts[i], reasons[i], stream=False) for i in range(len(texts))]
    usage = api.usage(generation.prompt_tokens, generation.completion_tokens)
    return JSONResponse(api.response(chat, api.new_id(chat), name, choices, False, usage))


async def stream_events(generation: Generation, sampling: api.Sampling, chat: bool, name: str) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, a last chunk per choice with its finish_reason, the usage
    (with stream_options.include_usage), then `data: [DONE]`; an error midway is one `data: {"error": ...}` event.
    A client that leaves cancels this generator (Starlette watches for the disconnect), which closes the generation."""
    id, started = api.new_id(chat), set()
    try:
        async for event in generation:
            first = chat and event.index not in started
            started.add(event.index)
            if event.text or first:
                yield sse(api.response(chat, id, name, [
                    api.choice(chat, event.index, event.text, None, stream=True, first=first)], stream=True))
            if event.finish_reason:
                yield sse(api.response(chat, id, name, [
                    api.choice(chat, event.index, None if chat else "", event.finish_reason, stream=True)],
                    stream=True))
        if sampling.include_usage:
            usage = api.usage(generation.prompt_tokens, generation.completion_tokens)
            yield sse(api.response(chat, id, name, [], stream=True, usage=usage))
    except RequestTimedOut:
        yield sse(timed_out().body())
    except GenerationFailed as error:
        log.error("a streamed request failed: %s", error)
        yield sse(internal_error().body())
    finally:
        generation.close()
    yield "data: [DONE]\n\n"


def sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"
