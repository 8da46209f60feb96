"""An in-process Backend for the HTTP tests: deterministic deltas, errors on demand, and a
record of every request it got and of how its stream ended."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from splitserve.api.backend import ModelInfo
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.engine.batch import SampledToken
from splitserve.model.tokenizer import Tokenizer

SCRIPT = " The quick brown fox jumps over the lazy dog."
MODEL_NAMES = ["smollm2", "smollm2-alias"]
MAX_MODEL_LEN = 128
CREATED = 1_700_000_000
ADMIN_KEY = "admin-key-for-tests"  # the shared test server's (conftest.py)


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Polls `condition` (set by the server thread) until it holds or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def logprob_of(position: int) -> float:
    return -0.25 * (position + 1)


@dataclass
class FakeBackend:
    """Answers every request with SCRIPT's tokens, one delta each (cut at max_tokens:
    finish_reason "length", else "stop"). Logprobs: the sampled token at logprob_of(i), then
    alternatives token_id+1, +2, ... each one lower."""
    model_info: ModelInfo
    script_ids: list[int]
    requests: list[GenerateRequest] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)  # id -> "finished" | "aborted"
    error_before: BaseException | None = None  # raised before the first delta
    placed: bool = True  # open with the placement mark, as the dispatcher does
    error_at: tuple[int, BaseException] | None = None  # raised instead of delta i
    hang_at: int | None = None  # wait forever (until closed) instead of sending delta i
    last_finish_reason: str | None = None  # overrides the last delta's finish_reason
    num_cached_tokens: int = 0
    ready: bool = True

    @classmethod
    def create(cls, tokenizer: Tokenizer) -> FakeBackend:
        info = ModelInfo(served_model_names=list(MODEL_NAMES), tokenizer=tokenizer,
                         max_model_len=MAX_MODEL_LEN, vocab_size=tokenizer.vocab_size,
                         created=CREATED)
        return cls(model_info=info, script_ids=tokenizer.encode(SCRIPT))

    def reset(self) -> None:
        self.requests.clear()
        self.outcomes.clear()
        self.error_before = self.error_at = None
        self.placed = True
        self.hang_at = self.last_finish_reason = None
        self.num_cached_tokens = 0
        self.ready = True

    @property
    def last(self) -> GenerateRequest:
        return self.requests[-1]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        self.requests.append(request)
        ids = self.script_ids[:request.params.max_tokens or len(self.script_ids)]
        delivered_last = False
        try:
            if self.error_before is not None:
                raise self.error_before
            if self.placed:
                yield StreamDelta.placed(len(request.prompt_token_ids))
            for i, token_id in enumerate(ids):
                await asyncio.sleep(0)
                if self.hang_at == i:
                    await asyncio.Event().wait()
                if self.error_at is not None and self.error_at[0] == i:
                    raise self.error_at[1]
                is_last = i == len(ids) - 1
                delivered_last = is_last
                yield self._delta(request, i, token_id, is_last, len(ids) < len(self.script_ids))
        finally:
            self.outcomes[request.request_id] = "finished" if delivered_last else "aborted"

    def _delta(self, request: GenerateRequest, i: int, token_id: int, is_last: bool,
               cut: bool) -> StreamDelta:
        logprobs = None
        top_n = request.params.logprobs
        if top_n is not None:
            top = [(token_id + k, logprob_of(i) - k) for k in range(top_n)]
            logprobs = [SampledToken(token_id, logprob_of(i), top)]
        reason = self.last_finish_reason or ("length" if cut else "stop")
        return StreamDelta(
            token_ids=[token_id], text=self.model_info.tokenizer.decode([token_id]),
            logprobs=logprobs, finished=is_last, finish_reason=reason if is_last else None,
            stop_reason=None, num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens, num_output_tokens=i + 1)

    def is_ready(self) -> bool:
        return self.ready

    def health(self) -> dict[str, object]:
        return {"workers": [{"id": "prefill-0", "role": "prefill", "healthy": True,
                             "incarnation": "prefill-0#1", "pid": 4242, "requests": 0},
                            {"id": "decode-0", "role": "decode", "healthy": False,
                             "incarnation": "decode-0#2", "pid": 4343, "requests": 1}],
                "in_flight": 1, "queued": 0}

    def metrics_text(self) -> bytes:
        return b"# TYPE splitserve_requests_total counter\nsplitserve_requests_total 3\n"
