"""What a worker tells the frontend besides requests: its KV events (numbered batches, so
a lost one shows as a gap) and its load report, which doubles as the heartbeat (queue,
KV blocks, the steps it ran since the last one as cost-model samples, the requests that
arrived since the last one, prefix-hit totals, its KV listener's counts). A report that
would repeat the last one sent (an idle worker) goes out only once per heartbeat
interval: ten identical reports a second from every worker cost an idle frontend ~2% of
a core."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from splitserve.cluster import protocol as P
from splitserve.engine.engine import LLMEngine
from splitserve.transfer.receiver import KVReceiver


class Reports:
    def __init__(self, interval_s: float, heartbeat_s: float) -> None:
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.last_sent: P.LoadReport | None = None
        self.last_sent_at = 0.0  # monotonic
        self.event_seq = 0  # of the last event batch sent
        self.steps: list[P.StepTiming] = []
        self.num_prompt_tokens = self.num_hit_tokens = 0
        self.next_report = 0.0  # monotonic: when the next load report is due
        self.received: list[str] = []  # request ids taken since the last report sent

    def request_received(self, request_id: str) -> None:
        """A request message (Generate, Prefill, ExportPrefix) was taken: the next report,
        taken after it, counts its load and says so (LoadReport.received)."""
        self.received.append(request_id)

    def step_done(self, engine: LLMEngine) -> None:
        s = engine.last_step
        if s is not None:
            self.steps.append(P.StepTiming(s.num_prefill_tokens, s.num_decode_seqs, s.seconds))

    def events(self, engine: LLMEngine, lose: Callable[[], bool]) -> P.KVEventBatch | None:
        """The engine's new KV events as the next batch, unless `lose()` (asked only when
        there are some: fault injection) says they vanish without a trace (no gap)."""
        events = engine.take_kv_events()
        if not events or lose():
            return None
        self.event_seq += 1
        return P.KVEventBatch(self.event_seq, events)

    def snapshot(self, engine: LLMEngine) -> P.KVSnapshot:
        return P.KVSnapshot(self.event_seq, engine.cached_block_hashes())

    def is_due(self) -> bool:
        return time.monotonic() >= self.next_report

    def load_report(self, engine: LLMEngine, receiver: KVReceiver | None,
                    tiers: list[P.TierUsage]) -> P.LoadReport | None:
        """The report to send now, or None: the same as the last one sent (no step ran,
        nothing changed) and the heartbeat not due yet."""
        load = engine.load()
        report = P.LoadReport(
            num_running=load.num_running, num_waiting=load.num_waiting,
            num_prefilling=load.num_prefilling,
            num_waiting_tokens=load.num_waiting_tokens, num_awaiting_kv=load.num_awaiting_kv,
            kv_blocks_used=load.kv_blocks_used, kv_blocks_total=load.kv_blocks_total,
            steps=self.steps, num_prefix_hit_tokens=self.num_hit_tokens,
            num_prompt_tokens=self.num_prompt_tokens, kv_listener=_listener_stats(receiver),
            tiers=tiers, received=self.received)
        now = time.monotonic()
        self.next_report = now + self.interval_s
        if report == self.last_sent and now < self.last_sent_at + self.heartbeat_s:
            return None
        self.steps, self.received = [], []
        # a repeat is the same load with nothing received since
        self.last_sent, self.last_sent_at = replace(report, received=[]), now
        return report


def _listener_stats(receiver: KVReceiver | None) -> P.KVListenerStats | None:
    if receiver is None:
        return None
    s = receiver.stats
    return P.KVListenerStats(s.held, s.accepted, s.evicted, s.refused, s.timed_out,
                             receiver.num_rejected_headers, receiver.num_forged)
