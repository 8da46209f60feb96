"""Typed exceptions. Each message says what went wrong and what to do about it."""
from __future__ import annotations


class SplitserveError(Exception):
    """Base class of every error splitserve raises on purpose."""


class ModelLoadError(SplitserveError):
    """The model path is missing, unreadable, corrupt or of an unsupported architecture."""


class InvalidRequestError(SplitserveError, ValueError):
    """A request (prompt or sampling parameters) is invalid; the message names the field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineDeadError(SplitserveError):
    """The engine loop stopped; no further requests can be served by this engine."""


class KVImportError(SplitserveError):
    """KV offered to the engine does not fit the request it was meant for."""
