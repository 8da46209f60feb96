"""The engine's KV connector (engine/kv_connector.py): export a prefilled request's blocks
from engine A, import them into engine B (WAITING_FOR_KV), and B continues exactly as A
would have. The KV moves through the `KVConnector` interface only, as a transfer does."""
from __future__ import annotations

import dataclasses

import pytest

from splitserve import SamplingParams
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.output import RequestOutput
from splitserve.engine.request import RequestStatus
from splitserve.errors import KVImportError


def copy_kv(src_engine: KVConnector, dst_engine: KVConnector, rid: str,
            first_token_id: int) -> RequestOutput:
    """What a sender and a receiver do together, without the wire."""
    src = src_engine.export_kv(rid)
    dst = dst_engine.kv_import_target(rid)
    assert dst is not None
    layout = src_engine.kv_layout
    assert dst_engine.kv_layout == layout
    skip = (dst.start_token - src.start_token) // layout.block_size
    assert src.block_hashes[skip:skip + len(dst.block_hashes)] == dst.block_hashes
    for layer in range(layout.num_layers):
        kv = src_engine.read_kv_layer(layer, src.block_ids[skip:])
        assert kv.shape == layout.layer_shape(len(dst.block_ids))
        dst_engine.write_kv_layer(layer, dst.block_ids, kv)
    src_engine.release_kv(rid)
    out = dst_engine.commit_kv(rid, first_token_id)
    assert out is not None, "the whole prompt's KV came: it runs from its first token"
    return out


def handoff(a, b, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Prefill on A (first token), copy the KV to B, decode the rest on B."""
    first = dataclasses.replace(params, max_tokens=1)
    a.engine.add_request(rid, prompt, first, hold_kv=True)
    b.engine.add_request(rid, prompt, params, await_kv=True)
    out = None
    while a.engine.has_unfinished:
        for o in a.engine.step():
            out = o
    assert out is not None and out.finished
    res = copy_kv(a.engine, b.engine, rid, out.token_ids[0])
    tokens = list(res.token_ids)
    while b.engine.has_unfinished:
        for o in b.engine.step():
            tokens = o.token_ids
    return tokens


@pytest.mark.parametrize("length", [5, 16, 37, 64])
def test_handoff_continues_identically(make_llm, length: int) -> None:
    a, b, ref = make_llm(), make_llm(), make_llm()
    prompt = list(range(1000, 1000 + length))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = ref.generate(prompt, params)[0].token_ids
    assert handoff(a, b, "r", prompt, params) == expected
    assert a.engine.load().kv_blocks_used == 0


def test_seeded_sampling_continues_identically(make_llm) -> None:
    a, b, ref = make_llm(), make_llm(), make_llm()
    prompt = list(range(2000, 2040))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    assert handoff(a, b, "s", prompt, params) == ref.generate(prompt, params)[0].token_ids


def test_prefix_hit_on_receiver_transfers_only_the_rest(make_llm) -> None:
    a, b, ref = make_llm(), make_llm(), make_llm()
    shared = list(range(3000, 3040))
    b.generate(shared, SamplingParams(max_tokens=2))  # B caches 2 full blocks of `shared`
    prompt = shared + [5, 6, 7, 8, 9]
    b.engine.add_request("probe", prompt, SamplingParams(max_tokens=3), await_kv=True)
    target = b.engine.kv_import_target("probe")
    assert target is not None and target.start_token == 32 and target.end_token == 45
    b.engine.fail_kv("probe", recompute=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert handoff(a, b, "h", prompt, params) == ref.generate(prompt, params)[0].token_ids


def test_failed_import_releases_blocks_and_can_recompute(make_llm) -> None:
    b, ref = make_llm(), make_llm()
    prompt = list(range(4000, 4030))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    b.engine.add_request("x", prompt, params, await_kv=True)
    assert b.engine.kv_import_target("x") is not None
    assert b.engine.load().kv_blocks_used > 0
    b.engine.fail_kv("x", recompute=True)
    out = None
    while b.engine.has_unfinished:
        for o in b.engine.step():
            out = o
    assert out is not None and out.token_ids == ref.generate(prompt, params)[0].token_ids
    with pytest.raises(KVImportError):
        b.engine.commit_kv("x", 1)


def test_request_state_and_ids_follow_a_request_through_export(make_llm) -> None:
    a = make_llm()
    prompt = list(range(5000, 5037))  # 2 full blocks of 16 and a partial one
    a.engine.add_request("p", prompt, SamplingParams(max_tokens=1), hold_kv=True)
    state = a.engine.request_state("p")
    assert state is not None and state.status == RequestStatus.WAITING and state.hold_kv
    assert (state.num_prefill_tokens, state.num_computed_tokens) == (37, 0)
    assert len(state.block_hashes) == 2
    while a.engine.has_unfinished:
        a.engine.step()
    assert a.engine.request_state("p") is None  # finished: no longer live ...
    assert a.engine.request_ids() == ["p"]  # ... but its KV is held
    assert a.engine.export_kv("p").block_hashes == list(state.block_hashes)
    a.engine.release_kv("p")
    assert a.engine.request_ids() == [] and a.engine.load().kv_blocks_used == 0
    with pytest.raises(KVImportError):
        a.engine.export_kv("p")


def test_failed_import_without_recompute_drops_the_request(make_llm) -> None:
    b = make_llm()
    b.engine.add_request("x", list(range(6000, 6030)), SamplingParams(max_tokens=4),
                         await_kv=True)
    state = b.engine.request_state("x")
    assert state is not None and state.status == RequestStatus.WAITING_FOR_KV
    assert b.engine.kv_import_target("x") is not None
    b.engine.fail_kv("x", recompute=False)
    assert b.engine.request_state("x") is None and b.engine.request_ids() == []
    assert b.engine.load().kv_blocks_used == 0 and not b.engine.has_unfinished
    b.engine.fail_kv("x", recompute=False)  # no longer waiting: a no-op


def migrate(a, b, rid: str, prompt: list[int], params: SamplingParams, after: int,
            others: int = 0) -> list[int]:
    """Decode on A (next to `others` bystanders) for `after` tokens, detach the request and
    move its KV to B (prompt and output so far), decode the rest on B."""
    a.engine.add_request(rid, prompt, params)
    for i in range(others):
        a.engine.add_request(f"bystander-{i}", list(range(50 + i, 70 + i)),
                             SamplingParams(max_tokens=64, ignore_eos=True))
    tokens: list[int] = []
    while len(tokens) < after:
        for o in a.engine.step():
            if o.request_id == rid:
                tokens = list(o.token_ids)
    last = a.engine.detach(rid)
    assert last == tokens[-1] and rid in a.engine.request_ids()
    b.engine.add_request(rid, prompt, params, await_kv=True, resume_token_ids=tokens[:-1])
    res = copy_kv(a.engine, b.engine, rid, last)
    assert list(res.token_ids) == tokens
    while b.engine.has_unfinished:
        for o in b.engine.step():
            tokens = list(o.token_ids)
    for i in range(others):
        a.engine.abort(f"bystander-{i}")
    return tokens


@pytest.mark.parametrize("after", [1, 7, 16, 30])
def test_detached_request_continues_identically_elsewhere(make_llm, after: int) -> None:
    """Live migration at the engine: the KV of the prompt and of every computed output
    token moves; greedy and seeded sampling go on as if nothing happened."""
    a, b, ref = make_llm(), make_llm(), make_llm()
    prompt = list(range(4000, 4021))
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)):
        expected = ref.generate(prompt, params)[0].token_ids
        assert migrate(a, b, f"m{after}", prompt, params, after, others=2) == expected
        assert a.engine.load().kv_blocks_used == 0 and b.engine.load().kv_blocks_used == 0


def test_only_a_decoding_request_detaches(make_llm) -> None:
    a = make_llm()
    a.engine.add_request("w", list(range(100, 120)), SamplingParams(max_tokens=5))
    with pytest.raises(KVImportError, match="not decoding"):
        a.engine.detach("w")  # waiting: nothing computed yet
    with pytest.raises(KVImportError):
        a.engine.detach("unknown")
    a.engine.abort("w")


def test_layer_reads_and_writes_touch_only_the_named_blocks(make_llm) -> None:
    """write_kv_layer fills exactly the given blocks of one layer, in the order given
    (scattered ids, as a fragmented pool hands them out); read_kv_layer returns them."""
    import torch
    engine = make_llm().engine
    layout = engine.kv_layout
    num_blocks = engine.kv_cache.shape[2]
    ids = [num_blocks - 1, 3, 7, 4, 0]
    kv = torch.randn(layout.layer_shape(len(ids))).to(layout.dtype)
    layer = layout.num_layers - 1
    before = engine.kv_cache.clone()
    engine.write_kv_layer(layer, ids, kv.double())  # cast to the cache's dtype
    assert torch.equal(engine.read_kv_layer(layer, ids), kv)
    assert torch.equal(engine.read_kv_layer(layer, ids[::-1]), kv.flip(1))
    changed = (engine.kv_cache != before).flatten(3).any(-1)  # [layers, 2, blocks]
    assert changed.nonzero()[:, 0].unique().tolist() == [layer]
    assert sorted(changed[layer].any(0).nonzero().flatten().tolist()) == sorted(ids)
