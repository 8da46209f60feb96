"""Sampled tokens' logprobs in OpenAI's two formats (completions and chat)."""
from __future__ import annotations

import math

from splitserve.api.schemas import ChatTokenLogprob, CompletionLogprobs, TopLogprob
from splitserve.engine.batch import SampledToken
from splitserve.model.tokenizer import Tokenizer

# JSON has no -inf; vLLM reports impossible tokens as -9999.0 too.
_MIN_LOGPROB = -9999.0


class TokenStrings:
    """Token id -> the text of that token alone, special tokens kept (cached)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def finite(logprob: float) -> float:
    """`logprob`, or -9999.0 for -inf / NaN (which JSON cannot carry)."""
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def completion_logprobs(tokens: list[SampledToken], text_offset: int,
                        strings: TokenStrings) -> CompletionLogprobs:
    """`tokens` as /v1/completions reports them; `text_offset` is where the first token's
    text starts in the output. Each `top_logprobs` entry maps the top alternatives and the
    sampled token to their logprobs (as vLLM does)."""
    out = CompletionLogprobs()
    for sampled in tokens:
        token = strings(sampled.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(None if sampled.logprob is None else finite(sampled.logprob))
        out.text_offset.append(text_offset)
        text_offset += len(token)
        top = {strings(alt): finite(lp) for alt, lp in sampled.top_logprobs or []}
        if sampled.logprob is not None:
            top.setdefault(token, finite(sampled.logprob))
        out.top_logprobs.append(top)
    return out


def extend_completion_logprobs(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    """Appends `more` (the next delta's logprobs) to `into` (the whole output's)."""
    into.tokens.extend(more.tokens)
    into.token_logprobs.extend(more.token_logprobs)
    into.text_offset.extend(more.text_offset)
    into.top_logprobs.extend(more.top_logprobs)


def chat_logprobs(tokens: list[SampledToken], strings: TokenStrings) -> list[ChatTokenLogprob]:
    """`tokens` as /v1/chat/completions reports them (`logprobs.content`)."""
    out = []
    for sampled in tokens:
        token = strings(sampled.token_id)
        top = [TopLogprob(token=strings(alt), logprob=finite(lp), bytes=_utf8(strings(alt)))
               for alt, lp in sampled.top_logprobs or []]
        logprob = _MIN_LOGPROB if sampled.logprob is None else finite(sampled.logprob)
        out.append(ChatTokenLogprob(token=token, logprob=logprob, bytes=_utf8(token),
                                    top_logprobs=top))
    return out


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
