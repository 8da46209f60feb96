"""OpenAI request bodies -> the cluster's `GenerateRequest`: prompt token ids, sampling
parameters, cache namespace and disaggregation override, with every check that needs the
model's limits.

Completions take one prompt (a string, token ids, or a one-element list of either); a batch
of several prompts is rejected with 400 naming `prompt`: send one request per prompt.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from splitserve.api.backend import ModelInfo
from splitserve.api.errors import ModelNotFound
from splitserve.api.schemas import (MAX_NAME_CHARS, ChatCompletionRequest, ChatMessage,
                                    CompletionRequest, SamplingFields)
from splitserve.cluster.frontend.stream import GenerateRequest
from splitserve.cluster.router.config import DisaggPolicy
from splitserve.engine.sampling_params import SamplingParams, check_length, check_token_ids
from splitserve.errors import InvalidRequestError
from splitserve.model.tokenizer import Tokenizer


def served_model(requested: str | None, info: ModelInfo) -> str:
    """The model name the response carries; raises ModelNotFound (404) for unknown names."""
    if requested is None:
        return info.served_model_names[0]
    if requested not in info.served_model_names:
        raise ModelNotFound(requested, info.served_model_names)
    return requested


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Which cached prefixes a request may hit, and whose cache cap it counts against."""
    namespace: str | None  # requests share cached prefixes only within one namespace
    tenant: str | None  # per-tenant accounting (router `tenant_max_cached_blocks`)


def cache_scope(key_tenant: str | None, header: str | None, body: SamplingFields) -> CacheScope:
    """With API keys (`key_tenant`: the caller's key's tenant), the tenant is the key's and
    the namespace is that tenant sub-divided by `cache_salt` (requests of one key with
    different salts share nothing; no salt is its own sub-division); `X-Tenant` and `user`
    are ignored, so no client reaches another key's prefixes whatever it sends. Without
    keys the clients are trusted to name their tenant: `tenant_of`."""
    if key_tenant is None:
        tenant = tenant_of(header, body)
        return CacheScope(tenant, tenant)
    # NOTE: JSON of the pair is injective: no (tenant, salt) pair spells another's.
    return CacheScope(json.dumps([key_tenant, body.cache_salt]), key_tenant)


def tenant_of(header: str | None, body: SamplingFields) -> str | None:
    """The cache namespace and tenant without API keys: `X-Tenant`, else `cache_salt`,
    else `user`."""
    if header is not None and len(header) > MAX_NAME_CHARS:
        raise InvalidRequestError(f"X-Tenant has {len(header)} characters, over the limit of "
                                  f"{MAX_NAME_CHARS}", field="X-Tenant")
    for value in (header, body.cache_salt, body.user):
        if value is not None:
            return value
    return None


Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


def parse_body(model: type[Body], raw: bytes) -> Body:
    """The JSON body as `model`; RequestValidationError (400 naming the field) if not."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def build_completion_request(body: CompletionRequest, request_id: str, scope: CacheScope,
                             info: ModelInfo) -> GenerateRequest:
    """Tokenizes `body.prompt` (special tokens added as the checkpoint asks)."""
    _check_common(body)
    if body.echo:
        raise InvalidRequestError("echo is not supported; prepend the prompt yourself",
                                  field="echo")
    if body.suffix is not None:
        raise InvalidRequestError("suffix (insertion) is not supported", field="suffix")
    if body.best_of not in (None, 1):
        raise InvalidRequestError(f"best_of={body.best_of}: only 1 is supported",
                                  field="best_of")
    params = _sampling_params(body, body.max_tokens, body.logprobs)
    prompt_ids = _completion_prompt_ids(body.prompt, info.tokenizer)
    _check_ids(prompt_ids, params, info)
    check_length(len(prompt_ids), params.max_tokens, info.max_model_len)
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params,
                           namespace=scope.namespace, tenant=scope.tenant,
                           disagg=_disagg_policy(body))


def build_chat_request(body: ChatCompletionRequest, request_id: str, scope: CacheScope,
                       info: ModelInfo) -> GenerateRequest:
    """Renders `body.messages` with the chat template (generation prompt added) and encodes
    the result without adding special tokens (the template has them)."""
    _check_common(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", field="top_logprobs")
    if body.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError("only tool_choice 'none' or 'auto' is supported",
                                  field="tool_choice")
    if body.response_format is not None and body.response_format.get("type") != "text":
        raise InvalidRequestError("only response_format {'type': 'text'} is supported",
                                  field="response_format")
    max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    with fields_renamed({"max_tokens": max_name, "logprobs": "top_logprobs",
                          "prompt": "messages"}):
        params = _sampling_params(body, max_tokens, logprobs)
        prompt_ids = _chat_prompt_ids(body, info.tokenizer)
        _check_ids(prompt_ids, params, info)
        check_length(len(prompt_ids), params.max_tokens, info.max_model_len)
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params,
                           namespace=scope.namespace, tenant=scope.tenant,
                           disagg=_disagg_policy(body))


@contextmanager
def fields_renamed(names: dict[str, str]) -> Iterator[None]:
    """Re-raises InvalidRequestError with the field named as this endpoint names it (chat's
    prompt is its `messages`; SamplingParams' `logprobs` is chat's `top_logprobs`)."""
    try:
        yield
    except InvalidRequestError as exc:
        if exc.field not in names:
            raise
        raise InvalidRequestError(str(exc), field=names[exc.field]) from exc


def _check_ids(prompt_ids: list[int], params: SamplingParams, info: ModelInfo) -> None:
    check_token_ids(prompt_ids, info.vocab_size, "prompt")
    check_token_ids(params.stop_token_ids, info.vocab_size, "stop_token_ids")


def _disagg_policy(body: SamplingFields) -> DisaggPolicy | None:
    """The request's override of the server's `--disagg-policy`; None: no override."""
    if body.disagg is None:
        return None
    try:
        return DisaggPolicy.from_name(body.disagg)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), field="disagg") from exc


def _check_common(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError("stream_options needs stream=true", field="stream_options")
    if body.logit_bias:
        raise InvalidRequestError("logit_bias is not supported", field="logit_bias")


def _sampling_params(body: SamplingFields, max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    """Fields the client left out or sent as null keep SamplingParams' defaults (vLLM's)."""
    given: dict[str, Any] = {
        "n": body.n, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "min_p": body.min_p, "min_tokens": body.min_tokens,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "seed": body.seed, "stop": body.stop, "stop_token_ids": body.stop_token_ids,
        "ignore_eos": body.ignore_eos, "skip_special_tokens": body.skip_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
    }
    kwargs = {name: value for name, value in given.items() if value is not None}
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)


def _completion_prompt_ids(prompt: str | list[int] | list[str] | list[list[int]],
                           tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not prompt or all(isinstance(t, int) for t in prompt):
        return [t for t in prompt if isinstance(t, int)]
    if len(prompt) != 1:
        raise InvalidRequestError(f"a batch of {len(prompt)} prompts is not supported; send "
                                  "one request per prompt", field="prompt")
    only = prompt[0]
    if isinstance(only, str):
        return tokenizer.encode(only)
    assert isinstance(only, list), "pydantic admits only the four prompt shapes"
    return list(only)


def _chat_prompt_ids(body: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if not body.messages:
        raise InvalidRequestError("messages is empty; send at least one message",
                                  field="messages")
    messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
    extra: dict[str, Any] = {"tools": body.tools} if body.tools is not None else {}
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except (ValueError, TypeError) as exc:  # a template rejecting the conversation
        raise InvalidRequestError(f"the chat template cannot render these messages: {exc}",
                                  field="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: content a string (text parts joined by "\\n")."""
    content = message.content
    if isinstance(content, list):
        others = sorted({p.type for p in content if p.type != "text"})
        if others:
            raise InvalidRequestError(f"content parts of type {', '.join(others)} are not "
                                      "supported: this model reads text only",
                                      field=f"messages.{index}.content")
        content = "\n".join(p.text or "" for p in content)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    for key in ("name", "tool_calls", "tool_call_id"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    return out
