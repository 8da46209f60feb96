from __future__ import annotations

from collections.abc import Iterator

import pytest

from splitserve import LLM


@pytest.fixture
def make_llm(tiny_llama_dir: str) -> Iterator:
    """Builds fp32 engines over the tiny random Llama; checks every pool's invariants after."""
    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        kwargs = {"dtype": "float32", "debug_invariants": True, "num_blocks": 256, **kwargs}
        llm = LLM(str(kwargs.pop("model", tiny_llama_dir)), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.check_invariants()
        assert not llm.engine.has_unfinished
