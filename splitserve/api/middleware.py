"""The outermost layer of every HTTP request: its id, and the last-resort error response."""
from __future__ import annotations

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.api.errors import api_error
from splitserve.api.request_id import (MAX_REQUEST_ID_LEN, is_valid_request_id, label_var,
                                       logger, new_request_id, request_id_var)
from splitserve.errors import InvalidRequestError


class RequestIdMiddleware:
    """Gives each request a server-made id and a label (the client's valid `X-Request-Id`,
    else that id), sets both while the request is served, and returns the label as
    `X-Request-Id` on every response, errors included (api/request_id.py).

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
        request_id = new_request_id(scope["path"])
        label = given if given is not None and valid else request_id
        token, label_token = request_id_var.set(request_id), label_var.set(label)
        if label != request_id:
            logger.info("request %s (the client's X-Request-Id)", request_id)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["X-Request-Id"] = label
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
            label_var.reset(label_token)
