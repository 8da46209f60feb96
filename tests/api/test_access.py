"""Who may call what (api/auth.py), what /health and usage tell, and prompt work kept off the
event loop: the app over the FakeBackend, through real HTTP and the official openai client."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx2
import openai
import pytest
from fastapi.routing import APIRoute

from fake_backend import ADMIN_KEY, FakeBackend
from splitserve.api.auth import ApiKeys
from splitserve.api.server import build_app
from splitserve.config import HttpConfig

KEYS = {"key-of-a": "tenant-a", "key-of-b": "tenant-b"}
PROMPT = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}


@pytest.fixture
def keyed(serve_app: Callable[[HttpConfig], str], tmp_path: Path) -> str:
    """A server whose /v1/* needs one of KEYS (a key file) or "single-key" (--api-key)."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    return serve_app(HttpConfig(api_key_file=str(path), api_key="single-key"))


def _openai(url: str, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=10.0,
                         default_headers=headers or None)


def test_missing_or_wrong_key_is_401_in_openai_format(keyed: str, fake: FakeBackend) -> None:
    for key in ("key-of-c", "key-of-", "tenant-a"):
        with pytest.raises(openai.AuthenticationError) as info:
            _openai(keyed, key).completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        body = cast(dict[str, Any], info.value.body)
        assert info.value.status_code == 401
        assert body["type"] == "AuthenticationError" and body["code"] == 401
    for headers in ({}, {"Authorization": "key-of-a"}, {"Authorization": "Basic key-of-a"},
                    {"Authorization": "Bearer"}):
        raw = httpx2.post(f"{keyed}/v1/completions", headers=headers, json=PROMPT)
        assert raw.status_code == 401 and raw.headers["www-authenticate"] == "Bearer"
        assert raw.json()["error"]["message"].startswith("missing API key")
    assert not fake.requests, "nothing reached the backend"


def test_every_v1_route_needs_a_key_and_probes_do_not(keyed: str, fake: FakeBackend) -> None:
    app = build_app(fake, HttpConfig(api_key="k"))
    v1 = [(r.path, sorted(r.methods or ())[0]) for r in app.routes
          if isinstance(r, APIRoute) and r.path.startswith("/v1")]
    assert len(v1) == 3
    for path, method in v1:
        assert httpx2.request(method, keyed + path, json=PROMPT).status_code == 401, path
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx2.get(keyed + path).status_code == 200, path


def test_key_is_checked_before_the_body_is_read(keyed: str) -> None:
    """A client without a key cannot make the server buffer a body: 401 at once, although
    the declared body is over the 413 limit and never sent."""
    import socket
    host, port = keyed.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 3000000\r\n\r\n{")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head


def test_the_tenant_is_the_keys_whatever_the_client_sends(keyed: str, fake: FakeBackend) -> None:
    spoof = {"X-Tenant": "tenant-a"}
    body = {"user": "tenant-a"}
    a = _openai(keyed, "key-of-a")
    a.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    namespace_a = fake.last.namespace
    assert fake.last.tenant == "tenant-a"
    b = _openai(keyed, "key-of-b", **spoof)
    b.completions.create(model="smollm2", prompt="Hi", max_tokens=2, extra_body=body)
    assert fake.last.tenant == "tenant-b" and fake.last.namespace != namespace_a
    namespaces_b = {fake.last.namespace}
    for salt in ("tenant-a", namespace_a, ""):
        b.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                  extra_body={**body, "cache_salt": salt})
        assert fake.last.tenant == "tenant-b"
        namespaces_b.add(fake.last.namespace)
    assert len(namespaces_b) == 4, "each salt is its own sub-namespace of tenant-b"
    assert namespace_a not in namespaces_b
    _openai(keyed, "single-key").completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert fake.last.tenant == "default"


def test_key_file_errors_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    for content, match in (("[1]", "JSON object"), ('{"k": ""}', "tenant name"),
                           ("{nope", "cannot read"), ('{"k": "t" }', None)):
        path.write_text(content)
        if match is None:
            keys = ApiKeys.load(None, str(path))
            assert keys is not None and list(keys.tenants.values()) == ["t"]
            assert b"k" not in keys.tenants, "keys are kept as digests"
        else:
            with pytest.raises(ValueError, match=match):
                ApiKeys.load(None, str(path))
    with pytest.raises(ValueError, match="another tenant"):
        ApiKeys.load("k", str(path))
    assert ApiKeys.load(None, None) is None


# ---- /admin and /health --------------------------------------------------------------------

def _admin_routes(fake: FakeBackend) -> list[tuple[str, str]]:
    app = build_app(fake)
    return [(r.path, sorted(r.methods or ())[0]) for r in app.routes
            if isinstance(r, APIRoute) and r.path.startswith("/admin")]


def test_admin_routes_need_the_admin_key(http: httpx2.Client, fake: FakeBackend) -> None:
    routes = _admin_routes(fake)
    assert {p for p, _ in routes} == {"/admin/health", "/admin/pools", "/admin/faults",
                                      "/admin/workers", "/admin/drain", "/admin/switch",
                                      "/admin/tenants/{tenant}/cache"}
    for path, method in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        {"Authorization": f"Basic {ADMIN_KEY}"}):
            response = http.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == 401
    good = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert http.get("/admin/health", headers=good).json() == fake.health()


def test_admin_routes_are_off_without_an_admin_key(serve_app: Callable[[HttpConfig], str],
                                                   fake: FakeBackend) -> None:
    url = serve_app(HttpConfig())
    for path, method in _admin_routes(fake):
        for headers in ({}, {"Authorization": "Bearer anything"}):
            response = httpx2.request(method, url + path, headers=headers, json={})
            assert response.status_code == 403, path
            assert "--admin-key" in response.json()["error"]["message"]


def test_health_reveals_no_worker_identity(http: httpx2.Client, fake: FakeBackend) -> None:
    text = http.get("/health").text
    for worker in fake.health()["workers"]:  # type: ignore[attr-defined]
        for key in ("id", "incarnation", "pid"):
            assert str(worker[key]) not in text, (key, text)
    assert json.loads(text)["workers"]["total"] == 2


# ---- usage.prompt_tokens_details -------------------------------------------------------------

def test_cached_tokens_only_with_the_flag(serve_app: Callable[[HttpConfig], str],
                                          client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.num_cached_tokens = 3
    hidden = _openai(serve_app(HttpConfig()), "unused")
    shown = client  # the shared server runs with enable_prompt_tokens_details
    for c, expected in ((hidden, None), (shown, 3)):
        out = c.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
        chat = c.chat.completions.create(model="smollm2", max_tokens=2,
                                         messages=[{"role": "user", "content": "Hi"}])
        chunks = list(c.completions.create(model="smollm2", prompt="Hello", max_tokens=2,
                                           stream=True, stream_options={"include_usage": True}))
        for usage in (out.usage, chat.usage, chunks[-1].usage):
            assert usage is not None
            details = usage.prompt_tokens_details
            assert (details.cached_tokens if details is not None else None) == expected


# ---- prompt work off the event loop ----------------------------------------------------------

def test_tokenizing_runs_off_the_event_loop(http: httpx2.Client, fake: FakeBackend,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """While one request's prompt takes 1.5 s to tokenize, the server answers others. (A
    body of at most INLINE_BODY_BYTES is prepared on the loop: this one is larger.)"""
    from splitserve.api.server import INLINE_BODY_BYTES
    tokenizer = fake.model_info.tokenizer
    encode = tokenizer.encode
    entered = threading.Event()
    slow_prompt = "slow"
    big_body = json.dumps({**PROMPT, "prompt": slow_prompt}) + " " * INLINE_BODY_BYTES

    def slow_encode(text: str, *args: Any, **kwargs: Any) -> list[int]:
        if text == slow_prompt:
            entered.set()
            time.sleep(1.5)  # holds the thread it runs on; never releases it to the loop
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    slow = threading.Thread(target=http.post, args=("/v1/completions",),
                            kwargs={"content": big_body,
                                    "headers": {"Content-Type": "application/json"}})
    slow.start()
    assert entered.wait(5)
    t0 = time.monotonic()
    with httpx2.Client(base_url=str(http.base_url), timeout=10) as other:
        assert other.post("/v1/completions", json=PROMPT).status_code == 200
        assert other.get("/health").status_code == 200
    waited = time.monotonic() - t0
    slow.join(10)
    assert waited < 0.75, f"the other requests waited {waited:.2f} s for the slow prompt"
    assert [r.prompt_token_ids for r in fake.requests[-2:]] == [encode("Hello"),
                                                                encode(slow_prompt)]
