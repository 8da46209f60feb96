"""A request's stream of deltas -> OpenAI response objects.

One builder per request sees every delta through `add`, which returns the streaming chunk
for it; after the last delta `response()` is the whole (non-streaming) answer. Streaming
and non-streaming responses therefore come from the same code.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from pydantic import BaseModel

from splitserve.api.errors import GenerationError
from splitserve.api.logprobs import (TokenStrings, chat_logprobs, completion_logprobs,
                                     extend_completion_logprobs)
from splitserve.api.request_id import logger
from splitserve.api.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice,
                                    ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs,
                                    ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                                    CompletionResponse, DeltaMessage, PromptTokensDetails,
                                    UsageInfo)
from splitserve.cluster.frontend.stream import StreamDelta


class ResponseBuilder(ABC):
    """What both endpoints share: identity of the response, the last delta, usage."""

    def __init__(self, request_id: str, model: str, created: int, strings: TokenStrings,
                 with_logprobs: bool, include_usage: bool,
                 with_cached_tokens: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self._strings = strings
        self._with_logprobs = with_logprobs
        self._include_usage = include_usage
        # Off (vLLM's default): usage.prompt_tokens_details is null, since cached_tokens
        # tells a client how much of its prompt other requests of its namespace cached.
        self._with_cached_tokens = with_cached_tokens
        self._last: StreamDelta | None = None
        self._text: list[str] = []

    def head(self) -> list[BaseModel]:
        """Chunks to send before the first delta's."""
        return []

    @abstractmethod
    def add(self, delta: StreamDelta) -> BaseModel | None:
        """Takes the next delta; returns its streaming chunk (None: nothing worth sending)."""

    @abstractmethod
    def usage_chunk(self) -> BaseModel | None:
        """The final usage-only chunk when the client asked for stream_options.include_usage."""

    @abstractmethod
    def response(self) -> BaseModel:
        """The whole response, once the finished delta has been added."""

    def check_finished(self) -> None:
        """Raises GenerationError unless the finished delta has been added."""
        self._finished_delta()

    def usage(self) -> UsageInfo:
        """Token counts of the finished request (cached = prompt tokens from a prefix cache)."""
        last = self._finished_delta()
        return UsageInfo(
            prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
            total_tokens=last.num_prompt_tokens + last.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=last.num_cached_tokens)
            if self._with_cached_tokens else None)

    def _observe(self, delta: StreamDelta) -> None:
        if delta.finish_reason == "error":
            raise GenerationError("the engine failed while generating this request; retry it")
        self._last = delta
        self._text.append(delta.text)
        if delta.finished:
            logger.info("finished (%s): %d prompt tokens (%d cached), %d output tokens",
                        delta.finish_reason, delta.num_prompt_tokens, delta.num_cached_tokens,
                        delta.num_output_tokens)

    def _finished_delta(self) -> StreamDelta:
        if self._last is None or not self._last.finished:
            raise GenerationError("the backend's stream ended before the request finished")
        return self._last

    def _is_empty(self, delta: StreamDelta) -> bool:
        return not delta.text and not delta.finished and not (
            self._with_logprobs and delta.token_ids)


class CompletionBuilder(ResponseBuilder):
    """Objects of /v1/completions (`text_completion`, for the whole and for chunks)."""

    def __init__(self, request_id: str, model: str, created: int, strings: TokenStrings,
                 with_logprobs: bool, include_usage: bool,
                 with_cached_tokens: bool = False) -> None:
        super().__init__(request_id, model, created, strings, with_logprobs, include_usage,
                         with_cached_tokens)
        self._logprobs = CompletionLogprobs()
        self._num_chars = 0

    def add(self, delta: StreamDelta) -> CompletionResponse | None:
        self._observe(delta)
        logprobs = None
        if self._with_logprobs:
            logprobs = completion_logprobs(delta.logprobs or [], self._num_chars, self._strings)
            extend_completion_logprobs(self._logprobs, logprobs)
        self._num_chars += len(delta.text)
        if self._is_empty(delta):
            return None
        choice = CompletionChoice(text=delta.text, logprobs=logprobs,
                                  finish_reason=delta.finish_reason if delta.finished else None,
                                  stop_reason=delta.stop_reason if delta.finished else None)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[choice])

    def usage_chunk(self) -> CompletionResponse | None:
        if not self._include_usage:
            return None
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[], usage=self.usage())

    def response(self) -> CompletionResponse:
        last = self._finished_delta()
        choice = CompletionChoice(text="".join(self._text),
                                  logprobs=self._logprobs if self._with_logprobs else None,
                                  finish_reason=last.finish_reason, stop_reason=last.stop_reason)
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                  choices=[choice], usage=self.usage())


class ChatBuilder(ResponseBuilder):
    """Objects of /v1/chat/completions (`chat.completion` and `chat.completion.chunk`)."""

    def __init__(self, request_id: str, model: str, created: int, strings: TokenStrings,
                 with_logprobs: bool, include_usage: bool,
                 with_cached_tokens: bool = False) -> None:
        super().__init__(request_id, model, created, strings, with_logprobs, include_usage,
                         with_cached_tokens)
        self._logprobs: list[ChatTokenLogprob] = []

    def head(self) -> list[BaseModel]:
        """The first chunk names the role, as OpenAI's does."""
        return [self._chunk(ChatChunkChoice(delta=DeltaMessage(role="assistant", content="")))]

    def add(self, delta: StreamDelta) -> ChatCompletionChunk | None:
        self._observe(delta)
        logprobs = None
        if self._with_logprobs:
            content = chat_logprobs(delta.logprobs or [], self._strings)
            self._logprobs.extend(content)
            logprobs = ChatLogprobs(content=content)
        if self._is_empty(delta):
            return None
        return self._chunk(ChatChunkChoice(
            delta=DeltaMessage(content=delta.text), logprobs=logprobs,
            finish_reason=delta.finish_reason if delta.finished else None,
            stop_reason=delta.stop_reason if delta.finished else None))

    def usage_chunk(self) -> ChatCompletionChunk | None:
        if not self._include_usage:
            return None
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[], usage=self.usage())

    def response(self) -> ChatCompletionResponse:
        last = self._finished_delta()
        logprobs = ChatLogprobs(content=self._logprobs) if self._with_logprobs else None
        choice = ChatChoice(message=AssistantMessage(content="".join(self._text)),
                            logprobs=logprobs, finish_reason=last.finish_reason,
                            stop_reason=last.stop_reason)
        return ChatCompletionResponse(id=self.request_id, created=self.created,
                                      model=self.model, choices=[choice], usage=self.usage())

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model,
                                   choices=[choice])
