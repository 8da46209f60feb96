"""Process messages: every kind round-trips; malformed frames raise ProtocolError."""
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

H1, H2 = b"\x01" * 16, b"\x02" * 16
MESSAGES: list[P.Message] = [
    P.Generate("r1", [1, 2, 3], SamplingParams(temperature=0.5, stop=["\n"], seed=7), "ns",
               await_kv=True, kv_timeout_s=30.0, recompute_on_failure=True,
               resume_token_ids=[9, 8]),
    P.Prefill("r1", [1, 2], SamplingParams(max_tokens=4), None,
              {"transfer_id": "t", "address": "tcp://127.0.0.1:1"}, [9]),
    P.InjectFault({"kind": "kill", "point": "decode", "after": 3}), P.CheckPool(),
    P.PoolReport(False, "AssertionError: leaked", 3, 1),
    P.Abort("r1"), P.ResyncKV(), P.Shutdown(), P.EvictBlocks([H1, H2]),
    P.WorkerReady("decode-0", "decode", 42, "ab" * 16, 16, 100, 2048, 64, "tcp://x:1", 4608),
    P.Output("r1", 1, [5, 6], 3, "hi", 1, [SampledToken(5, -0.5, [(5, -0.5), (9, -2.0)]),
                                             SampledToken(6, -0.1, None)],
             True, "stop", "\n", 3, 0),
    P.KVPlanReady("r1", {"transfer_id": "t"}),
    P.RequestFailed("r1", "InvalidRequestError", "too long", "prompt"),
    P.KVEventBatch(4, [BlockStored((H1, H2), None), BlockRemoved((H1,)), AllBlocksCleared()]),
    P.KVSnapshot(4, [H1, H2]),
    P.LoadReport(1, 2, 30, 0, 10, 100, [[16.0, 0.0, 0.01], [0.0, 2.0, 0.02]], 5, 50),
    P.TransferReport("r1", {"wire_bytes": 10, "side": "sender"}, None),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("frame,why", [
    (b"\xc1", "undecodable"),
    (msgpack.packb({"tag": 0}), "known tag"),
    (msgpack.packb([99]), "known tag"),
    (msgpack.packb([2]), "takes 1 fields"),
    (msgpack.packb([2, 5]), "expected str"),
    (msgpack.packb([0, "r", ["a"], {}, None, True, 1.0, True, []]), "list of ints"),
    (msgpack.packb([0, "r", [1], {"temperature": -1}, None, True, 1.0, True, []]), "temperature"),
    (msgpack.packb([0, "r", [1], {"nope": 1}, None, True, 1.0, True, []]), "nope"),
    (msgpack.packb([2, True]), "expected str"),
    (msgpack.packb([10, 1, 3]), "list of block hashes"),
])
def test_malformed_frames_are_refused(frame: bytes, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        P.decode(frame)


def test_an_int_field_refuses_a_bool() -> None:
    frame = P.encode(P.KVSnapshot(1, []))
    items = msgpack.unpackb(frame)
    items[1] = True
    with pytest.raises(ProtocolError, match="expected int"):
        P.decode(msgpack.packb(items))


@given(st.binary(max_size=64))
def test_random_bytes_never_crash_the_decoder(frame: bytes) -> None:
    try:
        P.decode(frame)
    except ProtocolError:
        pass
