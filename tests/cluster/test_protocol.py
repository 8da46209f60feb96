"""Process messages: every kind round-trips; malformed frames, nested fields included,
raise ProtocolError and nothing else."""
from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitserve.cluster import protocol as P
from splitserve.engine.batch import SampledToken
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import ProtocolError
from splitserve.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored
from splitserve.transfer.handle import TransferPlan
from splitserve.transfer.telemetry import TransferSide, TransferTelemetry
from splitserve.transfer.transport import TransferState

H1, H2 = b"\x01" * 16, b"\x02" * 16
PLAN = TransferPlan("t1", "r1", "ns", "tcp://127.0.0.1:1", 16, 40, 30.0)
TELEMETRY = TransferTelemetry("t1", "r1", "tcp", TransferSide.SENDER, wire_bytes=10,
                              pack_s=0.5, state=TransferState.FAILED, error="TransferTimeout")
MESSAGES: list[P.Message] = [
    P.Generate("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["\n"], seed=7), "ns",
               await_kv=True, kv_timeout_s=30.0, recompute_on_failure=True,
               resume_token_ids=[9, 8], tenant="acme"),
    P.Generate("r2", list(range(40)), SamplingParams(), None, await_kv=True, kv_timeout_s=5.0,
               recompute_on_failure=True, kv_prefix_end=32),
    P.Prefill("r1", [1, 2], SamplingParams(max_tokens=4), None, 5.0, [9], "acme"),
    P.KVPlan("r1", PLAN),
    P.InjectFault(P.FaultSpec("kill", "decode", after=3)), P.CheckPool(7),
    P.PoolReport(7, False, "AssertionError: leaked", 3, 1),
    P.Abort("r1"), P.ResyncKV(), P.Shutdown(), P.EvictBlocks([H1, H2]),
    P.WorkerReady("decode-0", P.Role.DECODE, 42, "ab" * 16, 16, 100, 2048, 64, "tcp://x:1",
                  4608),
    P.Output("r1", 1, [5, 6], 3, "hi", 1, [SampledToken(5, -0.5, [(5, -0.5), (9, -2.0)]),
                                             SampledToken(6, -0.1, None)],
             True, "stop", "\n", 3, 0),
    P.Output("r1", 0, [5], 0, "", 0, None, False, None, 7, 3, 0),
    P.KVPlanReady("r1", PLAN),
    P.PrefillDone("r1", handed_off=True),
    P.RequestFailed("r1", P.FailureKind.INVALID_REQUEST, "too long", "prompt"),
    P.KVEventBatch(4, [BlockStored((H1, H2), None), BlockRemoved((H1,)), AllBlocksCleared()]),
    P.KVSnapshot(4, [H1, H2]),
    P.LoadReport(1, 2, 30, 0, 10, 100, [P.StepTiming(16, 0, 0.01), P.StepTiming(0, 2, 0.02)],
                 5, 50),
    P.LoadReport(0, 0, 0, 0, 0, 100, tiers=[P.TierUsage(
        "disk", 1 << 30, 368640, 1, 2, 3, 0, 1, 737280, 368640, 0.01, 0.02,
        [P.TierCount("quota", 1, 0)], [P.TierCount("acme", 1, 368640)])]),
    P.TransferReport(TELEMETRY),
    P.Migrate("r1", "ns", 30.0), P.Migrate("r1", None, 5.0),
    P.Detached("r1", True, None), P.Detached("r1", False, "not decoding"),
    P.SwitchRole(P.Role.DECODE, 2, 3, b"key"),
    P.PurgeTenant(4, "acme"),
    P.TierEventBatch(2, "disk", [AllBlocksCleared(), BlockStored((H1,), None),
                                 BlockRemoved((H2,))]),
    P.TenantPurged(4, [P.TierCount("host", 3, 1105920)], None),
    P.ExportPrefix("r2", list(range(32)), "ns", 30.0, "acme"), P.CancelImport("r2"),
    P.OutputBatch([P.Output("r1", 4, [7], 9, "a", 4, None, False, None, None, 3, 0),
                   P.Output("r2", 0, [8], 0, "b", 0, [SampledToken(8, -1.5, None)], True,
                            "length", None, 5, 2)]),
]
TAG = {type(m): msgpack.unpackb(P.encode(m))[0] for m in MESSAGES}


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg


def test_every_message_kind_is_covered() -> None:
    assert set(TAG) == set(P._TYPES)


def _frame(cls: type, *fields: object) -> bytes:
    return msgpack.packb([TAG[cls], *fields])


GOOD_PARAMS = msgpack.unpackb(P.encode(MESSAGES[0]))[3]


def _params(**changes: object) -> list[object]:
    names = [f for f in SamplingParams.__dataclass_fields__]
    out = list(GOOD_PARAMS)
    for name, value in changes.items():
        out[names.index(name)] = value
    return out


@pytest.mark.parametrize("frame,why", [
    (b"\xc1", "undecodable"),
    (msgpack.packb({"tag": 0}), "known tag"),
    (msgpack.packb([99]), "known tag"),
    (msgpack.packb([True]), "known tag"),
    (_frame(P.Abort), "Abort takes 1 fields, got a list of 0"),
    (_frame(P.Abort, 5), "Abort.request_id: expected str"),
    (_frame(P.Abort, True), "expected str"),
    (_frame(P.Generate, "r", ["a"], GOOD_PARAMS, None, True, 1.0, True, [], None, None),
     r"prompt_token_ids\[0\]: expected int"),
    (_frame(P.Generate, "r", [1], _params(temperature=-1.0), None, True, 1.0, True, [], None, None),
     "temperature"),
    (_frame(P.Generate, "r", [1], _params(stop=[["deep"]]), None, True, 1.0, True, [], None, None),
     r"params.stop\[0\]: expected str"),
    (_frame(P.Generate, "r", [1], {"temperature": 1}, None, True, 1.0, True, [], None, None),
     "SamplingParams takes"),
    (_frame(P.EvictBlocks, [1, 3]), r"block_hashes\[0\]: expected bytes"),
    (_frame(P.KVPlan, "r", ["t", "r", None, "a", 0, "x", 1.0, bytes(32)]), r"plan.end_token"),
    (_frame(P.KVPlan, "r", ["t", "r", None, "a", 0, 3, 1.0, b"short"]), r"plan: .*32 bytes"),
    (_frame(P.InjectFault, ["explode", "", 0, 1, 1.0, 0, 0.0]), "fault kind"),
    (_frame(P.RequestFailed, "r", "NoSuchKind", "m", None), "not a FailureKind"),
    (_frame(P.WorkerReady, "w", "wizard", 1, "f", 16, 1, 1, 1, None, 1, 1, None, False),
     "not a Role"),
    (_frame(P.KVEventBatch, 1, [[7]]), "record tag"),
    (_frame(P.TierEventBatch, 1, "tape", []), "tier 'tape' is not one of"),
    (_frame(P.KVEventBatch, 1, [[0, ["x"], None]]), r"events\[0\]<BlockStored>.block_hashes"),
    (_frame(P.LoadReport, 1, 2, 3, 0, 1, 2, [[1, 2]], 0, 0, None, [], 0, []),
     r"steps\[0\]: StepTiming takes"),
    (_frame(P.LoadReport, 1, 2, 3, 0, 1, 2, [], 0, 0, [0, 0, 1, 2, 3, "x", 5, 6], [], 0, []),
     r"kv_listener<KVListenerStats>.timed_out: expected int"),
    (_frame(P.Output, "r", 0, [1], 0, "", 0, [[1, None, [[1]]]], False, None, None, 1, 0),
     r"top_logprobs\[0\]: expected 2 items"),
    (_frame(P.OutputBatch, [["r", 0, [1], 0, "", 0, None, False, None, None, 1, 0],
                            ["r", 1, ["x"], 0, "", 0, None, False, None, None, 1, 0]]),
     r"outputs\[1\].token_ids\[0\]: expected int"),
])
def test_malformed_frames_are_refused(frame: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        P.decode(frame)


def test_an_int_field_refuses_a_bool() -> None:
    items = msgpack.unpackb(P.encode(P.KVSnapshot(1, [])))
    items[1] = True
    with pytest.raises(ProtocolError, match="expected int"):
        P.decode(msgpack.packb(items))


@given(st.binary(max_size=64))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    try:
        P.decode(frame)
    except ProtocolError:
        pass


_ANY = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats()
                    | st.text(max_size=8) | st.binary(max_size=20),
                    lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@given(st.sampled_from(sorted(TAG.values())), st.lists(_ANY, max_size=12))
def test_wrong_types_nested_anywhere_raise_protocol_error_only(tag: int,
                                                               fields: list[object]) -> None:
    try:
        P.decode(msgpack.packb([tag, *fields]))
    except ProtocolError:
        pass


@given(st.sampled_from([m for m in MESSAGES if msgpack.unpackb(P.encode(m))[1:]]), st.data())
def test_one_corrupted_leaf_is_refused_or_decodes_to_a_valid_message(msg: P.Message,
                                                                     data: st.DataObject) -> None:
    """Swap one leaf of a real message for another value: the decoder either refuses the
    frame with ProtocolError or returns a message of the same kind."""
    items = msgpack.unpackb(P.encode(msg))
    paths: list[list[int]] = []

    def walk(node: object, path: list[int]) -> None:
        if isinstance(node, list):
            for i, child in enumerate(node):
                walk(child, [*path, i])
        elif path and path != [0]:
            paths.append(path)
    walk(items, [])
    path = data.draw(st.sampled_from(paths))
    node = items
    for i in path[:-1]:
        node = node[i]
    node[path[-1]] = data.draw(_ANY)
    try:
        out = P.decode(msgpack.packb(items))
    except ProtocolError:
        return
    assert type(out) is type(msg)
