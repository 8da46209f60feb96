"""What the frontend asks of the cluster and what it streams back, and the merger that
turns a request's outputs from several workers into one stream.

In disaggregated serving a request's tokens come from two workers: the prefill worker
samples the first token, the decode worker commits the imported KV with that token and
samples the rest (after a failure, a third worker may replay). Every worker `Output`
(protocol.py) says where it starts (`token_offset`, `text_offset`, counted from the
request's first output token), so the merger keeps exactly one copy of each position:
nothing lost, nothing duplicated, whichever worker sent it. Output text is a pure function
of the output token ids (and the stop strings), so text from different workers joins up
exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.cluster.protocol import Output
from splitserve.cluster.router.config import DisaggPolicy
from splitserve.engine.batch import SampledToken
from splitserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One request as the frontend hands it to the cluster (already tokenized)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Cache namespace: requests share cached prefixes only within one namespace (DESIGN 4.1).
    namespace: str | None = None
    # Whose request this is, for per-tenant accounting; usually the namespace.
    tenant: str | None = None
    # Overall deadline in seconds from arrival; None: the server's default.
    timeout_s: float | None = None
    # This request's disaggregation policy (the router still refuses the impossible, e.g.
    # ALWAYS with no prefill worker up prefills locally); None: the server's.
    disagg: DisaggPolicy | None = None


@dataclass(slots=True)
class StreamDelta:
    """What is new for a request since the previous delta; the last one has finished=True."""
    token_ids: list[int]
    text: str
    logprobs: list[SampledToken] | None  # one per token in token_ids when asked for
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from a prefix cache
    num_output_tokens: int  # cumulative, after this delta

    @classmethod
    def placed(cls, num_prompt_tokens: int) -> StreamDelta:
        """The delta a stream opens with once its request is on its workers: no tokens
        yet. What refuses a request (admission, the queue's deadline) comes before it, so
        the HTTP layer answers those with a status and starts a streamed response at it,
        while the prompt is being prefilled, instead of at the first token."""
        return cls([], "", None, False, None, None, num_prompt_tokens, 0, 0)

    @property
    def is_placement(self) -> bool:
        return not self.token_ids and not self.text and not self.finished


class DivergedOutput(ValueError):
    """An output's tokens at positions already streamed differ from the streamed ones (a
    recomputed token 1 where outputs depend on batching: oneDNN or CUDA kernels, not the
    exact ones). The stream keeps the streamed tokens; the attempt is retried from them."""


@dataclass(slots=True)
class StreamMerger:
    """Merges positioned worker outputs into deltas with each position exactly once."""
    num_tokens: int = 0
    num_chars: int = 0
    num_logprobs: int = 0
    finished: bool = False
    num_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    def is_ahead(self, out: Output) -> bool:
        """Whether `out` starts past the stream: positions before it are missing."""
        return out.token_offset > self.num_tokens or out.text_offset > self.num_chars

    def merge(self, out: Output) -> StreamDelta | None:
        """The new part of `out`, or None when it adds nothing (a replayed or stale output)."""
        assert not self.finished, "a finished stream takes no more outputs"
        if self.is_ahead(out):
            raise ValueError(f"output starts at token {out.token_offset} / char "
                             f"{out.text_offset}, past the stream's {self.num_tokens} / "
                             f"{self.num_chars}: a gap")
        repeated = self.token_ids[out.token_offset:out.token_offset + len(out.token_ids)]
        if out.token_ids[:len(repeated)] != repeated:
            raise DivergedOutput(
                f"output repeats token positions {out.token_offset}-"
                f"{out.token_offset + len(repeated) - 1} with {out.token_ids[:len(repeated)]}, "
                f"not the streamed {repeated}")
        new_tokens = out.token_ids[self.num_tokens - out.token_offset:]
        new_text = out.text[self.num_chars - out.text_offset:]
        new_logprobs = None
        if out.logprobs is not None:
            new_logprobs = out.logprobs[max(0, self.num_logprobs - out.logprobs_offset):]
            if out.logprobs_offset > self.num_logprobs:  # a worker without the earlier ones
                new_logprobs = []
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if not new_tokens and not new_text and not out.finished:
            return None
        self.num_tokens += len(new_tokens)
        self.num_chars += len(new_text)
        self.token_ids.extend(new_tokens)
        if new_logprobs is not None:
            self.num_logprobs += len(new_logprobs)
        self.finished = out.finished
        return StreamDelta(token_ids=new_tokens, text=new_text, logprobs=new_logprobs,
                           finished=out.finished, finish_reason=out.finish_reason,
                           stop_reason=out.stop_reason, num_prompt_tokens=out.num_prompt_tokens,
                           num_cached_tokens=self.num_cached_tokens,
                           num_output_tokens=self.num_tokens)
