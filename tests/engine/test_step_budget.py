"""A step's token budget by time: the fit of step time against tokens, the budget it gives,
the scheduler cutting chunks with it while every decode keeps its token, and an engine
with a tiny time budget giving exactly the outputs of one without."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from splitserve import LLM, SamplingParams
from splitserve.config import SchedulerConfig
from splitserve.engine.step_budget import MIN_PREFILL_TOKENS, StepBudget
from splitserve.model import kernels
from tests.engine.test_scheduler import BS, add, step
from splitserve.engine.scheduler import Scheduler
from splitserve.kv_cache import KVCacheManager


def linear(budget: StepBudget, base: float, per_token: float, sizes: list[int]) -> None:
    for n in sizes:
        budget.observe(n, base + per_token * n)


@given(st.floats(0.0, 0.05), st.floats(1e-4, 0.02),
       st.lists(st.integers(1, 512), min_size=2, max_size=40).filter(lambda s: len(set(s)) > 1))
def test_the_fit_recovers_a_linear_step_cost(base: float, per_token: float,
                                             sizes: list[int]) -> None:
    budget = StepBudget(max_step_s=1.0, max_tokens=10**6)
    linear(budget, base, per_token, sizes)
    cost = budget.cost()
    assert cost is not None
    assert cost[0] == pytest.approx(base, abs=1e-6) and cost[1] == pytest.approx(per_token)
    want = int((1.0 - base) / per_token)
    assert abs(budget.tokens(num_decodes=0) - max(want, MIN_PREFILL_TOKENS)) <= 1


def test_the_budget_is_the_token_cap_until_a_step_was_seen_and_never_above_it() -> None:
    budget = StepBudget(max_step_s=1.0, max_tokens=512)
    assert budget.tokens(num_decodes=3) == 512
    linear(budget, 0.010, 0.0001, [1, 64, 300])  # 1 s fits ~9,900 tokens
    assert budget.tokens(num_decodes=3) == 512


def test_steps_of_one_size_count_their_whole_time_per_token() -> None:
    """One size cannot split base from per-token cost: the mean time per token stands for
    the per-token cost, which makes the budget short, never long."""
    budget = StepBudget(max_step_s=1.0, max_tokens=4096)
    linear(budget, 0.100, 0.001, [300] * 5)  # 0.4 s for 300 tokens: 1.33 ms a token
    assert budget.tokens(num_decodes=0) == 750  # the true fit would be 900


def test_running_decodes_and_a_few_prompt_tokens_go_whatever_the_fit() -> None:
    budget = StepBudget(max_step_s=0.030, max_tokens=512)
    linear(budget, 0.025, 0.002, [1, 8, 40])  # 30 ms fits 2 tokens
    assert budget.tokens(num_decodes=0) == MIN_PREFILL_TOKENS
    assert budget.tokens(num_decodes=40) == 40 + MIN_PREFILL_TOKENS


def test_the_budget_follows_a_machine_that_slows_down() -> None:
    budget = StepBudget(max_step_s=1.0, max_tokens=4096)
    linear(budget, 0.020, 0.001, [50, 500, 900] * 10)
    assert budget.tokens(num_decodes=0) == pytest.approx(980, abs=2)
    linear(budget, 0.020, 0.004, [60, 200, 240] * 20)  # four times slower now
    assert budget.tokens(num_decodes=0) == pytest.approx(245, rel=0.05)


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_targets_are_refused(seconds: float) -> None:
    with pytest.raises(ValueError):
        StepBudget(max_step_s=seconds, max_tokens=512)
    if seconds != 0.0:
        with pytest.raises(ValueError):
            SchedulerConfig(max_step_ms=seconds * 1000)


def test_the_scheduler_cuts_chunks_to_the_time_and_keeps_every_decode() -> None:
    config = SchedulerConfig(max_num_batched_tokens=512, max_step_ms=200.0)
    sched = Scheduler(config, KVCacheManager(1024, BS))
    assert sched.step_budget is not None
    for i in range(4):
        add(sched, f"chat-{i}", 20, seed=i)
    assert step(sched) == {f"chat-{i}": 20 for i in range(4)}  # no speed known yet
    linear(sched.step_budget, 0.010, 0.002, [4, 100, 300])  # 200 ms fits 95 tokens
    add(sched, "long", 2000, seed=9)
    sizes = step(sched)
    assert all(sizes[f"chat-{i}"] == 1 for i in range(4))  # decoding
    assert sizes["long"] == 95 - 4
    assert sum(sizes.values()) == sched.step_budget.tokens(num_decodes=4)


@pytest.mark.skipif(not kernels.is_supported(torch.device("cpu"), torch.bfloat16),
                    reason="exact kernels need an x86 CPU with AVX2")
def test_a_tiny_time_budget_changes_the_chunks_not_the_outputs(tiny_llama_dir: str) -> None:
    """10 us fits nothing on any CPU (a step's Python alone takes longer): every step takes
    its decodes and 16 prompt tokens, so prompts of 40-300 tokens prefill in many chunks
    beside each other's decodes. (1 ms did not: on an AMX Xeon the tiny model's steps of
    16 tokens took under 1 ms, and the fit let 18 in.)"""
    args = dict(device="cpu", dtype="bfloat16", num_blocks=256, debug_invariants=True)
    timed, plain = LLM(tiny_llama_dir, max_step_ms=0.01, **args), LLM(tiny_llama_dir, **args)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 300, 97, 5)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=5,
                             logprobs=2)] * 2
    chunks: list[int] = []
    step_fn = timed.engine.step

    def recording_step() -> list:
        outputs = step_fn()
        assert timed.engine.last_step is not None
        chunks.append(timed.engine.last_step.num_prefill_tokens)
        return outputs

    timed.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # a step or two measured
    timed.engine.step = recording_step  # type: ignore[method-assign]
    got = timed.generate(prompts, params)
    want = plain.generate(prompts, params)
    assert 0 < max(chunks) <= MIN_PREFILL_TOKENS
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
