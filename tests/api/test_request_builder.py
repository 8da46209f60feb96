"""Request bodies -> GenerateRequest, without HTTP."""
from __future__ import annotations

import pytest

from fake_backend import FakeBackend
from splitserve.api.errors import ModelNotFound, _loc_param, api_error
from splitserve.api.request_builder import (CacheScope, build_chat_request,
                                            build_completion_request, cache_scope,
                                            served_model, tenant_of)
from splitserve.api.schemas import ChatCompletionRequest, CompletionRequest
from splitserve.errors import AdmissionRejected, InvalidRequestError


def test_served_model(fake: FakeBackend) -> None:
    assert served_model(None, fake.model_info) == "smollm2"
    assert served_model("smollm2-alias", fake.model_info) == "smollm2-alias"
    with pytest.raises(ModelNotFound, match="smollm2, smollm2-alias"):
        served_model("gpt-9", fake.model_info)


def test_tenant_precedence() -> None:
    body = CompletionRequest(prompt="x", user="u", cache_salt="s")
    assert tenant_of("h", body) == "h"
    assert tenant_of(None, body) == "s"
    assert tenant_of(None, CompletionRequest(prompt="x", user="u")) == "u"
    assert tenant_of(None, CompletionRequest(prompt="x")) is None
    assert tenant_of("", body) == "", "an empty header is still a namespace"
    with pytest.raises(InvalidRequestError) as info:
        tenant_of("t" * 257, body)
    assert info.value.field == "X-Tenant"


def test_with_a_key_the_tenant_is_the_keys_and_only_the_salt_subdivides() -> None:
    salted = CompletionRequest(prompt="x", user="u", cache_salt="s")
    plain = CompletionRequest(prompt="x", user="u")
    assert cache_scope(None, "h", salted) == CacheScope("h", "h")  # no keys: the client's
    a = cache_scope("acme", None, salted)
    assert a.tenant == "acme"
    # X-Tenant and user change nothing; the salt sub-divides within the key's tenant
    assert cache_scope("acme", "other", salted) == a
    assert cache_scope("acme", "other", CompletionRequest(prompt="x", cache_salt="s")) == a
    assert cache_scope("acme", None, plain) != a
    assert cache_scope("acme", None, plain).tenant == "acme"
    # no client-sent value reaches another key's namespace, or a key-less one
    spoofs = [cache_scope("evil", h, CompletionRequest(prompt="x", cache_salt=s, user=u))
              for h in (None, "acme", a.namespace) for s in (None, "s", "acme", a.namespace)
              for u in (None, "acme")]
    namespaces = {a.namespace, cache_scope("acme", None, plain).namespace, "acme", "s", None}
    assert not namespaces & {x.namespace for x in spoofs}
    assert {x.tenant for x in spoofs} == {"evil"}


def test_completion_request(fake: FakeBackend) -> None:
    body = CompletionRequest(prompt=[[4, 5, 6]], max_tokens=3, stop="x", top_k=-1,
                             stop_token_ids=[9], logprobs=0)
    out = build_completion_request(body, "r1", CacheScope("acme", "acme"), fake.model_info)
    assert (out.request_id, out.prompt_token_ids, out.namespace, out.tenant) == (
        "r1", [4, 5, 6], "acme", "acme")
    p = out.params
    assert (p.max_tokens, p.stop, p.top_k, p.stop_token_ids, p.logprobs) == (3, ["x"], 0, [9], 0)
    assert out.timeout_s is None


def test_chat_request_names_chats_fields(fake: FakeBackend) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    cases = [({"max_completion_tokens": 0}, "max_completion_tokens"),
             ({"max_tokens": 0}, "max_tokens"),
             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"max_tokens": fake.model_info.max_model_len}, "max_tokens")]
    for extra, field in cases:
        body = ChatCompletionRequest.model_validate({"messages": messages, **extra})
        with pytest.raises(InvalidRequestError) as info:
            build_chat_request(body, "r", CacheScope(None, None), fake.model_info)
        assert info.value.field == field


def test_chat_template_failure_is_a_messages_error(fake: FakeBackend) -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    tokenizer = fake.model_info.tokenizer
    template = tokenizer.chat_template
    try:
        tokenizer.chat_template, tokenizer._template = "{{ raise_exception('no roles') }}", None
        with pytest.raises(InvalidRequestError, match="no roles") as info:
            build_chat_request(body, "r", CacheScope(None, None), fake.model_info)
        assert info.value.field == "messages"
    finally:
        tokenizer.chat_template, tokenizer._template = template, None


def test_pydantic_loc_becomes_a_field_path() -> None:
    assert _loc_param(("body", "temperature")) == "temperature"
    assert _loc_param(("body", "stop", "list[str]", 0)) == "stop"
    assert _loc_param(("body", "messages", 0, "content", "str")) == "messages.0.content"
    assert _loc_param(("body", "prompt", "list[list[int]]", 0, 1)) == "prompt"
    assert _loc_param(("body",)) is None


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert api_error(AdmissionRejected("busy", 0.01)).headers == {"Retry-After": "1"}
    assert api_error(AdmissionRejected("busy", 4.0, 503)).headers == {"Retry-After": "4"}
    assert api_error(AdmissionRejected("busy", 0.0)).headers == {"Retry-After": "0"}
