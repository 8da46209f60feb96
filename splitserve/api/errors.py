"""Exceptions -> OpenAI-format error responses: the one place the HTTP layer does this.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with the
status as `code` (vLLM's format). Expected failures (bad input, overload, timeouts, dead
workers) are logged in one line; anything else is logged with its traceback and reaches the
client only as "internal server error".
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve.api.request_id import current_label, logger
from splitserve.api.schemas import ErrorInfo, ErrorResponse
from splitserve.errors import (AdmissionRejected, InvalidRequestError, RequestTimeout,
                               WorkerFailed)

# Error `type`s, named like the openai client's exception classes.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
# nginx's "client closed request": nobody reads it, but the access log shows what happened.
CLIENT_CLOSED_STATUS = 499
# pydantic names union members in `loc` ("str", "list[int]", ...); they are not field names.
_TYPE_WORDS = {"str", "int", "float", "bool", "none", "list", "dict"}
# Refused before (or while) the body was read: end the connection after the response, so
# h11 closes it instead of discarding the rest of the body for as long as the client sends.
_CLOSE = {"Connection": "close"}


class ModelNotFound(Exception):
    """The request names a model this server does not serve."""

    def __init__(self, model: str, served: Sequence[str]) -> None:
        super().__init__(f"The model `{model}` does not exist; this server serves "
                         f"{', '.join(served)} (see GET /v1/models)")


class GenerationError(Exception):
    """The backend ended a request with finish_reason "error" or broke the stream contract."""


class RequestTooLarge(Exception):
    """The request body is over the server's limit (413; the connection is closed)."""


class BodyTimeout(Exception):
    """The request body did not arrive within `--body-timeout-s` (408; the connection is
    closed, so a slow client cannot go on feeding it)."""


class Unauthorized(Exception):
    """A missing or wrong API or admin key (401)."""


class AdminDisabled(Exception):
    """An /admin/* route on a server started without an admin key (403)."""


class ClientDisconnected(Exception):
    """The client went away before its response was complete; the generation was aborted."""


@dataclass(frozen=True, slots=True)
class ApiError:
    """An error as the client sees it."""
    status: int
    message: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def type(self) -> str:
        if self.status in _TYPES:
            return _TYPES[self.status]
        try:
            return HTTPStatus(self.status).phrase.replace(" ", "").replace("-", "") + "Error"
        except ValueError:
            return "Error"

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.status))

    def response(self) -> Response:
        return JSONResponse(self.body().model_dump(), status_code=self.status,
                            headers=self.headers)


def api_error(exc: BaseException) -> ApiError:
    """What the client is told about `exc`; logs it (with a traceback when unexpected)."""
    error = _classify(exc)
    if error is None:
        logger.error("internal error: %s: %s", type(exc).__name__, exc, exc_info=exc)
        return ApiError(500, f"internal server error (request {current_label()}); "
                             "the server log has the details")
    level = logging.INFO if error.status < 500 else logging.WARNING
    logger.log(level, "%d %s%s: %s", error.status, error.type,
               f" (param {error.param})" if error.param else "", error.message)
    return error


def _classify(exc: BaseException) -> ApiError | None:
    """The ApiError for an expected exception, None for anything else."""
    if isinstance(exc, RequestValidationError):
        return _validation_error(exc.errors())
    if isinstance(exc, RequestTooLarge):
        return ApiError(413, str(exc), headers=dict(_CLOSE))
    if isinstance(exc, BodyTimeout):
        return ApiError(408, str(exc), headers=dict(_CLOSE))
    if isinstance(exc, Unauthorized):
        return ApiError(401, str(exc), headers={"WWW-Authenticate": "Bearer", **_CLOSE})
    if isinstance(exc, AdminDisabled):
        return ApiError(403, str(exc), headers=dict(_CLOSE))
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), exc.field)
    if isinstance(exc, ModelNotFound):
        return ApiError(404, str(exc), "model")
    if isinstance(exc, AdmissionRejected):
        retry_after = str(max(0, math.ceil(exc.retry_after_s)))
        return ApiError(exc.status_code, str(exc), headers={"Retry-After": retry_after})
    if isinstance(exc, RequestTimeout):
        return ApiError(504, f"{exc} (stage: {exc.stage})")
    if isinstance(exc, (WorkerFailed, GenerationError)):
        return ApiError(500, str(exc))
    if isinstance(exc, ClientDisconnected):
        return ApiError(CLIENT_CLOSED_STATUS, str(exc))
    if isinstance(exc, StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return None


def _validation_error(errors: Sequence[Any]) -> ApiError:
    """400 naming the first offending field, e.g. `messages.0.content`."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the request body is not valid JSON: {reason}")
    param = _loc_param(first.get("loc", ()))
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return ApiError(400, message, param)


def _loc_param(loc: Sequence[Any]) -> str | None:
    """pydantic's loc as a dotted field path, without the "body" root or union-member tags."""
    parts: list[str] = []
    for i, part in enumerate(loc):
        if i == 0 and part == "body":
            continue
        if isinstance(part, int):
            parts.append(str(part))
            continue
        if not part.isidentifier() or part in _TYPE_WORDS or part[:1].isupper():
            break
        parts.append(part)
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    """Routes every expected exception through `api_error`. Unexpected ones are caught by
    `RequestIdMiddleware`, which also uses `api_error`."""

    async def handle(request: Request, exc: Exception) -> Response:
        return api_error(exc).response()

    for cls in (RequestValidationError, StarletteHTTPException, InvalidRequestError,
                ModelNotFound, AdmissionRejected, RequestTimeout, WorkerFailed,
                GenerationError, ClientDisconnected):
        app.add_exception_handler(cls, handle)
