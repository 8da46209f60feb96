"""The scripted OpenAI server (real uvicorn on a free port, in a thread) for client tests."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from fake_openai_server import FakeOpenAI
from splitserve.bench import runner


@pytest.fixture(scope="session")
def _fake_server() -> Iterator[tuple[FakeOpenAI, str]]:
    fake = FakeOpenAI()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(fake.app(), log_config=None, lifespan="off",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    yield fake, f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10.0)
    sock.close()


@pytest.fixture
def fake(_fake_server: tuple[FakeOpenAI, str], monkeypatch: pytest.MonkeyPatch) -> FakeOpenAI:
    """The scripted server, reset to answer normally (and no settle wait after runs)."""
    monkeypatch.setattr(runner, "METRICS_SETTLE_S", 0.0)
    _fake_server[0].reset()
    return _fake_server[0]


@pytest.fixture
def fake_url(_fake_server: tuple[FakeOpenAI, str], fake: FakeOpenAI) -> str:
    return _fake_server[1]
