"""Which frontend this worker answers to, and as whom: its control link (control.py) and
the changes of either while the engine runs. A new frontend adopts a worker that outlived
the old one (`adopt`, from any thread: the Ray runtime calls it on another actor thread);
a role switch gives it a new identity; both `rejoin` on a fresh link. A link whose sends
time out marks the frontend `gone` (the worker then exits, or waits to be adopted)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.worker.control import FrontendSocket
from splitserve.cluster.worker.spec import WorkerSpec

logger = logging.getLogger(__name__)


class Membership:
    def __init__(self, spec: WorkerSpec, secret: WorkerSecret) -> None:
        self._send_timeout_s = spec.send_timeout_s
        self.link = FrontendSocket(spec.frontend_address, spec.identity, secret,
                                   spec.send_timeout_s)
        self.gone = False  # a send timed out: the frontend is gone or stuck
        self._adoption: tuple[str, WorkerSecret] | None = None
        self._lock = threading.Lock()

    def send(self, msg: P.Message) -> bool:
        """False when the frontend is gone (this send timed out, or an earlier one)."""
        if self.gone:
            return False
        if self.link.send(msg):
            return True
        self.gone = True
        logger.error("the frontend took nothing for %g s", self._send_timeout_s)
        return False

    def receive(self, timeout_s: float, wake_fds: Sequence[int] = ()) -> list[P.Message]:
        return self.link.receive(timeout_s, wake_fds)

    def adopt(self, frontend_address: str, secret: WorkerSecret) -> None:
        """Any thread: join the frontend at `frontend_address` at the next turn."""
        with self._lock:
            self._adoption = (frontend_address, secret)

    def take_adoption(self) -> tuple[str, WorkerSecret] | None:
        with self._lock:
            adoption, self._adoption = self._adoption, None
        return adoption

    def rejoin(self, spec: WorkerSpec, secret: WorkerSecret) -> None:
        """A fresh link for `spec` (another frontend, or another identity); whatever was
        queued on the old one is dropped."""
        self.link.close(linger_ms=0)
        self.link = FrontendSocket(spec.frontend_address, spec.identity, secret,
                                   spec.send_timeout_s)
        self.gone = False

    def close(self) -> None:
        self.link.close()
