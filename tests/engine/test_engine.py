"""Engine behaviour on a tiny random Llama (fp32): batching, prefix caching, preemption,
chunked prefill, stops, seeds and bad input."""
from __future__ import annotations

import random

import pytest

from splitserve import SamplingParams
from splitserve.errors import InvalidRequestError, ModelLoadError, StepFailed

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_batched_equals_one_by_one(make_llm) -> None:
    llm = make_llm()
    ps = prompts(8)
    batched = [o.token_ids for o in llm.generate(ps, GREEDY)]
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in ps]
    assert batched == alone
    assert all(len(t) == 24 for t in batched)


def test_chunked_prefill_gives_same_tokens(make_llm) -> None:
    ps = prompts(4, seed=1, lo=40, hi=120)
    whole = [o.token_ids for o in make_llm(enable_prefix_caching=False).generate(ps, GREEDY)]
    llm = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == whole


def test_short_prompt_shares_the_chunk_budget_and_load_counts_prefilling(make_llm) -> None:
    llm = make_llm(max_num_batched_tokens=16, max_num_partial_prefills=2,
                   enable_prefix_caching=False)
    engine = llm.engine
    long_p, short_p = prompts(2, seed=4, lo=100, hi=101)[0], prompts(1, seed=5, lo=12, hi=13)[0]
    one = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("long", long_p, one)
    engine.step()
    load = engine.load()
    assert (load.num_waiting, load.num_prefilling, load.num_waiting_tokens) == (0, 1, 84)
    engine.add_request("short", short_p, one)
    finished: dict[str, list[int]] = {}
    steps = 0
    while "short" not in finished:
        finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        steps += 1
    assert steps == 2 and "long" not in finished  # 8 + 8 tokens a step: 12 end in two
    while engine.has_unfinished:
        finished.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    alone = make_llm(enable_prefix_caching=False)
    assert [finished["long"], finished["short"]] == \
        [alone.generate(p, one)[0].token_ids for p in (long_p, short_p)]


def test_prefix_cache_computes_only_uncached_tokens(make_llm) -> None:
    llm = make_llm()
    engine = llm.engine
    shared = prompts(1, seed=2, lo=40, hi=41)[0]  # 40 tokens: 2 full blocks of 16
    first = llm.generate(shared + [7, 8, 9], GREEDY)[0]
    assert first.num_cached_tokens == 0
    tail = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    before = engine.num_computed_tokens_total
    one_token = SamplingParams(temperature=0, max_tokens=1)
    hit = llm.generate(shared + tail, one_token)[0]
    # 2 cached blocks = 32 tokens; the rest of the 50-token prompt is computed.
    assert hit.num_cached_tokens == 32
    assert engine.num_computed_tokens_total - before == 50 - 32
    fresh = make_llm(enable_prefix_caching=False).generate(shared + tail, one_token)[0]
    assert hit.token_ids == fresh.token_ids
    # And the full continuation matches too.
    assert llm.generate(shared + tail, GREEDY)[0].token_ids == \
        make_llm(enable_prefix_caching=False).generate(shared + tail, GREEDY)[0].token_ids


def test_whole_prompt_hit_still_computes_one_token(make_llm) -> None:
    llm = make_llm()
    p = prompts(1, seed=3, lo=32, hi=33)[0]  # exactly 2 blocks
    a = llm.generate(p, GREEDY)[0]
    before = llm.engine.num_computed_tokens_total
    b = llm.generate(p, SamplingParams(temperature=0, max_tokens=1))[0]
    assert b.num_cached_tokens == 16  # the last block is recomputed to get logits
    assert llm.engine.num_computed_tokens_total - before == 16
    assert b.token_ids == a.token_ids[:1]


def test_preemption_under_a_tiny_pool_completes_correctly(make_llm) -> None:
    ps = prompts(6, seed=4, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    reference = [o.token_ids for o in make_llm().generate(ps, params)]
    small = make_llm(num_blocks=12)  # 192 token slots for ~6 x 70 tokens of demand
    outs = small.generate(ps, params)
    assert [o.token_ids for o in outs] == reference
    assert small.engine.scheduler.kv.pool.num_used_blocks == 0


def test_preemption_actually_happens(make_llm) -> None:
    small = make_llm(num_blocks=12)
    engine = small.engine
    for i, p in enumerate(prompts(6, seed=4, lo=20, hi=40)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    preempted = 0
    while engine.has_unfinished:
        engine.step()
        preempted = max(preempted,
                        sum(r.num_preemptions for r in engine.scheduler.requests.values()))
    assert preempted > 0


def test_seeded_sampling_is_reproducible_across_batches(make_llm) -> None:
    llm = make_llm()
    ps = prompts(3, seed=5)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=20,
                             ignore_eos=True) for i in range(3)]
    together = [o.token_ids for o in llm.generate(ps, params)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(ps, params)]
    assert together == alone
    other_seed = llm.generate(ps[0], SamplingParams(temperature=0.9, seed=999, max_tokens=20,
                                                    ignore_eos=True))[0].token_ids
    assert other_seed != together[0]


def test_max_tokens_stop_token_ids_and_min_tokens(make_llm) -> None:
    llm = make_llm()
    p = prompts(1, seed=6)[0]
    ref = llm.generate(p, GREEDY)[0].token_ids
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == ref[:5] and out.finish_reason == "length"
    stop_id = ref[3]
    first = ref.index(stop_id)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == ref[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, min_tokens=first + 2,
                                         stop_token_ids=[stop_id]))[0]
    assert stop_id not in out.token_ids[:first + 2]


def test_stop_string_truncates_text(make_llm) -> None:
    llm = make_llm()
    p = prompts(1, seed=7)[0]
    ref = llm.generate(p, GREEDY)[0]
    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    assert stop.strip(), "reference text too short for this test"
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                         stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == ref.text[:ref.text.index(stop)]
    kept = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                          stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == ref.text[:ref.text.index(stop) + len(stop)]


def test_streamed_deltas_add_up_to_the_text(make_llm) -> None:
    llm = make_llm()
    engine = llm.engine
    engine.add_request("s", prompts(1, seed=8)[0], GREEDY)
    text, ids, last = "", [], None
    while engine.has_unfinished:
        for out in engine.step():
            text += out.delta_text
            ids += out.delta_token_ids
            last = out
    assert last is not None and last.finished
    assert text == last.text and ids == last.token_ids


def test_logprobs_returned_per_token(make_llm) -> None:
    out = make_llm().generate(prompts(1)[0], SamplingParams(temperature=0, max_tokens=4,
                                                            logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob is not None and lp.logprob <= 0
        assert lp.top_logprobs is not None and lp.top_logprobs[0][0] == tok  # greedy = top-1


def test_abort_frees_blocks(make_llm) -> None:
    engine = make_llm().engine
    engine.add_request("a", prompts(1)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    assert engine.kv.pool.num_used_blocks > 0
    out = engine.abort("a")
    assert out is not None and out.finish_reason == "abort"
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.abort("a") is None  # idempotent


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(make_llm) -> None:
    """Whatever a step raises (here the runner, on the step that holds "poison"), the
    step's requests end with StepFailed naming them, their blocks are freed, nothing the
    step wrote is cached, and the next requests get exactly a fresh engine's output."""
    llm = make_llm()
    engine, params = llm.engine, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    prompt = list(range(100, 150))  # whole blocks a later request could hit
    execute = engine.runner.execute

    def flaky(batch, hook):
        if any(seq.request_id == "poison" for seq in batch.seqs):
            raise RuntimeError("boom")
        return execute(batch, hook)

    engine.runner.execute = flaky
    engine.add_request("poison", prompt, params)
    engine.add_request("bystander", prompts(2)[1], params)
    with pytest.raises(StepFailed) as err:
        engine.step()
    assert sorted(err.value.request_ids) == ["bystander", "poison"]
    assert isinstance(err.value.__cause__, RuntimeError)
    assert not engine.has_unfinished and engine.kv.pool.num_used_blocks == 0
    assert engine.request_ids() == []
    engine.check_invariants()
    # Nothing of the failed step is a prefix hit, and the engine's outputs are unchanged.
    got = llm.generate([prompt], params)[0]
    assert got.num_cached_tokens == 0
    assert got.token_ids == make_llm().generate([prompt], params)[0].token_ids


def test_bad_prompts_raise_typed_errors(make_llm) -> None:
    llm = make_llm(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(InvalidRequestError, match="max-model-len") as err:
        llm.generate(list(range(100, 200)), GREEDY)
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.generate([10**9], GREEDY)
    with pytest.raises(InvalidRequestError, match="vocabulary") as err:  # not an IndexError
        llm.generate([1, 2], SamplingParams(stop_token_ids=[10**9], min_tokens=1))
    assert err.value.field == "stop_token_ids"
    # Nothing was left behind by the rejected requests.
    assert not llm.engine.has_unfinished and llm.engine.kv.pool.num_used_blocks == 0
    # max_tokens beyond max_model_len is capped, not an error.
    out = llm.generate(list(range(100, 150)), SamplingParams(max_tokens=1000, ignore_eos=True))[0]
    assert len(out.token_ids) == 14 and out.finish_reason == "length"


def test_missing_or_corrupt_model_raises_model_load_error(tmp_path) -> None:
    from splitserve import LLM
    with pytest.raises(ModelLoadError):
        LLM(str(tmp_path / "nope"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelLoadError):
        LLM(str(bad))


def test_unknown_engine_argument_is_rejected(tiny_llama_dir: str) -> None:
    from splitserve import LLM
    with pytest.raises(TypeError, match="unknown engine arguments"):
        LLM(tiny_llama_dir, block_sise=8)
