"""What the frontend does when part of a request's path fails (DESIGN 7): which failures
are worth another attempt, under which policy.

    failure                                  retried?
    worker died or went silent               yes: resume on other workers
    worker error (not a bad request)         yes
    stage stalled (prefill / decode timeout) yes
    KV transfer failed, timed out, corrupt   --kv-failure-policy: recompute (the decode
                                             worker prefills locally, no round trip),
                                             retry (a new attempt, a new transfer), fail
    invalid request, request deadline        no: the client gets the error
"""
from __future__ import annotations

from splitserve import errors

KV_FAILURE_POLICIES = ("recompute", "retry", "fail")


def _subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


# Error class names a worker reports when a KV transfer or import failed.
TRANSFER_FAILURES = frozenset(c.__name__ for c in _subclasses(errors.KVTransferError)
                              | {errors.KVTransferError, errors.KVImportError})


def is_transfer_failure(kind: str) -> bool:
    return kind in TRANSFER_FAILURES
