"""Slow and many clients against the edge (api/http_protocol.py, api/middleware.py), with raw
sockets: a head or a body trickled in is cut off at its deadline with a 408 and the
connection closed; connections beyond the cap get 503; the server serves on."""
from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx2
import pytest

from fake_backend import FakeBackend
from splitserve.config import HttpConfig

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
BODY = b'{"model": "smollm2", "prompt": "Hello", "max_tokens": 2}'


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _trickle(sock: socket.socket, data: bytes, every_s: float, for_s: float) -> bool:
    """Sends `data` a byte at a time; False once the server closed the connection."""
    deadline = time.monotonic() + for_s
    for byte in data:
        if time.monotonic() > deadline:
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # reset or broken pipe: the server is gone
            return False
        time.sleep(every_s)
    return True


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (timeout: it did not)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _read_response(sock: socket.socket) -> bytes:
    """One whole response (head and Content-Length body): a keep-alive connection's next
    read then starts at the next response, however the server's bytes were segmented."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _request(body: bytes = BODY) -> bytes:
    return HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.fixture
def strict(serve_app: Callable[[HttpConfig], str]) -> str:
    return serve_app(HttpConfig(header_timeout_s=1.0, body_timeout_s=1.0,
                                timeout_keep_alive=5))


def test_slow_head_is_cut_off_with_408(strict: str, fake: FakeBackend) -> None:
    with _connect(strict) as sock:
        t0 = time.monotonic()
        _trickle(sock, _request(), every_s=0.2, for_s=3.0)  # ~5 bytes a second
        sock.settimeout(5)
        answer = _read_all(sock)
        assert time.monotonic() - t0 < 4.0
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert not fake.requests


def test_silent_connection_is_closed_at_the_head_deadline(strict: str) -> None:
    with _connect(strict) as sock:
        t0 = time.monotonic()
        answer = _read_all(sock)
        assert 0.9 < time.monotonic() - t0 < 3.0
    assert answer.startswith(b"HTTP/1.1 408 "), answer


def test_keep_alive_idles_past_the_head_deadline_but_a_slow_next_head_does_not(
        strict: str, fake: FakeBackend) -> None:
    with _connect(strict) as sock:
        sock.sendall(_request())
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(2.0)  # idle: keep-alive (5 s) rules, not the head deadline (1 s)
        sock.sendall(_request())
        assert _read_response(sock).startswith(b"HTTP/1.1 200 ")
        _trickle(sock, _request(), every_s=0.2, for_s=3.0)
        sock.settimeout(5)
        assert b"HTTP/1.1 408 " in _read_all(sock)
    assert len(fake.requests) == 2


def test_slow_body_is_cut_off_with_408_and_the_connection_closed(strict: str,
                                                                  fake: FakeBackend) -> None:
    with _connect(strict) as sock:
        sock.sendall(HEAD + f"Content-Length: {len(BODY)}\r\n\r\n".encode())
        t0 = time.monotonic()
        still_open = _trickle(sock, BODY, every_s=0.2, for_s=4.0)
        sock.settimeout(5)
        try:
            answer = _read_all(sock)
        except ConnectionResetError:  # our bytes after its close; the 408 came first
            answer = b"reset"
        assert time.monotonic() - t0 < 6.0
    assert answer.startswith(b"HTTP/1.1 408 ") or not still_open, answer
    if answer != b"reset":
        assert b"connection: close" in answer.lower() and b"--body-timeout-s" in answer
    assert not fake.requests


def test_connections_beyond_the_limit_get_503(serve_app: Callable[[HttpConfig], str],
                                              fake: FakeBackend) -> None:
    url = serve_app(HttpConfig(limit_concurrency=4, header_timeout_s=30.0))
    idle = [_connect(url) for _ in range(3)]  # with the next one: 4 connections open
    try:
        time.sleep(0.2)
        with httpx2.Client(base_url=url, timeout=10) as http:
            refused = http.post("/v1/completions", content=BODY)
            assert refused.status_code == 503, refused.text
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    with httpx2.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/completions", content=BODY).status_code == 200
    assert len(fake.requests) == 1


def test_many_slow_clients_are_all_dropped_and_the_server_serves_on(
        serve_app: Callable[[HttpConfig], str], fake: FakeBackend) -> None:
    url = serve_app(HttpConfig(limit_concurrency=64, header_timeout_s=1.0))
    clients = [_connect(url) for _ in range(200)]  # more than the limit: all accepted
    for sock in clients:
        sock.sendall(HEAD[:10])  # a head begun, never finished
    deadline = time.monotonic() + 5.0
    for sock in clients:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            assert _read_all(sock).startswith(b"HTTP/1.1 408 ")
        except ConnectionResetError:
            pass  # closed too
        sock.close()
    with httpx2.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/completions", content=BODY).status_code == 200
