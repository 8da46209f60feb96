"""The OpenAI-compatible HTTP app: `build_app(backend, http_config)`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /ready`, `GET /metrics`, and the operator routes of admin.py. Request handling is
    body -> (worker thread: parse, tokenize, template) GenerateRequest (request_builder)
         -> backend.generate -> deltas -> ResponseBuilder -> one JSON body, or SSE chunks
and every failure is an exception that `errors.api_error` turns into an OpenAI error body.
Parsing, tokenizing and template rendering of a body over INLINE_BODY_BYTES run on
`PROMPT_THREADS` threads, not on the event loop, so one huge prompt does not stall every
other stream; a smaller one is prepared on the loop (a thread's round trip costs a request
more than its work: two wake-ups, each waiting for a core the workers hold).
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve.api.admin import add_admin_routes, health_summary
from splitserve.api.auth import TENANT_STATE, Access, AccessMiddleware
from splitserve.api.backend import Backend
from splitserve.api.errors import GenerationError, install_error_handlers
from splitserve.api.logprobs import TokenStrings
from splitserve.api.middleware import BodyMiddleware, RequestIdMiddleware
from splitserve.api.openapi import document_bodies
from splitserve.api.request_builder import (CacheScope, build_chat_request,
                                            build_completion_request, cache_scope,
                                            fields_renamed, parse_body, served_model)
from splitserve.api.request_id import current_request_id, install_request_id_filter, logger
from splitserve.api.response_builder import ChatBuilder, CompletionBuilder, ResponseBuilder
from splitserve.api.schemas import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                    ModelList, StreamOptions)
from splitserve.api.streaming import (DisconnectWatch, EventStreamResponse, close_iterator,
                                      prepend, sse_events)
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.config import HttpConfig

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Threads preparing prompts: the GIL lets the loop run between their bytecodes, and two
# keep a second request moving while one renders a long conversation; more would only
# queue CPU work on this machine's cores.
PROMPT_THREADS = 2
# Bodies up to this are parsed, tokenized and templated on the loop: ~4K tokens of text,
# a couple of milliseconds at most.
INLINE_BODY_BYTES = 16 * 1024
T = TypeVar("T")


def build_app(backend: Backend, http: HttpConfig | None = None) -> FastAPI:
    """The ASGI app serving `backend` (run it with uvicorn through
    `api.http_protocol.uvicorn_config`; pass `splitserve.api.request_id.log_config()` as
    `log_config` to see request ids in logs). `http`: keys, usage details, body deadline."""
    http = http or HttpConfig()
    install_request_id_filter("uvicorn.access", "uvicorn.error")
    app = FastAPI(title="splitserve", description="OpenAI-compatible LLM serving")
    install_error_handlers(app)
    # add_middleware puts each in front of the last: requests pass them bottom-up here.
    app.add_middleware(BodyMiddleware, timeout_s=http.body_timeout_s)
    app.add_middleware(AccessMiddleware, access=Access.from_config(http))
    app.add_middleware(RequestIdMiddleware)
    routes = OpenAIRoutes(backend, with_cached_tokens=http.enable_prompt_tokens_details)
    app.add_api_route("/v1/completions", routes.create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ready", routes.ready, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    add_admin_routes(app, backend)
    document_bodies(app, {"/v1/completions": CompletionRequest,
                          "/v1/chat/completions": ChatCompletionRequest})
    return app


class OpenAIRoutes:
    """The route handlers, over one backend."""

    def __init__(self, backend: Backend, *, with_cached_tokens: bool = False) -> None:
        self.backend = backend
        self.info = backend.model_info
        self.strings = TokenStrings(self.info.tokenizer)
        self.with_cached_tokens = with_cached_tokens
        self._prompt_threads = ThreadPoolExecutor(PROMPT_THREADS,
                                                  thread_name_prefix="splitserve-prompt")

    async def create_completion(self, request: Request) -> Response:
        """OpenAI `POST /v1/completions` (one prompt; vLLM's sampling extensions)."""
        request_id = _request_id()

        def prepare(raw: bytes) -> tuple[CompletionRequest, str, GenerateRequest]:
            body = parse_body(CompletionRequest, raw)
            model = served_model(body.model, self.info)  # 404 before the prompt's checks
            return body, model, build_completion_request(body, request_id,
                                                         _cache_scope(request, body), self.info)
        body, model, generate = await self._prepare(prepare, await request.body())
        builder = CompletionBuilder(request_id, model, int(time.time()), self.strings,
                                    with_logprobs=body.logprobs is not None,
                                    include_usage=_include_usage(body.stream_options),
                                    with_cached_tokens=self.with_cached_tokens)
        return await self._serve(request, generate, builder, bool(body.stream))

    async def create_chat_completion(self, request: Request) -> Response:
        """OpenAI `POST /v1/chat/completions` (text content; vLLM's sampling extensions)."""
        request_id = _request_id()

        def prepare(raw: bytes) -> tuple[ChatCompletionRequest, str, GenerateRequest]:
            body = parse_body(ChatCompletionRequest, raw)
            model = served_model(body.model, self.info)  # 404 before the prompt's checks
            return body, model, build_chat_request(body, request_id,
                                                   _cache_scope(request, body), self.info)
        body, model, generate = await self._prepare(prepare, await request.body())
        builder = ChatBuilder(request_id, model, int(time.time()), self.strings,
                              with_logprobs=bool(body.logprobs),
                              include_usage=_include_usage(body.stream_options),
                              with_cached_tokens=self.with_cached_tokens)
        with fields_renamed({"prompt": "messages"}):  # the backend's prompt checks
            return await self._serve(request, generate, builder, bool(body.stream))

    async def _prepare(self, prepare: Callable[[bytes], T], raw: bytes) -> T:
        """`prepare(raw)`: on the loop for a small body, else on a prompt thread in this
        request's context (its id in logs)."""
        if len(raw) <= INLINE_BODY_BYTES:
            return prepare(raw)
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._prompt_threads, functools.partial(context.run, prepare, raw))

    async def list_models(self) -> ModelList:
        """Every served name, with the context limit (vLLM's `max_model_len`)."""
        names = self.info.served_model_names
        return ModelList(data=[ModelCard(id=name, created=self.info.created, root=names[0],
                                         max_model_len=self.info.max_model_len)
                               for name in names])

    async def health(self) -> JSONResponse:
        """200 with counts of workers and requests; no worker's identity (/admin/health)."""
        return JSONResponse(health_summary(self.backend.health()))

    async def ready(self) -> JSONResponse:
        """200 when every needed worker role is up, else 503 (a readiness probe)."""
        is_ready = self.backend.is_ready()
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    async def metrics(self) -> Response:
        """Prometheus exposition of the backend's splitserve_* metrics."""
        return Response(self.backend.metrics_text(), media_type=PROMETHEUS_CONTENT_TYPE)

    async def _serve(self, request: Request, generate: GenerateRequest,
                     builder: ResponseBuilder, stream: bool) -> Response:
        """Runs the generation, aborting it if the client leaves. Errors before the first
        delta (admission, prompt checks, the queue's deadline) become HTTP errors even when
        streaming; a stream's response starts at its first delta, which the dispatcher sends
        once the request is placed, so the response's head is on the wire during the
        prefill rather than after it (as vLLM's; its first chunk still waits for the first
        token, streaming.sse_events); later errors are events."""
        # DEBUG: a line before the dispatch costs every request ~0.1 ms of its TTFT (its
        # end is logged at INFO by the response builder, its arrival by the access log).
        logger.debug("%s: %d prompt tokens, max_tokens=%s, stream=%s, tenant=%s",
                     request.url.path, len(generate.prompt_token_ids),
                     generate.params.max_tokens, stream, generate.tenant)
        deltas = self.backend.generate(generate)
        watch = DisconnectWatch(request.receive)  # the stream's response closes it
        try:
            if not stream:
                await watch.run(_add_all(deltas, builder))
                watch.close()
                return Response(builder.response().model_dump_json(),
                                media_type="application/json")
            first = await watch.run(_first(deltas))
        except BaseException:
            watch.close()
            await close_iterator(deltas)
            raise
        return EventStreamResponse(sse_events(prepend(first, deltas), builder), watch)


async def _add_all(deltas: AsyncIterator[StreamDelta], builder: ResponseBuilder) -> None:
    async for delta in deltas:
        builder.add(delta)


async def _first(deltas: AsyncIterator[StreamDelta]) -> StreamDelta:
    async for delta in deltas:
        return delta
    raise GenerationError("the backend's stream ended without any output")


def _request_id() -> str:
    request_id = current_request_id()
    assert request_id is not None, "RequestIdMiddleware sets the id before any route runs"
    return request_id


def _cache_scope(request: Request,
                 body: CompletionRequest | ChatCompletionRequest) -> CacheScope:
    """The key's tenant (AccessMiddleware) decides; without keys the client's X-Tenant."""
    return cache_scope(request.scope["state"].get(TENANT_STATE),
                       request.headers.get("x-tenant"), body)


def _include_usage(options: StreamOptions | None) -> bool:
    return options is not None and bool(options.include_usage)
