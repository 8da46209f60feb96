"""The engine's KV connector: export a prefilled request's blocks from engine A, import them
into engine B (WAITING_FOR_KV), and B continues exactly as A would have."""
from __future__ import annotations

import dataclasses

import pytest

from splitserve import SamplingParams
from splitserve.errors import KVImportError


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
    src = a.engine.export_kv(rid)
    dst = b.engine.kv_import_target(rid)
    assert dst is not None
    skip = (dst.start_token - src.start_token) // a.engine.block_size
    assert src.block_hashes[skip:skip + len(dst.block_hashes)] == dst.block_hashes
    for layer in range(a.engine.spec.num_layers):
        b.engine.write_kv_layer(layer, dst.block_ids, a.engine.read_kv_layer(layer, src.block_ids[skip:]))
    a.engine.release_kv(rid)
    res = b.engine.commit_kv(rid, out.token_ids[0])
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
    assert a.engine.kv.pool.num_used_blocks == 0


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
    assert b.engine.kv.pool.num_used_blocks > 0
    b.engine.fail_kv("x", recompute=True)
    out = None
    while b.engine.has_unfinished:
        for o in b.engine.step():
            out = o
    assert out is not None and out.token_ids == ref.generate(prompt, params)[0].token_ids
    with pytest.raises(KVImportError):
        b.engine.commit_kv("x", 1)
