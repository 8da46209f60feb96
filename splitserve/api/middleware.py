"""The outermost layer of every HTTP request: its id, and the last-resort error response."""
from __future__ import annotations

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.api.errors import api_error
from splitserve.api.request_id import (MAX_REQUEST_ID_LEN, is_valid_request_id, logger,
                                       new_request_id, request_id_var)
from splitserve.errors import InvalidRequestError


class RequestIdMiddleware:
    """Gives each request its id (the client's valid `X-Request-Id`, else a fresh one),
    sets it for logging while the request is served, and returns it as `X-Request-Id` on
    every response, errors included.

    It runs inside Starlette's ServerErrorMiddleware, so it also turns an exception no
    handler took into a 500 (with the id header, which ServerErrorMiddleware would drop).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id")
        valid = given is not None and is_valid_request_id(given)
        request_id = given if given is not None and valid else new_request_id(scope["path"])
        token = request_id_var.set(request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["X-Request-Id"] = request_id
            await send(message)

        try:
            if given is not None and not valid:
                raise InvalidRequestError(
                    f"X-Request-Id must be 1-{MAX_REQUEST_ID_LEN} printable characters; "
                    "send a shorter id or none (the server makes one)", field="X-Request-Id")
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:  # too late for an error response: end the connection
                logger.error("error after the response started", exc_info=exc)
                raise
            await api_error(exc).response()(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)
