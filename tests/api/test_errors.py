"""Every error a client can meet: status, OpenAI error body, `param`, headers; and the server
keeps serving afterwards."""
from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any, cast

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam
import pytest

from fake_backend import FakeBackend
from splitserve.errors import AdmissionRejected, InvalidRequestError, RequestTimeout, WorkerFailed

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi!"}]


def _error(response: httpx2.Response, status: int, param: str | None = None) -> dict[str, Any]:
    """Checks the OpenAI error shape and returns its `error` object."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param
    assert "Traceback" not in error["message"]
    return error


def _still_serving(client: openai.OpenAI) -> None:
    out = client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert out.choices[0].text == " The quick"


# ---- malformed bodies ---------------------------------------------------------------------

def test_malformed_json_is_400(http: httpx2.Client, client: openai.OpenAI) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = http.post(path, content=b'{"prompt": "Hi",', headers={
            "content-type": "application/json"})
        assert "not valid JSON" in _error(response, 400)["message"]
    _still_serving(client)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": {"text": "Hi"}}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": "x"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"content": "Hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": "yes please"}, "logprobs"),
    ("/v1/completions", {"prompt": "Hi", "disagg": 1}, "disagg"),
])
def test_wrong_types_are_400_naming_the_field(http: httpx2.Client, path: str,
                                              body: dict[str, Any], param: str) -> None:
    error = _error(http.post(path, json=body), 400, param)
    assert error["type"] == "BadRequestError" and error["message"].startswith(param)


def test_body_that_is_not_an_object_is_400(http: httpx2.Client) -> None:
    _error(http.post("/v1/completions", json=["Hi"]), 400)


# ---- values the sampler or the model cannot take ------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"n": 2}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"min_tokens": 10}, "max_tokens": 5}, "min_tokens"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_completion_values_are_400(client: openai.OpenAI, fake: FakeBackend,
                                       kwargs: dict[str, Any], param: str) -> None:
    args = {"model": "smollm2", "prompt": "Hi", **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    body = cast(dict[str, Any], info.value.body)
    assert body == {"message": body["message"],
                               "type": "BadRequestError", "param": param, "code": 400}
    assert info.value.request_id
    assert not fake.requests


@pytest.mark.parametrize("kwargs, param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 3}, "n"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0.content"),
])
def test_bad_chat_values_are_400(client: openai.OpenAI, fake: FakeBackend,
                                 kwargs: dict[str, Any], param: str) -> None:
    args = {"model": "smollm2", "messages": CHAT, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**args)
    assert info.value.param == param
    assert not fake.requests


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hi"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_unknown_disagg_policy_is_400(http: httpx2.Client, fake: FakeBackend, path: str,
                                      body: dict[str, Any]) -> None:
    error = _error(http.post(path, json={**body, "disagg": "sometimes"}), 400, "disagg")
    assert error["type"] == "BadRequestError"
    assert "'sometimes'" in error["message"] and "['auto', 'always', 'never']" in error["message"]
    assert not fake.requests


def test_prompt_too_long_is_400(client: openai.OpenAI, fake: FakeBackend) -> None:
    long_prompt = " word" * fake.model_info.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt=long_prompt)
    assert info.value.param == "prompt" and "maximum context length" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2",
                                       messages=[{"role": "user", "content": long_prompt}])
    assert info.value.param == "messages"
    assert not fake.requests


def test_max_tokens_past_the_context_is_400(client: openai.OpenAI, fake: FakeBackend) -> None:
    limit = fake.model_info.max_model_len
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt=[1, 2, 3], max_tokens=limit - 2)
    assert info.value.param == "max_tokens"
    client.completions.create(model="smollm2", prompt=[1, 2, 3], max_tokens=limit - 3)
    assert fake.last.params.max_tokens == limit - 3


def test_backend_rejecting_the_prompt_is_400(client: openai.OpenAI, fake: FakeBackend) -> None:
    # (the edge refuses an empty prompt itself: the backend's own check is faked here)
    fake.error_before = InvalidRequestError("prompt is too long for worker 3", field="prompt")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert info.value.param == "prompt"
    assert cast(dict[str, Any], info.value.body)["message"] == "prompt is too long for worker 3"
    with pytest.raises(openai.BadRequestError) as info:  # chat names the messages
        client.chat.completions.create(model="smollm2", messages=CHAT)
    assert info.value.param == "messages"
    fake.error_before = None
    _still_serving(client)


def test_unknown_model_is_404(client: openai.OpenAI, http: httpx2.Client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert (info.value.param, info.value.type, info.value.code) == ("model", "NotFoundError", "404")
    assert "gpt-9" in info.value.message
    _error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"}), 404, "model")


def test_unknown_route_and_method_use_the_error_format(http: httpx2.Client) -> None:
    assert _error(http.get("/v1/nothing"), 404)["type"] == "NotFoundError"
    _error(http.get("/v1/completions"), 405)


# ---- the backend failing ------------------------------------------------------------------

@pytest.mark.parametrize("status, retry_after_s, header", [(429, 2.2, "3"), (503, 0.5, "1")])
def test_admission_rejected_carries_retry_after(http: httpx2.Client, fake: FakeBackend,
                                                status: int, retry_after_s: float,
                                                header: str) -> None:
    fake.error_before = AdmissionRejected("queue full; retry later", retry_after_s, status)
    for stream in (False, True):  # before the first delta: a real status even when streaming
        response = http.post("/v1/completions", json={"prompt": "Hi", "stream": stream})
        error = _error(response, status)
        assert response.headers["retry-after"] == header
        assert error["message"] == "queue full; retry later"
        assert error["type"] == {429: "RateLimitError", 503: "ServiceUnavailableError"}[status]


def test_admission_rejected_through_the_openai_client(client: openai.OpenAI,
                                                      fake: FakeBackend) -> None:
    fake.error_before = AdmissionRejected("busy", 1.0, 429)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model="smollm2", messages=CHAT)
    assert info.value.response.headers["retry-after"] == "1"


@pytest.mark.parametrize("exc, status, error_type", [
    (RequestTimeout("the prefill took too long", stage="prefill"), 504, "TimeoutError"),
    (WorkerFailed("decode worker 2 died"), 500, "InternalServerError"),
])
def test_backend_failures(http: httpx2.Client, client: openai.OpenAI, fake: FakeBackend,
                          exc: Exception, status: int, error_type: str) -> None:
    fake.error_before = exc
    error = _error(http.post("/v1/chat/completions", json={"messages": CHAT}), status)
    assert error["type"] == error_type and str(exc) in error["message"]
    if isinstance(exc, RequestTimeout):
        assert "stage: prefill" in error["message"]
    fake.error_before = None
    _still_serving(client)


def test_finish_reason_error_is_500(client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.last_finish_reason = "error"
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=2)


def test_unexpected_exception_is_a_logged_500_without_details(
        http: httpx2.Client, client: openai.OpenAI, fake: FakeBackend,
        caplog: pytest.LogCaptureFixture) -> None:
    fake.error_before = RuntimeError("secret internals at 0xdeadbeef")
    with caplog.at_level(logging.ERROR, logger="splitserve.api"):
        response = http.post("/v1/completions", json={"prompt": "Hi"},
                             headers={"X-Request-Id": "req-boom"})
    error = _error(response, 500)
    assert error["type"] == "InternalServerError" and "secret" not in error["message"]
    assert "req-boom" in error["message"] and response.headers["x-request-id"] == "req-boom"
    logged = [r for r in caplog.records if r.exc_info and "secret" in str(r.exc_info[1])]
    assert logged and getattr(logged[0], "request_id") == "req-boom"
    fake.error_before = None
    _still_serving(client)


# ---- after the stream started -------------------------------------------------------------

def test_error_mid_stream_is_one_error_event_then_done(http: httpx2.Client, client: openai.OpenAI,
                                                       fake: FakeBackend) -> None:
    fake.error_at = (2, WorkerFailed("decode worker 2 died"))
    with http.stream("POST", "/v1/chat/completions",
                     json={"messages": CHAT, "stream": True}) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("InternalServerError", 500)
    assert "decode worker 2 died" in error["message"]
    assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-2]] == [
        "", " The", " quick"]
    with pytest.raises(openai.APIError, match="decode worker 2 died"):
        list(client.chat.completions.create(model="smollm2", messages=CHAT, stream=True))
    fake.error_at = None
    _still_serving(client)


def test_an_error_after_placement_is_an_event_when_streaming(http: httpx2.Client,
                                                             client: openai.OpenAI,
                                                             fake: FakeBackend) -> None:
    # placed, then the prefill times out: the streamed response has started (200, one
    # error event, [DONE]); a non-streaming one still gets the status
    fake.error_at = (0, RequestTimeout("the prefill took too long", stage="prefill"))
    with http.stream("POST", "/v1/completions", json={"prompt": "Hi", "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events[-1] == "[DONE]" and len(events) == 2
    error = json.loads(events[0])["error"]
    assert (error["type"], error["code"]) == ("TimeoutError", 504)
    _error(http.post("/v1/completions", json={"prompt": "Hi"}), 504)
    fake.error_at = None
    _still_serving(client)


@pytest.mark.parametrize("body,field", [
    ({"prompt": [[-5, 1000000000]]}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": "Hi", "stop_token_ids": [1000000000], "min_tokens": 1}, "stop_token_ids"),
    ({"prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_400s(http: Any, fake: Any, body: dict[str, Any],
                                                   field: str) -> None:
    """Ids that would index past the embedding or the sampler's logits never get in."""
    response = http.post("/v1/completions", json={"max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    assert not fake.requests


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]},
     "messages.0.role"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 1025}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": "s" * 257}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}] * 129}, "tools"),
])
def test_sizes_and_roles_are_capped(http: Any, fake: Any, path: str, body: dict[str, Any],
                                    param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert not fake.requests


def test_a_body_over_the_limit_is_413_before_it_is_parsed(http: Any, fake: Any) -> None:
    from splitserve.api.middleware import MAX_BODY_BYTES
    big = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 1)}).encode()
    response = http.post("/v1/completions", content=big,
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "RequestEntityTooLargeError"

    def chunks() -> Any:  # no Content-Length: counted as it streams in
        for _ in range(5):
            yield b" " * (MAX_BODY_BYTES // 4)
    response = http.post("/v1/completions", content=chunks(),
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.headers["x-request-id"]
    assert not fake.requests


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_413_reaches_a_client_that_sends_its_whole_body_first(server_url: str, fake: Any,
                                                                framing: str) -> None:
    """The server drops the rest of a too-large body before it closes: closed on unread
    bytes, the socket would reset, and the reset discards the 413 before the client reads
    it (httpx writes the whole body first; CI saw it)."""
    from splitserve.api.middleware import MAX_BODY_BYTES
    body = b" " * (MAX_BODY_BYTES + 1024 * 1024)
    if framing == "content-length":
        head, wire = f"Content-Length: {len(body)}", body
    else:
        piece = 256 * 1024
        wire = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece])
                        for i in range(0, len(body), piece)) + b"0\r\n\r\n"
        head = "Transfer-Encoding: chunked"
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     f"application/json\r\n{head}\r\n\r\n".encode() + wire)
        time.sleep(0.3)  # the server has answered and closed by now
        response = b""
        while chunk := sock.recv(65536):
            response += chunk
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"RequestEntityTooLargeError" in response
    assert not fake.requests
