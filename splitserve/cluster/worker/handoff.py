"""The prefill worker's side of a handoff: from `Prefill` to `PrefillDone`.

The frontend sends Prefill to this worker and Generate(await_kv) to the decode worker at
the same time, so the prefill starts at once; the decode worker's plan (where to send the
KV) arrives later, relayed as KVPlan. Whichever comes first:

    plan before the prefill finished  -> KVSender.start: layers stream while they compute
    prefill finished before the plan  -> the KV is held; KVSender.send_held when it comes
    no plan within kv_timeout_s       -> the KV is released unsent
    the transfer ends (either way)    -> PrefillDone(handed_off = the receiver committed)

A peer's prefix (ExportPrefix, `hold_prefix`) is held at once, as a finished prefill's.

Everything here runs on the worker's engine thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from splitserve.engine.engine import LLMEngine
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.sender import KVSender
from splitserve.transfer.transport import TransferState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    namespace: str | None
    deadline: float  # monotonic: release the KV if no plan came by then
    first_token_id: int | None = None  # set when the prefill finished (KV held)
    sending: bool = False  # a transfer was started


class Handoffs:
    def __init__(self, engine: LLMEngine, sender: KVSender) -> None:
        self.engine, self.sender = engine, sender
        self._pending: dict[str, _Pending] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request_id: str, namespace: str | None, kv_timeout_s: float) -> None:
        """A prefill whose KV goes to a decode worker (added with hold_kv=True)."""
        self._pending[request_id] = _Pending(namespace, time.monotonic() + kv_timeout_s)

    def hold_prefix(self, request_id: str, prefix: list[int], namespace: str | None,
                    tenant: str | None, kv_timeout_s: float) -> int:
        """Peer fetch, the holder's side (ExportPrefix): holds the prefix at once (the pool's
        blocks, brought up from the tiers first; nothing computed) and sends it when the
        importer's plan comes, as a finished prefill's KV. Returns the tokens held; less
        than the prefix: nothing is held or sent (the importer then prefills it all)."""
        held = self.engine.hold_prefix(request_id, prefix, namespace=namespace, tenant=tenant)
        if held < len(prefix):
            self.engine.release_kv(request_id)
            return held
        self.add(request_id, namespace, kv_timeout_s)
        # The trailer carries the token after a prefill; an importer of a prefix ignores
        # it (engine.commit_kv), so the prefix's last token stands in.
        self.on_prefilled(request_id, prefix[-1])
        return held

    def on_prefilled(self, request_id: str, first_token_id: int) -> None:
        """The prefill finished and its KV is held: send it now if the plan came."""
        pending = self._pending.get(request_id)
        if pending is not None and not pending.sending:
            pending.first_token_id = first_token_id

    def on_plan(self, request_id: str, plan: TransferPlan) -> None:
        """The decode worker's plan. Raises (SplitserveError, ValueError) when the plan does
        not fit the request; the caller then fails it."""
        pending = self._pending.get(request_id)
        if pending is None or pending.sending:
            return  # aborted, timed out or finished meanwhile: the late plan is moot
        if pending.first_token_id is None:
            self.sender.start(request_id, plan, namespace=pending.namespace)
        else:
            self.sender.send_held(request_id, plan, pending.first_token_id,
                                  namespace=pending.namespace)
        pending.sending = True

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted, or finished for good at its first token): its held
        KV, if any, is released by the caller or the sender."""
        self._pending.pop(request_id, None)

    def end_early(self, request_id: str) -> bool:
        """The request ended at its first token (a stop): True when its held KV is the
        caller's to release (no transfer started; a started one releases it itself)."""
        pending = self._pending.get(request_id)
        if pending is None or pending.sending:
            return False
        del self._pending[request_id]
        self.sender.cancel(request_id)  # as in expire
        return True

    def expire(self, now: float) -> list[str]:
        """Requests whose plan did not come in time: their held KV is released now."""
        expired = [rid for rid, p in self._pending.items()
                   if not p.sending and p.first_token_id is not None and now >= p.deadline]
        for rid in expired:
            logger.warning("no KV plan for request %s within its deadline; releasing its KV",
                           rid)
            del self._pending[rid]
            self.sender.cancel(rid)  # no transfer to stop; drops a fault armed for one
            self.engine.release_kv(rid)
        return expired

    def finished(self, handle: TransferHandle) -> bool:
        """A transfer ended: forget the request; whether the receiver committed the KV."""
        self._pending.pop(handle.request_id, None)
        return handle.poll().state is TransferState.DONE
