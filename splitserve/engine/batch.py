"""Plain-data records passed between the scheduler and the runner (never live Requests)."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleSpec:
    """What the sampler needs for one sequence's next token."""
    params: SamplingParams
    seed: int
    output_pos: int  # index in the output of the token being sampled
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]  # EOS / stop ids while under min_tokens


@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: SampleSpec | None  # None for a prefill chunk that does not reach the end


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None  # log-probability of token_id under the model
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    num_computed_tokens: int = 0
