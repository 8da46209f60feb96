"""The app over a FakeBackend, served by a real uvicorn on 127.0.0.1 (a free port, the
edge's own protocol and limits: api/http_protocol.py) in a background thread, so every test
goes through real HTTP."""
from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx2
import openai
import pytest
import uvicorn

from fake_backend import ADMIN_KEY, FakeBackend, wait_until
from splitserve.api.http_protocol import uvicorn_config
from splitserve.api.server import build_app
from splitserve.config import HttpConfig
from splitserve.model.tokenizer import Tokenizer

# The shared server reports cached tokens (test_server checks usage) and has an admin key.
SHARED_HTTP = HttpConfig(admin_key=ADMIN_KEY, enable_prompt_tokens_details=True)


@contextmanager
def serving(backend: FakeBackend, http: HttpConfig) -> Iterator[str]:
    """`build_app(backend, http)` under uvicorn as `serve` runs it; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(build_app(backend, http), http, log_config=None, lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10.0), "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10.0)
        sock.close()


@pytest.fixture(scope="session")
def shared_backend(default_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend.create(default_tokenizer)


@pytest.fixture(scope="session")
def server_url(shared_backend: FakeBackend) -> Iterator[str]:
    with serving(shared_backend, SHARED_HTTP) as url:
        yield url


@pytest.fixture
def serve_app(fake: FakeBackend) -> Iterator[Callable[[HttpConfig], str]]:
    """Factory: serve_app(http_config) -> URL of another server over the same backend;
    stopped after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda http: stack.enter_context(serving(fake, http))


@pytest.fixture
def fake(shared_backend: FakeBackend) -> FakeBackend:
    """The backend behind the server, reset to answer normally."""
    shared_backend.reset()
    return shared_backend


@pytest.fixture
def client(server_url: str, fake: FakeBackend) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0,
                         timeout=10.0)


@pytest.fixture
def http(server_url: str, fake: FakeBackend) -> Iterator[httpx2.Client]:
    with httpx2.Client(base_url=server_url, timeout=10.0) as c:
        yield c
