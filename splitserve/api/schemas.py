"""OpenAI-compatible request and response bodies (plus vLLM's sampling extensions).

Requests ignore unknown fields, as OpenAI and vLLM do. Fields are typed loosely enough to
accept what the OpenAI clients send (`null` for "default"); value ranges are checked by
`SamplingParams`, so each limit lives in one place. Sizes are capped here (a 400 naming
the field): OpenAI's 4 stop sequences and 128 tools, and documented limits where OpenAI has
none (1,024 characters per stop string, 64 stop token ids, 256-character salts and user names).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

MAX_STOP = 4  # OpenAI's limit
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TOOLS = 128  # OpenAI's limit
MAX_NAME_CHARS = 256  # cache_salt, user
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]

# ---- requests -----------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool | None = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None  # None: the first served name (as vLLM)
    temperature: float | None = None  # None: 1.0
    top_p: float | None = None
    n: int | None = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # not supported: rejected when non-empty
    user: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    cache_salt: Annotated[str, Field(max_length=MAX_NAME_CHARS)] | None = None
    # splitserve extension: this request's `--disagg-policy` ("auto" | "always" | "never");
    # None: the server's.
    disagg: str | None = None


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""
    # A string, token ids, or a one-element list of either (batches are rejected).
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default; null: up to the context limit
    logprobs: int | None = None  # top-N alternatives per token
    echo: bool | None = False  # not supported: rejected when true
    suffix: str | None = None  # not supported: rejected when set
    best_of: int | None = None  # only 1


class ContentPart(BaseModel):
    type: str  # only "text" is served
    text: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # Rendered by the chat template.
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None  # only "none" / "auto"
    response_format: dict[str, Any] | None = None  # only {"type": "text"}


# ---- responses ----------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # --enable-prompt-tokens-details


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (streaming) one chunk of it: OpenAI uses one shape for both."""
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "splitserve"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's (and vLLM's) error body: `{"error": {"message", "type", "param", "code"}}`."""
    error: ErrorInfo
