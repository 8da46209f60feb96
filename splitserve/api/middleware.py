"""The layers every HTTP request passes before a route, outermost first:

    RequestIdMiddleware   its id and label; turns any exception below into an error response
    AccessMiddleware      keys (api/auth.py), before the body is read
    BodyMiddleware        the whole body, within MAX_BODY_BYTES (413) and the body deadline
                          (408), before any handler parses it

A 413 ends the connection. Closing a socket with unread bytes in it sends a reset, and a client
that writes its whole body before it reads (httpx, requests) then loses the response with it:
so the rest of a too-large body is read and dropped first, up to LINGER_BYTES and LINGER_S
(nginx's lingering close does the same after the response); past those the reset is the
client's lot.
"""
from __future__ import annotations

import asyncio
import contextlib

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.api.errors import BodyTimeout, RequestTooLarge, api_error
from splitserve.api.request_id import (MAX_REQUEST_ID_LEN, is_valid_request_id, label_var,
                                       logger, new_request_id, request_id_var)
from splitserve.errors import InvalidRequestError


MAX_BODY_BYTES = 4 * 1024 * 1024  # a 4 MiB JSON body holds far more than max_model_len
LINGER_BYTES = MAX_BODY_BYTES  # dropped past the limit before a 413, at most
LINGER_S = 2.0


class RequestIdMiddleware:
    """Gives each request a server-made id and a label (the client's valid `X-Request-Id`,
    else that id), sets both while the request is served, and returns the label as
    `X-Request-Id` on every response, errors included (api/request_id.py).

    It runs inside Starlette's ServerErrorMiddleware, so it also turns an exception no
    handler took into a 500 (with the id header, which ServerErrorMiddleware would drop),
    and the inner middlewares' refusals (401, 403, 408, 413) into error responses.
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


class BodyMiddleware:
    """Reads the whole body before the app runs, refusing it past MAX_BODY_BYTES (by its
    Content-Length at once, else as it streams in; FastAPI would turn an error raised while
    it reads the body into a 400) or when it takes longer than `timeout_s` (a client
    trickling bytes must not hold a connection and a task forever)."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body: bytes | None = await _read_body(scope, receive)
        except TimeoutError:
            raise BodyTimeout(f"the request body did not arrive within {self.timeout_s:g} s "
                              "(--body-timeout-s)") from None

        async def receive_body() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message: Message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return message

        await self.app(scope, receive_body, send)


async def _read_body(scope: Scope, receive: Receive) -> bytes:
    """The whole request body; RequestTooLarge past MAX_BODY_BYTES."""
    declared = Headers(scope=scope).get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        if int(declared) <= MAX_BODY_BYTES + LINGER_BYTES:
            await _drop_body(receive, int(declared))
        raise RequestTooLarge(_too_large(int(declared)))
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client left: the handler sees it
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            if message.get("more_body", False):
                await _drop_body(receive, LINGER_BYTES)
            raise RequestTooLarge(_too_large(size))
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


async def _drop_body(receive: Receive, at_most: int) -> None:
    """Reads the rest of a refused body and drops it, up to `at_most` bytes and LINGER_S."""
    dropped = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while dropped < at_most:
                message = await receive()
                dropped += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    return


def _too_large(num_bytes: int) -> str:
    return (f"request body of {num_bytes} bytes or more is over the limit of "
            f"{MAX_BODY_BYTES} bytes")
