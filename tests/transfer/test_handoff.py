"""Prefill on engine A, stream the KV over each transport, decode on engine B: B's tokens
are exactly what A would have generated alone."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.batch import RunnerOutput, ScheduledBatch
from splitserve.errors import KVImportError
from splitserve.transfer.layer_codec import Compression
from splitserve.transfer.sender import LayerStreaming, compute_leaves_cores
from splitserve.transfer.transport import TransferState
from tests.transfer.conftest import TRANSPORTS, Pair, run_to_end

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NUM_LAYERS = 2  # the tiny Llama


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str) -> Iterator[Callable[[list[int], SamplingParams], list[int]]]:
    """Tokens of one engine generating alone (memoized: it is deterministic)."""
    llm = LLM(tiny_llama_dir, dtype="float32", num_blocks=64)
    cache: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), repr(params))
        if key not in cache:
            cache[key] = llm.generate(prompt, params)[0].token_ids
        return cache[key]

    yield generate


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("length", [5, 16, 37])  # 37: not a multiple of the block size
def test_handoff_continues_identically(make_pair: Callable[..., Pair], reference: Callable,
                                       transport: str, length: int) -> None:
    pair = make_pair(transport)
    prompt = list(range(1000, 1000 + length))
    tokens, send, recv = pair.handoff("r", prompt, GREEDY)
    assert tokens == reference(prompt, GREEDY)
    assert send.poll().state == recv.poll().state == TransferState.DONE
    assert send.telemetry.layers_during_compute == NUM_LAYERS  # streamed from the forward
    assert pair.sender.num_released == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prefix_hit_on_receiver_transfers_only_the_rest(make_pair: Callable[..., Pair],
                                                        reference: Callable,
                                                        transport: str) -> None:
    pair = make_pair(transport)
    shared = list(range(3000, 3040))
    pair.b.generate(shared, SamplingParams(max_tokens=2))  # B caches 2 full blocks of `shared`
    prompt = shared + [5, 6, 7, 8, 9]
    tokens, send, _ = pair.handoff("h", prompt, GREEDY)
    assert tokens == reference(prompt, GREEDY)
    assert send.telemetry.num_tokens == 45 - 32  # the plan asked for tokens [32, 45) only


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_seeded_sampling_continues_identically(make_pair: Callable[..., Pair],
                                               reference: Callable, transport: str) -> None:
    pair = make_pair(transport)
    prompt = list(range(2000, 2040))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12,
                            ignore_eos=True)
    tokens, _, _ = pair.handoff("s", prompt, params)
    assert tokens == reference(prompt, params)


def test_chunked_prefill_streams_during_the_last_chunk(make_pair: Callable[..., Pair],
                                                       reference: Callable) -> None:
    pair = make_pair("inproc", a_kwargs={"max_num_batched_tokens": 16})
    prompt = list(range(4000, 4045))  # 3 prefill steps on A
    tokens, send, _ = pair.handoff("c", prompt, GREEDY)
    assert tokens == reference(prompt, GREEDY)
    assert send.telemetry.layers_during_compute == NUM_LAYERS


def steps_by_layer(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Fills, for each step A's runner executes from now on, whether it ran layer by layer
    (the engine handed it a per-layer callback)."""
    per_layer: list[bool] = []
    execute = pair.a.engine.runner.execute

    def noting(batch: ScheduledBatch,
               on_layer_end: Callable[[int], None] | None = None) -> RunnerOutput:
        per_layer.append(on_layer_end is not None)
        return execute(batch, on_layer_end)

    monkeypatch.setattr(pair.a.engine.runner, "execute", noting)
    return per_layer

def test_only_a_step_that_completes_a_streamed_prompt_runs_layer_by_layer(
        make_pair: Callable[..., Pair], reference: Callable,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender hands the engine a per-layer callback for the step that computes a
    streamed prompt's last token and for no other: any other step (another request's, an
    earlier chunk) runs its layers in one call (the exact path's fast form)."""
    pair = make_pair("inproc", a_kwargs={"max_num_batched_tokens": 16})
    per_layer = steps_by_layer(pair, monkeypatch)
    pair.a.generate(list(range(4100, 4120)), SamplingParams(max_tokens=3))  # no transfer
    assert per_layer and not any(per_layer)
    per_layer.clear()
    prompt = list(range(4000, 4045))  # 3 prefill steps on A
    tokens, send, _ = pair.handoff("c", prompt, GREEDY)
    assert per_layer == [False, False, True]
    assert tokens == reference(prompt, GREEDY)
    assert send.telemetry.layers_during_compute == NUM_LAYERS



@pytest.mark.parametrize("transport", TRANSPORTS)
def test_without_layer_streaming_the_kv_leaves_after_the_step(
        make_pair: Callable[..., Pair], reference: Callable, transport: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`LayerStreaming.OFF` (serve's --kv-stream-layers off): the prefill step runs in one
    call and every layer is copied from the held blocks after it; B continues exactly as A
    alone would, and nothing leaks."""
    pair = make_pair(transport, a_kwargs={"max_num_batched_tokens": 16},
                     stream_layers=LayerStreaming.OFF)
    per_layer = steps_by_layer(pair, monkeypatch)
    prompt = list(range(4200, 4245))  # 3 prefill steps on A
    tokens, send, recv = pair.handoff("s", prompt, GREEDY)
    assert per_layer == [False, False, False]
    assert tokens == reference(prompt, GREEDY)
    assert send.poll().state == recv.poll().state == TransferState.DONE
    assert send.telemetry.layers_during_compute == 0
    assert pair.sender.num_released == 1


def test_auto_streaming_sends_after_the_step_when_nothing_else_computes(
        make_pair: Callable[..., Pair], reference: Callable,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`LayerStreaming.AUTO` (the default): A has no other request that computes (one
    awaiting KV computes nothing), so its cores are idle once the step ends: the KV is
    sent after it, the step runs in one call."""
    pair = make_pair("tcp", stream_layers=LayerStreaming.AUTO)
    per_layer = steps_by_layer(pair, monkeypatch)
    prompt = list(range(4300, 4330))
    pair.a.engine.add_request("importing", list(range(4700, 4720)), GREEDY, await_kv=True)
    tokens, send, _ = pair.handoff("alone", prompt, GREEDY)
    pair.a.engine.abort("importing")
    assert per_layer == [False]
    assert tokens == reference(prompt, GREEDY)
    assert send.telemetry.layers_during_compute == 0


def test_auto_streaming_streams_while_other_prompts_wait(
        make_pair: Callable[..., Pair], reference: Callable,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """AUTO with another request live on A (its prompt waits for the next step): the
    transfer would share the cores with that step anyway, so it streams during its own."""
    pair = make_pair("tcp", a_kwargs={"max_num_batched_tokens": 32},
                     stream_layers=LayerStreaming.AUTO)
    per_layer = steps_by_layer(pair, monkeypatch)
    prompt = list(range(4400, 4430))
    plan = pair.expect("first", prompt, GREEDY)
    pair.a.engine.add_request("first", prompt, dataclasses.replace(GREEDY, max_tokens=1),
                              hold_kv=True)
    pair.a.engine.add_request("queued", list(range(4500, 4530)), SamplingParams(max_tokens=2))
    send = pair.sender.start("first", plan)
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert per_layer[0] and send.telemetry.layers_during_compute == NUM_LAYERS
    assert pair.decode(recv) == reference(prompt, GREEDY)
    while pair.a.engine.has_unfinished:  # the queued request, to its end
        pair.a.engine.step()


def test_auto_streaming_streams_when_the_compute_leaves_cores_free(
        make_pair: Callable[..., Pair], reference: Callable) -> None:
    pair = make_pair("inproc", stream_layers=LayerStreaming.AUTO)
    pair.sender.spare_cores = True  # as compute_leaves_cores says on a GPU
    prompt = list(range(4600, 4630))
    tokens, send, _ = pair.handoff("gpu", prompt, GREEDY)
    assert tokens == reference(prompt, GREEDY)
    assert send.telemetry.layers_during_compute == NUM_LAYERS


def test_compute_leaves_cores_counts_threads_against_the_cores() -> None:
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    assert compute_leaves_cores(torch.device("cpu")) == (cores > threads)
    assert compute_leaves_cores(torch.device("cuda"))
    torch.set_num_threads(cores)
    try:
        assert not compute_leaves_cores(torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)


def test_two_requests_stream_from_one_step(make_pair: Callable[..., Pair],
                                           reference: Callable) -> None:
    pair = make_pair("tcp")
    prompts = {"x": list(range(5000, 5021)), "y": list(range(6000, 6050))}
    plans = {rid: pair.expect(rid, p, GREEDY) for rid, p in prompts.items()}
    sends = []
    for rid, prompt in prompts.items():
        pair.a.engine.add_request(rid, prompt, dataclasses.replace(GREEDY, max_tokens=1),
                                  hold_kv=True)
        sends.append(pair.sender.start(rid, plans[rid]))
    recvs = [pair.receiver_handle(plan) for plan in plans.values()]
    pair.pump(*sends, *recvs)
    assert all(s.telemetry.layers_during_compute == NUM_LAYERS for s in sends)
    outputs = {r.request_id: list(r.output.token_ids) for r in recvs if r.output}
    while pair.b.engine.has_unfinished:
        for out in pair.b.engine.step():
            outputs[out.request_id] = list(out.token_ids)
    assert outputs == {rid: reference(p, GREEDY) for rid, p in prompts.items()}


def test_after_the_fact_send_of_held_kv(make_pair: Callable[..., Pair],
                                        reference: Callable) -> None:
    pair = make_pair("shm")
    prompt = list(range(7000, 7030))
    tokens, send, _ = pair.handoff("held", prompt, GREEDY, streamed=False)
    assert tokens == reference(prompt, GREEDY)
    assert send.telemetry.layers_during_compute == 0
    assert pair.sender.num_released == 1


def test_a_missed_stream_falls_back_to_the_held_kv(make_pair: Callable[..., Pair],
                                                   reference: Callable) -> None:
    pair = make_pair("inproc")
    prompt = list(range(7100, 7130))
    plan = pair.expect("late", prompt, GREEDY)
    pair.a.engine.add_request("late", prompt, dataclasses.replace(GREEDY, max_tokens=1),
                              hold_kv=True)
    send = pair.sender.start("late", plan)
    listener, pair.a.engine.layer_listener = pair.a.engine.layer_listener, None
    outs = pair.a.engine.step()  # the prefill ran without the listener: nothing streamed
    pair.a.engine.layer_listener = listener
    pair.sender.poll(outs)  # copies every layer from the held blocks
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert pair.decode(recv) == reference(prompt, GREEDY)
    assert send.telemetry.layers_during_compute == 0


def test_start_needs_a_live_held_request_in_the_right_namespace(
        make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    prompt = list(range(7200, 7220))
    plan = pair.expect("x", prompt, GREEDY)
    pair.a.engine.add_request("x", prompt, dataclasses.replace(GREEDY, max_tokens=1))
    with pytest.raises(KVImportError, match="hold_kv"):
        pair.sender.start("x", plan)  # not added with hold_kv=True
    pair.a.engine.add_request("y", prompt, GREEDY, hold_kv=True, namespace="t1")
    with pytest.raises(ValueError, match="namespace"):
        pair.sender.start("y", dataclasses.replace(plan, request_id="y"))  # says None
    run_to_end(pair.a, "y")
    pair.a.engine.release_kv("y")
    pair.receiver.cancel("x")
    pair.receiver.poll()


def test_int8_compression_cuts_bytes_and_still_decodes(make_pair: Callable[..., Pair],
                                                       reference: Callable) -> None:
    pair = make_pair("tcp")
    prompt = list(range(8000, 8040))
    tokens, send, recv = pair.handoff("q", prompt, GREEDY, compression=Compression.INT8)
    assert send.telemetry.compression == recv.telemetry.compression == "int8"
    fp32_payload = send.telemetry.payload_bytes
    assert recv.telemetry.wire_bytes < fp32_payload / 3  # int8 + per-block scales vs fp32
    expected = reference(prompt, GREEDY)
    assert tokens[0] == expected[0]  # sampled on A from exact KV
    assert len(tokens) == len(expected)  # later tokens may differ: int8 is lossy


def test_telemetry_record(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    _, send, recv = pair.handoff("t", list(range(9000, 9037)), GREEDY)
    nbytes = NUM_LAYERS * 2 * 3 * 16 * 2 * 16 * 4  # layers, K/V, blocks, slots, heads, dim, fp32
    for tel in (send.telemetry, recv.telemetry):
        assert tel.payload_bytes == nbytes
        assert tel.num_tokens == 37 and tel.num_layers == NUM_LAYERS
        assert tel.state == TransferState.DONE and tel.error is None
    assert send.telemetry.wire_bytes == recv.telemetry.wire_bytes > nbytes
    assert send.telemetry.place_s == recv.telemetry.place_s > 0  # merged from the reply
    assert send.telemetry.overlapped_compute
    record = send.telemetry.as_record()
    assert record["side"] == "sender" and record["state"] == "done"
    assert {"pack_s", "queue_s", "wire_s", "validate_s", "place_s", "overlap_s",
            "exposed_s", "wire_bytes"} <= record.keys()


RESUME_PARAMS = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                               repetition_penalty=1.3, frequency_penalty=0.4)


def test_resume_through_a_kv_handoff(make_pair) -> None:
    """The prefill worker computes prompt + resumed tokens and samples the next one; the
    decode worker imports that KV and goes on: the uninterrupted output."""
    pair = make_pair("inproc")
    prompt = list(range(2000, 2037))
    pair.a.engine.add_request("ref", prompt, RESUME_PARAMS)
    full = run_to_end(pair.a, "ref").token_ids
    resumed = full[:6]
    pair.b.engine.add_request("r", prompt, RESUME_PARAMS, await_kv=True, resume_token_ids=resumed)
    plan = pair.receiver.expect("r", timeout_s=30, recompute_on_failure=False)
    assert plan is not None and plan.end_token == len(prompt) + len(resumed)
    one_more = dataclasses.replace(RESUME_PARAMS, max_tokens=len(resumed) + 1)
    pair.a.engine.add_request("r", prompt, one_more, hold_kv=True, resume_token_ids=resumed)
    send = pair.sender.start("r", plan)
    recv = pair.receiver_handle(plan)
    pair.pump(send, recv)
    assert pair.decode(recv) == full


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_consecutive_transfers_share_one_channel(make_pair: Callable[..., Pair],
                                                 reference: Callable, transport: str) -> None:
    pair = make_pair(transport)
    sends = []
    for i in range(3):
        prompt = list(range(100 * i, 100 * i + 21))
        tokens, send, _ = pair.handoff(f"c{i}", prompt, GREEDY)
        assert tokens == reference(prompt, GREEDY)
        sends.append(send)
    assert [s.telemetry.reused_channel for s in sends] == [False, True, True]
