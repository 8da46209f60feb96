"""A request resumed from the output an earlier attempt produced (a retry or a migration,
DESIGN 7) goes on exactly as the uninterrupted request: same tokens, same text, for greedy
and seeded sampling with penalties (the handoff case is in tests/transfer/test_handoff.py).
In bf16, the default dtype, on the exact kernels: the resumed request prefills the prompt
and the resumed tokens in one step where the first attempt decoded them one by one, the
same bits only where a token's do not depend on its step (fp32 runs oneDNN and SDPA, whose
reductions follow the row count: a seeded top-p draw flipped there between 30510 and
30511)."""
from __future__ import annotations

import pytest

from splitserve import SamplingParams
from splitserve.errors import InvalidRequestError
from splitserve.engine.output import RequestOutput

PROMPT = list(range(2000, 2037))  # 37 tokens: not a multiple of the block size
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True,
                         repetition_penalty=1.3, presence_penalty=0.5,
                         frequency_penalty=0.4, min_tokens=20)


def _run(engine, rid: str) -> RequestOutput:
    last: RequestOutput | None = None
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid:
                last = out
    assert last is not None and last.finished
    return last


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_resumed", [1, 5, 16, 23])
def test_resumed_request_equals_uninterrupted(make_llm, params, num_resumed: int) -> None:
    engine = make_llm(dtype="bfloat16").engine
    engine.add_request("full", PROMPT, params)
    full = _run(engine, "full")
    engine.add_request("resumed", PROMPT, params, resume_token_ids=full.token_ids[:num_resumed])
    resumed = _run(engine, "resumed")
    assert resumed.token_ids == full.token_ids
    assert resumed.text == full.text
    assert resumed.finish_reason == full.finish_reason


def test_resume_past_max_tokens_is_refused(make_llm) -> None:
    engine = make_llm().engine
    with pytest.raises(InvalidRequestError, match="resumed tokens"):
        engine.add_request("r", PROMPT, GREEDY, resume_token_ids=[5] * (GREEDY.max_tokens or 0))
