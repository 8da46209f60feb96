"""Fixtures for the KV transfer tests: fp32 tiny-Llama engines and a harness that drives a
prefill engine A and a decode engine B from the test thread (both engines' "engine
thread"), while the transfer's own threads move the bytes."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.output import RequestOutput
from splitserve.errors import KVTransferError, TruncatedTransfer
from splitserve.transfer.blob import (PRELUDE, BlobReader, ReplyOutcome, TransferReply,
                                      parse_header)
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.layer_codec import Compression
from splitserve.transfer.mac import FrameMac
from splitserve.transfer.packing import held_blob_frames
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, LayerStreaming
from splitserve.transfer.transport import TransferState, get_transport

TRANSPORTS = ["inproc", "shm", "tcp"]
DEADLINE_S = 30.0  # generous: CI machines are loaded; tests never assert on speed
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(1000, 1037))  # 37 tokens: 2 full blocks of 16 and a partial one


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are microseconds; with 2 OpenMP threads on a loaded 2-core
    machine each op waits on a barrier (measured: 20 steps 1.3 s vs 0.08 s with 1 thread).
    The transfer threads run in Python anyway. Restored for the other test modules."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def engine_defaults() -> dict[str, Any]:
    """Smaller pools than the engine tests: the transfer tests also fill them."""
    return {"dtype": "float32", "debug_invariants": True, "num_blocks": 64}


@dataclasses.dataclass
class Pair:
    """A prefill engine `a` with a KVSender and a decode engine `b` with a KVReceiver."""
    a: LLM
    b: LLM
    sender: KVSender
    receiver: KVReceiver

    def expect(self, rid: str, prompt: list[int], params: SamplingParams, *,
               namespace: str | None = None, timeout_s: float = DEADLINE_S,
               recompute: bool = False) -> TransferPlan:
        self.b.engine.add_request(rid, prompt, params, namespace=namespace, await_kv=True)
        plan = self.receiver.expect(rid, namespace=namespace, timeout_s=timeout_s,
                                    recompute_on_failure=recompute)
        assert plan is not None
        return plan

    def pump(self, *handles: TransferHandle, deadline_s: float = DEADLINE_S) -> None:
        """Steps A and polls both sides until every handle is terminal."""
        deadline = time.monotonic() + deadline_s
        while not all(h.poll().is_terminal for h in handles):
            assert time.monotonic() < deadline, [h.poll() for h in handles]
            outs = self.a.engine.step() if self.a.engine.has_unfinished else []
            self.sender.poll(outs)
            self.receiver.poll()
            if not outs:
                self.receiver.wait(0.005)
        self.sender.poll()  # release the sender's lease of finished transfers
        self.receiver.poll()

    def decode(self, recv: TransferHandle) -> list[int]:
        """B decodes the committed request to the end; all its output token ids."""
        assert recv.poll().state == TransferState.DONE, recv.poll()
        assert recv.output is not None
        tokens = list(recv.output.token_ids)
        while self.b.engine.has_unfinished:
            for out in self.b.engine.step():
                if out.request_id == recv.request_id:
                    tokens = list(out.token_ids)
        return tokens

    def handoff(self, rid: str, prompt: list[int], params: SamplingParams, *,
                compression: Compression = Compression.NONE, namespace: str | None = None,
                streamed: bool = True) -> tuple[list[int], TransferHandle, TransferHandle]:
        """Prefill on A (streaming KV to B), decode on B: B's tokens and both handles."""
        plan = self.expect(rid, prompt, params, namespace=namespace)
        first = dataclasses.replace(params, max_tokens=1)
        self.a.engine.add_request(rid, prompt, first, namespace=namespace, hold_kv=True)
        if streamed:
            send = self.sender.start(rid, plan, namespace=namespace, compression=compression)
        else:
            out = run_to_end(self.a, rid)
            send = self.sender.send_held(rid, plan, out.token_ids[0], namespace=namespace,
                                         compression=compression)
        recv = self.receiver_handle(plan)
        self.pump(send, recv)
        return self.decode(recv), send, recv

    def receiver_handle(self, plan: TransferPlan) -> TransferHandle:
        return self.receiver._imports[plan.transfer_id].handle


def run_to_end(llm: LLM, rid: str) -> RequestOutput:
    out = None
    while llm.engine.has_unfinished:
        for o in llm.engine.step():
            if o.request_id == rid:
                out = o
    assert out is not None and out.finished
    return out


@pytest.fixture
def make_pair(make_llm: Callable[..., LLM]) -> Iterator[Callable[..., Pair]]:
    """`make_pair(transport, a_kwargs=..., b_kwargs=...)`; closes senders/receivers after,
    then checks that no KV block leaked on either side. A's sender streams every prompt
    layer by layer (LayerStreaming.ON) unless `stream_layers` says otherwise."""
    pairs: list[Pair] = []

    def make(transport: str = "inproc", *, a: LLM | None = None, b: LLM | None = None,
             a_kwargs: dict[str, Any] | None = None,
             b_kwargs: dict[str, Any] | None = None,
             stream_layers: LayerStreaming = LayerStreaming.ON) -> Pair:
        a = a or make_llm(**(a_kwargs or {}))
        b = b or make_llm(**(b_kwargs or {}))
        pair = Pair(a, b, KVSender(a.engine, stream_layers=stream_layers),
                    KVReceiver(b.engine, get_transport(transport).listen()))
        pairs.append(pair)
        return pair

    yield make
    for pair in pairs:
        pair.sender.close()
        pair.receiver.close()
        for llm in (pair.a, pair.b):
            assert llm.engine.load().kv_blocks_used == 0, "KV blocks leaked"


# -- driving a receiver by hand with raw frames ------------------------------------------
def prefill_frames(pair: Pair, plan: TransferPlan, prompt: list[int] = PROMPT, *,
                   namespace: str | None = None) -> list[bytes]:
    """Frames of a valid transfer of `plan.request_id`'s KV from A (run alone, held)."""
    pair.a.engine.add_request(plan.request_id, prompt, dataclasses.replace(PARAMS, max_tokens=1),
                              namespace=namespace, hold_kv=True)
    first = run_to_end(pair.a, plan.request_id).token_ids[0]
    frames = held_blob_frames(pair.a.engine, plan, first, namespace=namespace)
    pair.a.engine.release_kv(plan.request_id)
    return frames


def sender_mac(pair: Pair, header_frame: bytes) -> FrameMac | None:
    """What the sender of `header_frame` would check B's replies with: the key of the
    plan B issued for its transfer id (None if B issued none)."""
    try:
        tid = parse_header(header_frame[PRELUDE.size:]).transfer_id
    except KVTransferError:
        return None
    imp, done = pair.receiver._imports.get(tid), pair.receiver._recent.get(tid)
    key = imp.plan.key if imp is not None else done[1] if done is not None else None
    return None if key is None else FrameMac(key, tid)


def deliver(pair: Pair, transport: str, frames: list[bytes], *,
            read_reply: bool = True) -> TransferReply | None:
    """Writes raw frames to B's receiver on a fresh channel (not waiting for the header's
    answer); B's final reply if asked for (checked as the plan's sender would)."""
    mac = sender_mac(pair, frames[0]) if read_reply else None
    chan = get_transport(transport).connect(pair.receiver.address, time.monotonic() + DEADLINE_S)
    try:
        try:
            chan.send(frames, time.monotonic() + DEADLINE_S)
        except TruncatedTransfer:
            pass  # B rejected mid-stream and closed; its reply may still be readable
        if not read_reply:
            return None
        reader = BlobReader(chan, mac)
        reply = reader.read_reply(time.monotonic() + DEADLINE_S)
        if reply.outcome == ReplyOutcome.ACCEPTED:
            reply = reader.read_reply(time.monotonic() + DEADLINE_S)
        return reply
    finally:
        chan.close()


def settle(pair: Pair, handle: TransferHandle) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not handle.poll().is_terminal:
        assert time.monotonic() < deadline, handle.poll()
        pair.receiver.poll()
        time.sleep(0.002)
