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


class StepFailed(SplitserveError):
    """An engine step raised: the requests it computed were ended (FINISHED_ERROR, their
    blocks freed, nothing they computed cached) and the engine serves on. The cause is
    this exception's __cause__."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class KVImportError(SplitserveError):
    """KV offered to the engine does not fit the request it was meant for."""


class KVTransferError(SplitserveError):
    """A KV transfer failed; nothing it carried was committed (DESIGN.md 4.3, 7)."""


class FingerprintMismatch(KVTransferError):
    """The KV comes from an engine with another model fingerprint (model, KV dtype, block
    size, weights or KV format); it can never be used by this engine."""


class HeaderMismatch(KVTransferError):
    """The blob's header does not describe the import the receiver expects (other request,
    namespace, token range, block hashes or layout)."""


class BlobFormatError(KVTransferError):
    """The byte stream is not a well-formed KV blob of a supported format version."""


class ChecksumMismatch(KVTransferError):
    """A frame's bytes do not match their checksum: corrupted in transit or in memory."""


class TruncatedTransfer(KVTransferError):
    """The stream ended (peer closed or died) before the transfer was complete."""


class TransferTimeout(KVTransferError):
    """A transfer stage passed its deadline (or the sender's lease expired)."""


class TransferRejected(KVTransferError):
    """The receiver refused the transfer; `remote_kind` names the receiver's error class."""

    def __init__(self, message: str, remote_kind: str | None = None) -> None:
        super().__init__(message)
        self.remote_kind = remote_kind


class TransferCancelled(KVTransferError):
    """The transfer was cancelled locally (request aborted, endpoint closed)."""


class StoreError(SplitserveError):
    """The KV store (host, disk or peer tier below the engine pool) cannot do what was
    asked: an unusable disk directory, a payload of the wrong size, a store closed or busy
    past its deadline. The message says which and what to do."""


class AdmissionRejected(SplitserveError):
    """The cluster is over its budget and the admission queue is full (HTTP 429) or no
    worker can take the request at all (HTTP 503). Retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float, status_code: int = 429) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.status_code = status_code


class RequestTimeout(SplitserveError):
    """A request passed its deadline or a stage timeout (queue, prefill, transfer, decode);
    `stage` names which. It was aborted on every worker and its blocks freed."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


class WorkerFailed(SplitserveError):
    """A worker holding the request died or reported an error it could not recover from."""


class ProtocolError(SplitserveError):
    """A process message is malformed, of an unknown kind, or from an unknown sender."""


class LayoutProfileError(SplitserveError):
    """Measuring the engine's cost curves for `--mode auto` failed or passed its deadline;
    the message says why (choose the layout with --mode agg|disagg)."""
