"""splitserve: disaggregated LLM inference.

`from splitserve import LLM, SamplingParams` is the offline API. Imports are lazy so that
light users (the router, the bench client) do not pay for torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engine.llm import LLM
    from splitserve.engine.output import RequestOutput
    from splitserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from splitserve.engine.llm import LLM
        return LLM
    if name == "RequestOutput":
        from splitserve.engine.output import RequestOutput
        return RequestOutput
    if name == "SamplingParams":
        from splitserve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'splitserve' has no attribute {name!r}")
