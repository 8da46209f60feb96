"""A worker's outputs leave in one OutputBatch a turn, before anything sent after them:
the worker's outbox with its frontend link recorded (no engine). The real path, a worker
process streaming to a real frontend, is every serving e2e test (tests/api)."""
from __future__ import annotations

from types import SimpleNamespace

from splitserve.cluster import protocol as P
from splitserve.cluster.protocol import FaultSpec
from splitserve.cluster.worker.faults import FaultInjector
from splitserve.cluster.worker.worker import Worker


class Link:
    def __init__(self) -> None:
        self.sent: list[P.Message] = []

    def send(self, msg: P.Message) -> bool:
        self.sent.append(P.decode(P.encode(msg)))  # as the frontend would get it
        return True


def bare_worker() -> Worker:
    w = Worker.__new__(Worker)
    w.outbox, w.member, w.stopping = [], Link(), False  # type: ignore[assignment]
    w.spec = SimpleNamespace(outlive_frontend=False, worker_id="both-0")  # type: ignore[assignment]
    return w


def out(rid: str, offset: int = 0) -> P.Output:
    return P.Output(rid, offset, [offset + 1], offset, "x", offset, None, False, None, None, 3, 0)


def test_a_turns_outputs_go_in_one_frame_before_the_next_message() -> None:
    w = bare_worker()
    w.outbox.extend([out("a"), out("b"), out("c")])
    w._send(P.PrefillDone("a", handed_off=True))
    w.outbox.append(out("a", 1))
    w._flush_outputs()
    assert w.member.sent == [  # type: ignore[attr-defined]
        P.OutputBatch([out("a"), out("b"), out("c")]),
        P.PrefillDone("a", handed_off=True), out("a", 1)]
    w._flush_outputs()  # nothing left: nothing sent
    assert len(w.member.sent) == 3  # type: ignore[attr-defined]


def test_a_long_turn_is_sent_in_batches_of_the_limit_in_order() -> None:
    w = bare_worker()
    outs = [out(f"r{i}") for i in range(2 * P.MAX_OUTPUT_BATCH + 1)]
    w.outbox.extend(outs)
    w._flush_outputs()
    sent = w.member.sent  # type: ignore[attr-defined]
    assert [type(m) for m in sent] == [P.OutputBatch, P.OutputBatch, P.Output]
    assert [o for m in sent[:2] for o in m.outputs] + [sent[2]] == outs


def test_what_was_made_before_a_fault_fires_is_sent_before_it_acts() -> None:
    w = bare_worker()
    w.faults = FaultInjector(True)
    w.faults.arm(FaultSpec("error", "generate"))
    w.outbox.append(out("a"))
    assert w._inject(w.faults.fire("generate"), "b")
    sent = w.member.sent  # type: ignore[attr-defined]
    assert sent[0] == out("a") and isinstance(sent[1], P.RequestFailed)
