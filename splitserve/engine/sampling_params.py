"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.errors import InvalidRequestError

_MAX_SEED = 2**63 - 1


@dataclass(slots=True)
class SamplingParams:
    """OpenAI/vLLM sampling knobs. Greedy when temperature == 0.

    `seed` makes sampling a pure function of (seed, output position, logits); a request
    without one gets a seed drawn when it is added, so any engine can continue it exactly.
    """
    n: int = 1
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # top-N alternatives per token (0: only the sampled one)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n == 1, "n", f"n={self.n}: only n=1 is supported; send n separate requests")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens={self.max_tokens} must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens={self.min_tokens} must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens={self.min_tokens} must not exceed max_tokens={self.max_tokens}")
        _check(0.0 <= self.temperature <= 100.0, "temperature",
               f"temperature={self.temperature} must be in [0, 100]")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p={self.top_p} must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", f"top_k={self.top_k} must be >= 0 (or -1 to disable)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p={self.min_p} must be in [0, 1]")
        _check(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
               f"repetition_penalty={self.repetition_penalty} must be in (0, 10]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"presence_penalty={self.presence_penalty} must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"frequency_penalty={self.frequency_penalty} must be in [-2, 2]")
        _check(self.seed is None or 0 <= self.seed <= _MAX_SEED, "seed",
               f"seed={self.seed} must be in [0, 2**63)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "stop_token_ids must be non-negative integers")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"logprobs={self.logprobs} must be in [0, 20]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, field=field_name)


def check_token_ids(token_ids: list[int], vocab_size: int, field: str) -> None:
    """Token ids a client sent (a prompt, stop_token_ids) must name tokens of the model."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {vocab_size})", field=field)


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The one prompt-length check (the HTTP edge and every engine run it): a prompt must
    leave room for output within `max_model_len`, and an explicit `max_tokens` must fit
    after it. InvalidRequestError names the field: `prompt` or `max_tokens`."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("prompt is empty; send at least one token", field="prompt")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; your request has "
            f"{num_prompt_tokens} input tokens, which leaves no room for output. Shorten the "
            "prompt (or raise --max-model-len / the KV cache size).", field="prompt")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"'max_tokens' is too large: {max_tokens}. This model's maximum context length "
            f"is {max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens}); lower it, or omit it to "
            "generate up to the limit.", field="max_tokens")
