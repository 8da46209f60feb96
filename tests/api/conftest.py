"""The app over a FakeBackend, served by a real uvicorn on 127.0.0.1 (a free port) in a
background thread, so every test goes through real HTTP."""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import httpx2
import openai
import pytest
import uvicorn

from fake_backend import FakeBackend, wait_until
from splitserve.api.server import build_app
from splitserve.model.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def shared_backend(default_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend.create(default_tokenizer)


@pytest.fixture(scope="session")
def server_url(shared_backend: FakeBackend) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(shared_backend), log_config=None, lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 10.0), "uvicorn did not start"
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10.0)
    sock.close()


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
