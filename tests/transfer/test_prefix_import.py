"""Peer fetch at the engine boundary: engine B imports only a prompt *prefix* that engine A
holds (`kv_prefix_end`), then prefills the rest itself. B's tokens are exactly what one
engine generates alone, the imported prefix counts as cached, and a failed import falls
back to a full local prefill."""
from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from splitserve import LLM, SamplingParams
from splitserve.errors import InvalidRequestError
from splitserve.transfer.handle import TransferHandle
from splitserve.transfer.transport import TransferState
from tests.transfer.conftest import TRANSPORTS, Pair, run_to_end

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
EXPORT = SamplingParams(temperature=0, max_tokens=1)  # what a holder runs to export


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> Iterator[Callable[[list[int]], list[int]]]:
    llm = LLM(tiny_llama_dir, dtype="float32", num_blocks=64)
    yield lambda prompt: llm.generate(prompt, GREEDY)[0].token_ids


def fetch_prefix(pair: Pair, rid: str, prompt: list[int], end: int,
                 streamed: bool = False) -> tuple[TransferHandle, TransferHandle]:
    """B awaits tokens [.., end) of `prompt`; A, which cached `prompt` earlier, holds its
    prefix without computing it and sends it (`streamed`: A prefills the prefix as a
    one-token request instead, the KV leaving layer by layer)."""
    pair.b.engine.add_request(rid, prompt, GREEDY, await_kv=True, kv_prefix_end=end)
    plan = pair.receiver.expect(rid, timeout_s=30.0, recompute_on_failure=True)
    assert plan is not None and plan.end_token == end
    if streamed:
        pair.a.engine.add_request(rid, prompt[:end], EXPORT, hold_kv=True)
        send = pair.sender.start(rid, plan)
    else:
        assert pair.a.engine.hold_prefix(rid, prompt[:end]) == end
        assert not pair.a.engine.has_unfinished  # nothing was queued or computed
        send = pair.sender.send_held(rid, plan, prompt[end - 1])
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    return send, recv


def finish_on_b(pair: Pair, rid: str) -> tuple[list[int], int]:
    tokens, cached = [], -1
    while pair.b.engine.has_unfinished:
        for out in pair.b.engine.step():
            if out.request_id == rid:
                tokens, cached = list(out.token_ids), out.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefix_import_then_local_prefill_is_identical(make_pair: Callable[..., Pair],
                                                       reference: Callable,
                                                       transport: str) -> None:
    pair = make_pair(transport)
    prompt = list(range(2000, 2045))  # 2 full blocks and 13 tokens
    pair.a.generate(prompt, SamplingParams(max_tokens=1))  # A caches the prompt
    send, recv = fetch_prefix(pair, "p", prompt, 32)
    assert send.poll().state == recv.poll().state == TransferState.DONE
    assert recv.output is None  # no token came with the prefix: B samples token 1 itself
    assert send.telemetry.num_tokens == 32
    tokens, cached = finish_on_b(pair, "p")
    assert tokens == reference(prompt)
    assert cached == 32  # the peer's prefix is a cache hit
    assert pair.sender.num_released == 1


def test_prefix_computed_by_the_holder_streams_too(make_pair: Callable[..., Pair],
                                                   reference: Callable) -> None:
    pair = make_pair("tcp")
    prompt = list(range(2100, 2150))
    send, recv = fetch_prefix(pair, "h", prompt, 48, streamed=True)
    assert recv.poll().state == TransferState.DONE
    assert finish_on_b(pair, "h") == (reference(prompt), 48)


def test_local_hit_shortens_the_prefix_import(make_pair: Callable[..., Pair],
                                              reference: Callable) -> None:
    pair = make_pair("inproc")
    prompt = list(range(2200, 2250))
    pair.a.generate(prompt, SamplingParams(max_tokens=1))
    pair.b.generate(prompt[:20], SamplingParams(max_tokens=1))  # B caches block 0
    send, _ = fetch_prefix(pair, "l", prompt, 48)
    assert send.telemetry.num_tokens == 32  # [16, 48): block 0 was B's own
    assert finish_on_b(pair, "l") == (reference(prompt), 48)


def test_failed_prefix_import_recomputes_everything(make_pair: Callable[..., Pair],
                                                    reference: Callable) -> None:
    pair = make_pair("inproc")
    prompt = list(range(2300, 2340))
    pair.b.engine.add_request("f", prompt, GREEDY, await_kv=True, kv_prefix_end=32)
    plan = pair.receiver.expect("f", timeout_s=30.0, recompute_on_failure=True)
    assert plan is not None
    pair.receiver.cancel("f")  # the holder is gone: nothing will come
    [handle] = pair.receiver.poll()
    assert handle.poll().state == TransferState.FAILED
    tokens, cached = finish_on_b(pair, "f")
    assert tokens == reference(prompt)
    assert cached == 0
    assert pair.b.engine.load().kv_blocks_used == 0


@pytest.mark.parametrize("end, await_kv", [(0, True), (20, True), (48, True), (16, False)])
def test_prefix_end_is_checked(make_llm: Callable[..., LLM], end: int, await_kv: bool) -> None:
    llm = make_llm(dtype="float32")
    with pytest.raises(InvalidRequestError) as exc:
        llm.engine.add_request("x", list(range(48)), GREEDY, await_kv=await_kv,
                               kv_prefix_end=end)
    assert exc.value.field == "kv_prefix_end"
    assert not llm.engine.request_ids()


def test_holder_holds_only_what_it_cached(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    engine = pair.a.engine
    prompt = list(range(2400, 2470))
    assert engine.hold_prefix("none", prompt[:64]) == 0  # nothing cached: nothing held
    pair.a.generate(prompt[:40], SamplingParams(max_tokens=1))  # 2 full blocks cached
    assert engine.hold_prefix("part", prompt[:64]) == 32
    assert engine.export_kv("part").end_token == 32
    with pytest.raises(InvalidRequestError):
        engine.hold_prefix("part", prompt[:64])  # the id is in use while held
    assert engine.load().kv_blocks_used == 2
    engine.release_kv("part")
    assert engine.load().kv_blocks_used == 0
    assert engine.request_ids() == []
