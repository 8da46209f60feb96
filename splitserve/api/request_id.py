"""Request ids: the server makes every request's id; a client's `X-Request-Id` is a label.

The server-made id (`cmpl-<hex>`, ...) is the request's key everywhere inside: the
response `id`, the cluster's request id and the attempt ids made from it. A client cannot
choose it, so no client can name another request (or one of its retried attempts). The
client's `X-Request-Id`, when valid, is only echoed back and stamped on log lines; without
one the label is the server-made id.

Both live in contextvars, set by the middleware before any handler runs; tasks started
while serving (streaming, the cluster's own work) copy them, so `RequestIdFilter` can put
the label on every log record made on the request's behalf, uvicorn's access lines
included.
"""
from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar
from typing import Any

MAX_REQUEST_ID_LEN = 128

request_id_var: ContextVar[str | None] = ContextVar("splitserve_request_id", default=None)
label_var: ContextVar[str | None] = ContextVar("splitserve_request_label", default=None)

# Every module of the HTTP layer logs here, so one filter covers them all.
logger = logging.getLogger("splitserve.api")

# Generated ids follow OpenAI's prefixes so the response `id` looks like theirs.
_PREFIXES = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-"}


def new_request_id(path: str) -> str:
    """A fresh id for a request to `path` (`cmpl-<hex>`, `chatcmpl-<hex>`, else `req-<hex>`)."""
    return _PREFIXES.get(path.rstrip("/"), "req-") + uuid.uuid4().hex


def is_valid_request_id(value: str) -> bool:
    """A client-chosen id must be 1-128 printable characters (it is echoed and logged)."""
    return 0 < len(value) <= MAX_REQUEST_ID_LEN and value.isprintable()


def current_request_id() -> str | None:
    """The server-made id of the request this code runs for, or None outside a request."""
    return request_id_var.get()


def current_label() -> str | None:
    """What the client calls the request (its X-Request-Id, else the server-made id)."""
    return label_var.get()


class RequestIdFilter(logging.Filter):
    """Sets `record.request_id` to the current request's label (`-` outside a request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = label_var.get() or "-"
        return True


def install_request_id_filter(*logger_names: str) -> None:
    """Adds one `RequestIdFilter` to each named logger (idempotent).

    A logger's filters see only the records made on that very logger, so this covers
    `splitserve.api` and uvicorn's loggers; `log_config()` puts the filter on the handler
    instead, which covers every record (the cluster's too).
    """
    for name in ("splitserve.api", *logger_names):
        target = logging.getLogger(name)
        if not any(isinstance(f, RequestIdFilter) for f in target.filters):
            target.addFilter(RequestIdFilter())


def log_config(level: str = "INFO") -> dict[str, Any]:
    """A `logging.config.dictConfig` (pass it as uvicorn's `log_config`) whose lines carry
    the request id: `2025-01-01 12:00:00 INFO uvicorn.access [chatcmpl-...] 127.0.0.1 - ...`."""
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "default",
        "filters": ["request_id"],
        "stream": "ext://sys.stderr",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {
            "default": {
                "format": "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"},
        },
        "handlers": {"default": handler},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level, "propagate": False},
            "splitserve": {"handlers": ["default"], "level": level, "propagate": False},
        },
    }
