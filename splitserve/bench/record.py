"""RequestRecord: what the client saw of one request, and its latencies by vLLM's
benchmark definitions (all times in seconds since the run's start)."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.bench.config import SLO


@dataclass(slots=True)
class RequestRecord:
    """One sent request. `chunk_s` holds the arrival of every streamed chunk that carried
    output text; `output_tokens` is the final usage chunk's `completion_tokens`, or the
    number of such chunks when the server sent no usage. `error` is None exactly when the
    request completed (HTTP 200, the stream ended without an error event, and at least one
    output chunk arrived); `status` is the HTTP status, None when no response came."""
    index: int
    prompt_len: int
    intended_output_len: int
    scheduled_s: float
    session_id: int | None = None
    send_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    end_s: float | None = None
    output_tokens: int | None = None
    usage_reported: bool = False
    prompt_tokens: int | None = None  # usage.prompt_tokens (the server's count)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: int | None = None
    error: str | None = None

    @property
    def is_completed(self) -> bool:
        return self.error is None and self.send_s is not None and bool(self.chunk_s)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: send -> first output chunk."""
        if not self.is_completed:
            return None
        assert self.send_s is not None
        return self.chunk_s[0] - self.send_s

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: send -> last output chunk."""
        if not self.is_completed:
            return None
        assert self.send_s is not None
        return self.chunk_s[-1] - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (output tokens - 1);
        None for requests with fewer than 2 output tokens (they have no TPOT)."""
        if not self.is_completed or self.output_tokens is None or self.output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: every gap between consecutive output chunks."""
        if not self.is_completed:
            return []
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    def meets(self, slo: SLO) -> bool:
        """Completed and within every given target. A request without a TPOT (one output
        token) meets any TPOT target."""
        ttft, tpot = self.ttft_s, self.tpot_s
        if ttft is None:
            return False
        if slo.ttft_ms is not None and ttft * 1e3 > slo.ttft_ms:
            return False
        return slo.tpot_ms is None or tpot is None or tpot * 1e3 <= slo.tpot_ms
