"""X-Request-Id in and out, and the id on every log line about the request."""
from __future__ import annotations

import logging

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from fake_backend import FakeBackend
from splitserve.api.request_id import (RequestIdFilter, is_valid_request_id, log_config,
                                       label_var, new_request_id)

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi!"}]


def test_client_id_is_a_label_the_server_makes_the_id(client: openai.OpenAI,
                                                       fake: FakeBackend) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=CHAT, extra_headers={"X-Request-Id": "trace-42"})
    assert raw.headers["x-request-id"] == "trace-42"  # echoed
    internal = raw.parse().id
    assert internal.startswith("chatcmpl-") and internal == fake.last.request_id
    chunks = list(client.completions.create(model="smollm2", prompt="Hi", stream=True,
                                            extra_headers={"X-Request-Id": "trace-43"}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id == fake.last.request_id
    assert chunks[0].id.startswith("cmpl-")


def test_a_client_cannot_name_another_request(client: openai.OpenAI,
                                              fake: FakeBackend) -> None:
    """Two clients sending the same X-Request-Id, even one shaped like an attempt id of
    the other's request, get two distinct requests inside."""
    first = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=CHAT, extra_headers={"X-Request-Id": "victim"})
    victim = first.parse().id
    for label in ("victim", f"{victim}#1", victim):
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=CHAT, extra_headers={"X-Request-Id": label})
        assert raw.headers["x-request-id"] == label
        assert raw.parse().id != victim and fake.last.request_id == raw.parse().id


def test_generated_ids_have_openai_prefixes(http: httpx2.Client, fake: FakeBackend) -> None:
    completion = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    chat = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    assert completion.headers["x-request-id"].startswith("cmpl-")
    assert chat.headers["x-request-id"].startswith("chatcmpl-")
    assert chat.json()["id"] == chat.headers["x-request-id"] == fake.last.request_id
    assert http.get("/health").headers["x-request-id"].startswith("req-")


def test_error_responses_carry_the_id(http: httpx2.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi", "n": 2},
                         headers={"X-Request-Id": "bad-n"})
    assert response.status_code == 400 and response.headers["x-request-id"] == "bad-n"


def test_invalid_client_id_is_400_with_a_generated_id(http: httpx2.Client,
                                                      fake: FakeBackend) -> None:
    response = http.post("/v1/completions", json={"prompt": "Hi"},
                         headers={"X-Request-Id": "x" * 129})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "X-Request-Id"
    assert response.headers["x-request-id"].startswith("cmpl-")
    assert not fake.requests


def test_id_rules() -> None:
    assert is_valid_request_id("a" * 128) and is_valid_request_id("span 7/abc")
    assert not is_valid_request_id("") and not is_valid_request_id("a" * 129)
    assert not is_valid_request_id("tab\there")
    assert new_request_id("/v1/chat/completions/").startswith("chatcmpl-")
    assert len(new_request_id("/v1/completions")) == len("cmpl-") + 32


def test_log_lines_about_a_request_carry_its_id(client: openai.OpenAI,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2,
                                  extra_headers={"X-Request-Id": "logged-1"})
    ours = [r for r in caplog.records if r.name == "splitserve.api"]
    access = [r for r in caplog.records if r.name == "uvicorn.access"]
    assert ours and {getattr(r, "request_id") for r in ours} == {"logged-1"}
    assert access and getattr(access[-1], "request_id") == "logged-1"


def test_failed_request_log_line_carries_its_id(client: openai.OpenAI,
                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="splitserve.api"):
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="Hi",
                                      extra_headers={"X-Request-Id": "logged-2"})
    lines = [r for r in caplog.records if r.name == "splitserve.api"]
    assert {getattr(r, "request_id") for r in lines} == {"logged-2"}
    assert sum("404 NotFoundError" in r.getMessage() for r in lines) == 1


def test_log_config_formats_the_id() -> None:
    config = log_config("INFO")
    handler_filters = config["handlers"]["default"]["filters"]
    assert handler_filters == ["request_id"]
    assert config["filters"]["request_id"]["()"] is RequestIdFilter
    formatter = logging.Formatter(config["formatters"]["default"]["format"])
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "GET /x", None, None)
    token = label_var.set("chatcmpl-abc")
    try:
        RequestIdFilter().filter(record)
    finally:
        label_var.reset(token)
    assert "[chatcmpl-abc] GET /x" in formatter.format(record)
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "idle", None, None)
    RequestIdFilter().filter(outside)
    assert getattr(outside, "request_id") == "-"
