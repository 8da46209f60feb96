"""Scheduler: the step's token budget split among prompts in prefill (no head-of-line
blocking behind a long prompt), the partial-prefill limit, decodes first, preemption.
Pure bookkeeping on a real KV cache manager; no model (the engine tests run the model)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from splitserve.config import SchedulerConfig
from splitserve.engine.batch import RunnerOutput, SampledToken
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler, fair_shares
from splitserve.kv_cache import KVCacheManager, root_hash

BS = 16


def make(budget: int = 512, partial: int = 2, num_blocks: int = 1024,
         max_num_seqs: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_num_partial_prefills=partial)
    return Scheduler(config, KVCacheManager(num_blocks, BS))


def add(sched: Scheduler, rid: str, num_tokens: int, seed: int = 0) -> Request:
    req = Request(rid, [(seed * 7919 + i) % 30000 + 1 for i in range(num_tokens)],
                  SamplingParams(max_tokens=4, ignore_eos=True), seed=0,
                  cache_root=root_hash("fp-sched", None), max_tokens=4,
                  eos_token_ids=frozenset(), arrival_time=0.0)
    req.update_block_hashes(BS)
    sched.add(req)
    return req


def step(sched: Scheduler) -> dict[str, int]:
    """One step with a fake runner: every sequence that reaches its end samples token 7."""
    batch = sched.schedule()
    sampled = {s.request_id: SampledToken(7) for s in batch.seqs if s.sample is not None}
    sched.update(batch, RunnerOutput(sampled))
    sched.check_invariants()
    return {s.request_id: len(s.token_ids) for s in batch.seqs}


@given(st.lists(st.integers(1, 5000), max_size=12), st.integers(0, 4096))
def test_fair_shares_is_max_min_fair(needs: list[int], budget: int) -> None:
    shares = fair_shares(needs, budget)
    assert len(shares) == len(needs)
    assert all(0 <= s <= n for s, n in zip(shares, needs))
    if sum(needs) <= budget:
        assert shares == needs
        return
    assert sum(shares) == budget  # nothing wasted
    # Max-min fair: an unfinished share is never more than one token below any other share.
    unfinished = [s for s, n in zip(shares, needs) if s < n]
    assert unfinished and max(shares) - min(unfinished) <= 1


def test_fair_shares_examples() -> None:
    assert fair_shares([4071, 589], 512) == [256, 256]
    assert fair_shares([4071, 100], 512) == [412, 100]
    assert fair_shares([10, 10, 10], 7) == [3, 2, 2]  # the earliest takes the spare token
    assert fair_shares([], 512) == []


def test_a_short_prompt_runs_beside_a_long_one_instead_of_behind_it() -> None:
    sched = make(budget=512, partial=2)
    add(sched, "long", 4071)
    assert step(sched) == {"long": 512}
    add(sched, "short", 589, seed=1)
    assert step(sched) == {"long": 256, "short": 256}
    assert step(sched) == {"long": 256, "short": 256}
    # The short prompt's last 77 tokens; the long one takes the rest of the budget.
    assert step(sched) == {"long": 435, "short": 77}
    assert sched.requests["short"].num_output_tokens == 1
    # Now "short" decodes one token per step beside the long prompt's chunks.
    assert step(sched) == {"long": 511, "short": 1}


def test_one_partial_prefill_is_first_come_first_served() -> None:
    sched = make(budget=512, partial=1)
    add(sched, "long", 4071)
    step(sched)
    add(sched, "short", 589, seed=1)
    for _ in range(6):
        assert step(sched) == {"long": 512}
    assert step(sched) == {"long": 487}  # the short one would be a second partial prefill
    assert step(sched) == {"long": 1, "short": 511}
    # A prompt that finishes within the step still joins (it leaves nothing partial).
    sched = make(budget=512, partial=1)
    add(sched, "long", 4071)
    step(sched)
    add(sched, "tiny", 40, seed=2)
    assert step(sched) == {"long": 472, "tiny": 40}


def test_a_queue_of_equal_prompts_is_first_come_first_served() -> None:
    # Sharing pays only for a prompt shorter than one in prefill: equal prompts shared
    # would all finish late together, so the next one takes what the first leaves.
    sched = make(budget=512, partial=2)
    for i in range(3):
        add(sched, f"p{i}", 1000, seed=i)
    assert step(sched) == {"p0": 512}
    assert step(sched) == {"p0": 488, "p1": 24}
    add(sched, "tiny", 30, seed=9)
    assert step(sched) == {"p0": 1, "p1": 511}  # tiny waits behind p2 (arrival order)


def test_the_partial_limit_bounds_how_many_prompts_share_a_step() -> None:
    sched = make(budget=512, partial=2)
    add(sched, "long", 4071)
    step(sched)
    add(sched, "s1", 589, seed=1)
    add(sched, "s2", 395, seed=2)
    assert step(sched) == {"long": 256, "s1": 256}  # s2 would be a third partial prefill
    sched = make(budget=512, partial=3)
    add(sched, "long", 4071)
    step(sched)
    add(sched, "s1", 589, seed=1)
    add(sched, "s2", 395, seed=2)
    assert step(sched) == {"long": 171, "s1": 171, "s2": 170}


def test_decodes_take_their_token_before_prompts_share_the_rest() -> None:
    sched = make(budget=64, partial=2)
    for i in range(3):
        add(sched, f"d{i}", 20, seed=i)
    assert step(sched) == {"d0": 20, "d1": 20, "d2": 20}
    add(sched, "a", 300, seed=5)
    add(sched, "b", 200, seed=6)
    # 3 decodes take 3 tokens, the two prompts split the other 61.
    assert step(sched) == {"d0": 1, "d1": 1, "d2": 1, "a": 31, "b": 30}


def test_a_cached_prefix_counts_as_computed_in_the_share() -> None:
    sched = make(budget=512, partial=1)
    add(sched, "first", 480)
    step(sched)  # all 480 computed; its blocks are in the prefix cache
    add(sched, "long", 4000, seed=3)
    step(sched)
    # Same 480-token prefix (30 blocks cached) plus 40 more: it needs 41 tokens, fits
    # beside the long prompt without being a second partial prefill.
    again = add(sched, "again", 520)
    again.prompt_token_ids[480:] = [9] * 40
    again.all_token_ids[480:] = [9] * 40
    assert step(sched)["again"] == 40
    assert sched.requests["again"].num_cached_tokens == 480


def test_preemption_frees_the_newest_and_it_resumes_later() -> None:
    sched = make(budget=512, partial=2, num_blocks=36)  # 576 token slots
    a, b = add(sched, "a", 300), add(sched, "b", 300, seed=1)
    assert step(sched) == {"a": 300, "b": 212}  # 19 + 14 blocks
    # a decodes in its 19 blocks; b's last 88 tokens would need 6 blocks, 3 are left:
    # b (the newest) is preempted, its blocks go back, and it recomputes after a ends.
    assert step(sched) == {"a": 1}
    assert b.num_preemptions == 1 and b.num_computed_tokens == 0
    for _ in range(12):
        step(sched)
    assert a.is_finished and b.is_finished and not sched.has_work
    assert sched.kv.pool.num_used_blocks == 0


def test_decode_only_while_no_prompt_token_is_left() -> None:
    """What a pacing decode worker asks before it waits (cluster/worker/lending.py)."""
    sched = make(budget=256)
    assert sched.decode_only  # nothing at all
    add(sched, "a", 300)
    assert not sched.decode_only  # waiting
    step(sched)
    assert not sched.decode_only  # 44 prompt tokens left
    step(sched)
    assert sched.decode_only  # its first token sampled: decodes from here
    add(sched, "b", 20, seed=1)
    assert not sched.decode_only
    step(sched)
    assert sched.decode_only
