"""StreamMerger: outputs of several workers become one stream, each position once."""
from __future__ import annotations

import pytest

from splitserve.cluster.protocol import Output
from splitserve.cluster.frontend.stream import DivergedOutput, StreamMerger
from splitserve.engine.batch import SampledToken


def out(tok_off: int, toks: list[int], txt_off: int, text: str, finished: bool = False,
        lp_off: int | None = None, lps: list[float] | None = None) -> Output:
    logprobs = None if lps is None else [SampledToken(0, x) for x in lps]
    return Output("r", tok_off, toks, txt_off, text, tok_off if lp_off is None else lp_off,
                  logprobs, finished, "stop" if finished else None, None, 5, 0)


def test_prefill_first_token_then_decode_worker_repeats_it() -> None:
    m = StreamMerger()
    d1 = m.merge(out(0, [11], 0, "He"))          # from the prefill worker
    d2 = m.merge(out(0, [11, 12], 0, "Hello"))    # decode worker: commit output + next token
    d3 = m.merge(out(2, [13], 5, "!", finished=True))
    assert d1 is not None and (d1.token_ids, d1.text) == ([11], "He")
    assert d2 is not None and (d2.token_ids, d2.text) == ([12], "llo")
    assert d3 is not None and (d3.token_ids, d3.text, d3.finished) == ([13], "!", True)
    assert m.token_ids == [11, 12, 13] and d3.num_output_tokens == 3


def test_a_replayed_output_adds_nothing() -> None:
    m = StreamMerger()
    m.merge(out(0, [1, 2], 0, "ab"))
    assert m.merge(out(0, [1], 0, "a")) is None
    assert m.merge(out(1, [2], 1, "b")) is None


def test_a_gap_is_an_error() -> None:
    m = StreamMerger()
    m.merge(out(0, [1], 0, "a"))
    with pytest.raises(ValueError, match="gap"):
        m.merge(out(3, [4], 1, "d"))


def test_text_can_lag_tokens_and_catch_up() -> None:
    m = StreamMerger()  # a held-back partial character or stop-string prefix
    d1 = m.merge(out(0, [1], 0, ""))
    d2 = m.merge(out(1, [2], 0, "xy"))
    assert d1 is not None and (d1.token_ids, d1.text) == ([1], "")
    assert d2 is not None and (d2.token_ids, d2.text) == ([2], "xy")


def test_logprobs_merge_by_position() -> None:
    m = StreamMerger()
    d1 = m.merge(out(0, [1], 0, "a", lps=[-0.1]))
    # the decode worker has no logprob for the first token: its list starts at 1
    d2 = m.merge(out(0, [1, 2], 0, "ab", lp_off=1, lps=[-0.2]))
    assert d1 is not None and [t.logprob for t in d1.logprobs or []] == [-0.1]
    assert d2 is not None and [t.logprob for t in d2.logprobs or []] == [-0.2]


def test_other_tokens_at_streamed_positions_are_a_divergence() -> None:
    m = StreamMerger()
    m.merge(out(0, [11], 0, "He"))
    with pytest.raises(DivergedOutput, match="not the streamed"):
        m.merge(out(0, [12, 13], 0, "Yo!"))
    assert m.token_ids == [11] and m.num_tokens == 1 and m.num_chars == 2  # unchanged
    assert m.merge(out(0, [11, 13], 0, "He!")) is not None  # the same token 1 goes on
