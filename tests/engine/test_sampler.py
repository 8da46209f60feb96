"""Sampling functions: exact values on small hand-made distributions."""
from __future__ import annotations

import pytest
import torch

from splitserve.engine.batch import SampleSpec
from splitserve.engine.sampler import (apply_penalties, argmax_rows, filter_probs,
                                       inverse_cdf, position_seed, sample)
from splitserve.engine.sampling_params import SamplingParams
from splitserve.errors import InvalidRequestError


def spec(params: SamplingParams, seed: int = 7, pos: int = 0, prompt: list[int] | None = None,
         output: list[int] | None = None, banned: list[int] | None = None) -> SampleSpec:
    return SampleSpec(params, seed, pos, prompt or [], output or [], banned or [])


def test_greedy_picks_argmax_and_respects_banned_ids() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0]])
    assert sample(logits, [spec(SamplingParams(temperature=0))])[0].token_id == 1
    assert sample(logits, [spec(SamplingParams(temperature=0), banned=[1])])[0].token_id == 2


def test_greedy_takes_the_steps_own_argmax_unless_a_ban_changed_the_logits() -> None:
    """first_max (the exact step's argmax, found as it writes the logits) is taken as given
    for greedy rows; a row a penalty or ban changed is computed again, that row alone."""
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [4.0, 3.0, 2.0, -1.0],
                           [0.0, 1.0, 5.0, 2.0]])
    greedy = spec(SamplingParams(temperature=0))
    # a deliberately different answer shows whose argmax was used
    assert [t.token_id for t in sample(logits, [greedy] * 3, [3, 2, 0])] == [3, 2, 0]
    banned = spec(SamplingParams(temperature=0), banned=[0])
    penalized = spec(SamplingParams(temperature=0, repetition_penalty=4.0), prompt=[2])
    assert [t.token_id for t in sample(logits, [greedy, banned, greedy], [3, 2, 0])] \
        == [3, 1, 0]
    assert [t.token_id for t in sample(logits, [banned, greedy, penalized], [3, 2, 0])] \
        == [1, 2, 3]  # row 2: 5.0 / 4 < 2.0


def test_argmax_rows_is_torch_argmax_ties_nan_and_inf_included() -> None:
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, nan, 3.0, nan], [-inf, -inf, -inf, -inf],
                         [0.5, inf, inf, 2.0]])
    wide = torch.randn(5, 49152)
    for x in (rows, wide, wide[:, ::2]):  # a strided view too
        assert argmax_rows(x) == x.argmax(dim=-1).tolist()


def test_a_penalized_or_banned_row_leaves_the_callers_logits_and_the_others_alone() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [0.1, 3.0, 2.0, -1.0]])
    before = logits.clone()
    out = sample(logits, [spec(SamplingParams(temperature=0), banned=[1]),
                          spec(SamplingParams(temperature=0, repetition_penalty=4.0),
                               prompt=[1])])
    assert [t.token_id for t in out] == [2, 2]  # 3.0 / 4 < 2.0
    assert torch.equal(logits, before)
    out = sample(logits, [spec(SamplingParams(temperature=0)), spec(SamplingParams(
        temperature=0, logprobs=1), banned=[1])])
    assert [t.token_id for t in out] == [1, 2]
    assert out[1].top_logprobs is not None and out[1].top_logprobs[0][0] == 1  # raw logprobs
    assert torch.equal(logits, before)


def test_top_k_top_p_min_p_filters() -> None:
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    assert filter_probs(probs, 2, 1.0, 0.0).tolist() == pytest.approx([0.5, 0.2, 0, 0, 0])
    # Nucleus 0.6: 0.5 (mass above 0) and 0.2 (mass above 0.5 < 0.6) stay.
    assert filter_probs(probs, 0, 0.6, 0.0).tolist() == pytest.approx([0.5, 0.2, 0, 0, 0])
    # min_p 0.3 of max 0.5 = 0.15 threshold.
    assert filter_probs(probs, 0, 1.0, 0.3).tolist() == pytest.approx([0.5, 0.2, 0.15, 0, 0])


def test_penalties_follow_vllm_semantics() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    p = SamplingParams(repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), spec(p, prompt=[0], output=[1]))
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits.clone(), spec(p, prompt=[3], output=[2, 2, 0]))
    assert out.tolist() == [2.0 - 0.75, -2.0, 1.0 - 1.0, 0.5]


def test_seeded_sampling_is_a_pure_function_of_seed_and_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 500)
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, [spec(p, seed=3, pos=i)])[0].token_id for i in range(20)]
    again = [sample(logits, [spec(p, seed=3, pos=i)])[0].token_id for i in range(20)]
    other = [sample(logits, [spec(p, seed=4, pos=i)])[0].token_id for i in range(20)]
    assert draws == again
    assert draws != other
    assert len(set(draws)) > 5  # positions get different noise
    # Batch composition does not matter: the same row in a batch of 3 draws the same token.
    batch = torch.cat([torch.randn(1, 500), logits, torch.randn(1, 500)])
    out = sample(batch, [spec(p, seed=9), spec(p, seed=3, pos=5), spec(p, seed=9)])
    assert out[1].token_id == draws[5]


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    p = SamplingParams(temperature=1.0)
    counts = [0, 0, 0]
    for i in range(2000):
        counts[sample(logits, [spec(p, seed=i)])[0].token_id] += 1
    assert counts[0] / 2000 == pytest.approx(0.7, abs=0.05)
    assert counts[2] / 2000 == pytest.approx(0.1, abs=0.03)


def test_sampling_follows_a_wide_distribution() -> None:
    """Pearson's chi-square over 50 tokens (the 99.9% quantile at 49 degrees of freedom is
    85.4) and top-k: the tokens it removes are never drawn."""
    torch.manual_seed(1)
    logits = torch.randn(1, 50) * 1.5
    probs = torch.softmax(logits[0], -1)
    n = 6000
    counts = torch.zeros(50)
    for i in range(n):
        counts[sample(logits, [spec(SamplingParams(temperature=1.0), seed=i)])[0].token_id] += 1
    expected = probs * n
    assert float(((counts - expected) ** 2 / expected).sum()) < 85.4
    top = set(torch.topk(probs, 5).indices.tolist())
    drawn = {sample(logits, [spec(SamplingParams(temperature=1.0, top_k=5), seed=i)])[0]
             .token_id for i in range(500)}
    assert drawn <= top and len(drawn) > 1


def test_the_inverse_cdf_at_both_ends_of_the_unit_interval() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    assert inverse_cdf(probs, 0.0) == 1  # never the zero-mass token before it
    assert inverse_cdf(probs, 0.25 - 1e-12) == 1
    assert inverse_cdf(probs, 0.25) == 3
    assert inverse_cdf(probs, 1.0 - 2.0 ** -53) == 3  # never a zero-mass token after it
    assert inverse_cdf(probs * 4, 0.5) == 3  # not normalized: u is a share of the total


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    tok = sample(logits, [spec(SamplingParams(temperature=0, logprobs=2))])[0]
    expected = torch.log_softmax(logits[0], -1)
    assert tok.token_id == 2
    assert tok.logprob == pytest.approx(float(expected[2]))
    assert tok.top_logprobs is not None and [t for t, _ in tok.top_logprobs] == [2, 1]


def test_position_seed_fits_int64_and_differs() -> None:
    seeds = {position_seed(s, p) for s in (0, 1, 2**62) for p in range(50)}
    assert len(seeds) == 150
    assert all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"), ({"min_p": 1.5}, "min_p"), ({"n": 2}, "n"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"), ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_invalid_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert field.split("_")[0] in str(err.value)
