"""The OpenAI-compatible HTTP app: `build_app(backend)`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`,
`GET /ready`, `GET /metrics`, and the operator routes of admin.py. Request handling is
    body -> GenerateRequest (request_builder) -> backend.generate -> deltas
         -> ResponseBuilder -> one JSON body, or SSE chunks (streaming)
and every failure is an exception that `errors.api_error` turns into an OpenAI error body.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve.api.admin import add_admin_routes
from splitserve.api.backend import Backend
from splitserve.api.errors import GenerationError, install_error_handlers
from splitserve.api.logprobs import TokenStrings
from splitserve.api.middleware import RequestIdMiddleware
from splitserve.api.request_builder import (build_chat_request, build_completion_request,
                                            fields_renamed, served_model, tenant_of)
from splitserve.api.request_id import current_request_id, install_request_id_filter, logger
from splitserve.api.response_builder import ChatBuilder, CompletionBuilder, ResponseBuilder
from splitserve.api.schemas import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                    ModelList, StreamOptions)
from splitserve.api.streaming import (EventStreamResponse, close_iterator, prepend,
                                      sse_events, until_disconnect)
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def build_app(backend: Backend) -> FastAPI:
    """The ASGI app serving `backend` (run it with uvicorn; pass
    `splitserve.api.request_id.log_config()` as `log_config` to see request ids in logs)."""
    install_request_id_filter("uvicorn.access", "uvicorn.error")
    app = FastAPI(title="splitserve", description="OpenAI-compatible LLM serving")
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)
    routes = OpenAIRoutes(backend)
    app.add_api_route("/v1/completions", routes.create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/models", routes.list_models, methods=["GET"])
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/ready", routes.ready, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    add_admin_routes(app, backend)
    return app


class OpenAIRoutes:
    """The route handlers, over one backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.info = backend.model_info
        self.strings = TokenStrings(self.info.tokenizer)

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response:
        """OpenAI `POST /v1/completions` (one prompt; vLLM's sampling extensions)."""
        model = served_model(body.model, self.info)
        request_id = _request_id()
        generate = build_completion_request(body, request_id, _tenant(request, body), self.info)
        builder = CompletionBuilder(request_id, model, int(time.time()), self.strings,
                                    with_logprobs=body.logprobs is not None,
                                    include_usage=_include_usage(body.stream_options))
        return await self._serve(request, generate, builder, bool(body.stream))

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     request: Request) -> Response:
        """OpenAI `POST /v1/chat/completions` (text content; vLLM's sampling extensions)."""
        model = served_model(body.model, self.info)
        request_id = _request_id()
        generate = build_chat_request(body, request_id, _tenant(request, body), self.info)
        builder = ChatBuilder(request_id, model, int(time.time()), self.strings,
                              with_logprobs=bool(body.logprobs),
                              include_usage=_include_usage(body.stream_options))
        with fields_renamed({"prompt": "messages"}):  # the backend's prompt checks
            return await self._serve(request, generate, builder, bool(body.stream))

    async def list_models(self) -> ModelList:
        """Every served name, with the context limit (vLLM's `max_model_len`)."""
        names = self.info.served_model_names
        return ModelList(data=[ModelCard(id=name, created=self.info.created, root=names[0],
                                         max_model_len=self.info.max_model_len)
                               for name in names])

    async def health(self) -> JSONResponse:
        """200 with the backend's health summary (its exception's status otherwise)."""
        return JSONResponse(self.backend.health())

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
        delta (admission, prompt checks) become HTTP errors even when streaming."""
        logger.info("%s: %d prompt tokens, max_tokens=%s, stream=%s, tenant=%s",
                    request.url.path, len(generate.prompt_token_ids),
                    generate.params.max_tokens, stream, generate.tenant)
        deltas = self.backend.generate(generate)
        try:
            if not stream:
                await until_disconnect(request.receive, _add_all(deltas, builder))
                return Response(builder.response().model_dump_json(),
                                media_type="application/json")
            first = await until_disconnect(request.receive, _first(deltas))
        except BaseException:
            await close_iterator(deltas)
            raise
        return EventStreamResponse(sse_events(prepend(first, deltas), builder))


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


def _tenant(request: Request, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    return tenant_of(request.headers.get("x-tenant"), body)


def _include_usage(options: StreamOptions | None) -> bool:
    return options is not None and bool(options.include_usage)
