"""The two records a worker handles per transfer: the plan the receiver hands to the
sender, and the pollable handle each side gets back."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.engine.output import RequestOutput
from splitserve.errors import KVTransferError
from splitserve.transfer.mac import check_key, new_key
from splitserve.transfer.telemetry import TransferTelemetry
from splitserve.transfer.transport import TransferState, TransferStatus


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """What the decode side asks the prefill side to send, and where (plain data: the
    control plane's codec carries it in KVPlanReady / KVPlan).

    `[start_token, end_token)` is the receiver's import range: a prefix already cached on
    the receiver is not sent again. `timeout_s` bounds the whole transfer on each side.
    `key` authenticates every frame of the transfer (mac.py): made fresh by the receiver
    for each plan, it travels only in the control plane and is never printed.
    """
    transfer_id: str
    request_id: str
    namespace: str | None
    address: str  # the receiver's listener, e.g. "tcp://10.0.0.7:5600"
    start_token: int
    end_token: int
    timeout_s: float
    key: bytes = field(default_factory=new_key, repr=False)

    def __post_init__(self) -> None:
        check_key(self.key)


class TransferHandle:
    """Pollable, thread-safe state of one transfer on one side.

    The first terminal status wins: a late success after a failure (or the reverse) is
    ignored. `output` is the receiver's RequestOutput from `commit_kv` once DONE.
    `on_finish` is called (from the finishing thread) when it becomes terminal.
    """

    def __init__(self, transfer_id: str, request_id: str, telemetry: TransferTelemetry,
                 on_finish: Callable[[], None] | None = None) -> None:
        self.transfer_id, self.request_id = transfer_id, request_id
        self.telemetry = telemetry
        self._on_finish = on_finish
        self.output: RequestOutput | None = None
        self._status = TransferStatus(TransferState.PENDING)
        self._started = time.monotonic()
        self._cond = threading.Condition()

    def poll(self) -> TransferStatus:
        return self._status

    def wait(self, timeout_s: float) -> TransferStatus:
        """Blocks until the transfer is terminal or `timeout_s` passed; the status."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._status.is_terminal:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._status

    def mark_transferring(self) -> None:
        with self._cond:
            if self._status.state == TransferState.PENDING:
                self._status = TransferStatus(TransferState.TRANSFERRING)

    def finish(self, error: KVTransferError | None = None) -> bool:
        """DONE (error None) or FAILED(error); False if already terminal."""
        with self._cond:
            if self._status.is_terminal:
                return False
            state = TransferState.FAILED if error is not None else TransferState.DONE
            self._status = TransferStatus(state, error)
            self.telemetry.state = state
            self.telemetry.error = type(error).__name__ if error is not None else None
            self.telemetry.total_s = time.monotonic() - self._started
            self._cond.notify_all()
        if self._on_finish is not None:
            self._on_finish()
        return True
