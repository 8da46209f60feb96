"""A real cluster (`splitserve serve`: the frontend and worker processes) with the
authenticated control plane: workers get their keys on stdin, register and serve; no key
is in a worker's environment (nor on its command line: tests/cluster/test_control_auth.py
checks what the runtime passes); and peers that connect to the frontend's control
address (on every worker's command line at start) get nothing in, counted in /metrics."""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils import z85

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import ServerKeys, WorkerSecret
from tests.faults.harness import metric

FLAGS = ("--threads-per-worker", "1", "--max-model-len", "1024",
         "--kv-cache-memory-bytes", str(64 << 20))


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server("--mode", "disagg", "--disagg-policy", "always", *FLAGS)


def worker_processes(server: Any) -> dict[int, dict[str, str]]:
    """pid -> environment of the server's worker processes (its children)."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server.proc.pid:
            out[int(proc.name)] = dict(e.partition("=")[::2] for e in environ if e)
    return out


def control_address(server: Any) -> str:
    """The frontend's ROUTER: the port its process listens on that greets in ZMTP."""
    inodes = set()
    for fd in Path(f"/proc/{server.proc.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed since the listing
            continue
        m = re.match(r"socket:\[(\d+)\]", target)
        if m:
            inodes.add(m.group(1))
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
            ports.add(int(cols[1].split(":")[1], 16))
    zmtp = []
    for port in ports:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as probe:
            try:
                if probe.recv(1) == b"\xff":  # a ZMTP signature starts with 0xFF
                    zmtp.append(port)
            except TimeoutError:  # HTTP waits for the client to speak first
                pass
    assert len(zmtp) == 1, (ports, zmtp)
    return f"tcp://127.0.0.1:{zmtp[0]}"


def is_curve_key(text: str) -> bool:
    try:
        return len(text) == 40 and len(z85.decode(text.encode())) == 32
    except (ValueError, KeyError):
        return False


def complete(server: Any) -> str:
    model = server.get_json("/v1/models")["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The capital of France is",
                       "max_tokens": 6, "temperature": 0}).encode()
    req = urllib.request.Request(server.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


def test_workers_register_and_serve_with_no_key_in_their_environment(server: Any) -> None:
    assert metric(server, "splitserve_workers", state="healthy") == 2
    assert complete(server)
    procs = worker_processes(server)
    assert len(procs) == 2
    for environ in procs.values():
        assert not any(is_curve_key(v) for v in environ.values())


def test_peers_without_a_registered_key_get_nothing_in(server: Any) -> None:
    """They connect to the frontend address on every worker's command line: with no
    CURVE, with a key of their own, or with bytes that are not ZeroMQ at all; one claims
    a real worker's identity and registers, another streams a forged output."""
    procs = worker_processes(server)
    before = metric(server, "splitserve_control_frames_dropped_total", reason="handshake")
    address = control_address(server)  # its probe is a refused handshake too
    ctx = zmq.Context()
    socks = []
    for secret in (None, WorkerSecret.generate(ServerKeys.generate().public)):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # A DEALER's send waits for a connection, and a refused handshake may leave it none
        # (a CI run hung here for good): each send gets a deadline, and one that times out
        # got nothing in either.
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.setsockopt(zmq.ROUTING_ID, b"decode-0:1")
        if secret is not None:
            secret.connect(sock)
        sock.connect(address)
        for msg in (P.WorkerReady("decode-0", P.Role.DECODE, 1, "f" * 32, 16, 1, 16, 1,
                                  "tcp://127.0.0.1:1", 1),
                    P.Output("cmpl-x", 0, [1], 0, "evil", 0, None, True, "stop", None, 1, 0)):
            with contextlib.suppress(zmq.Again):
                sock.send(P.encode(msg))
        socks.append(sock)
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"\xff" + os.urandom(4096))
    deadline = time.monotonic() + 20
    while metric(server, "splitserve_control_frames_dropped_total",
                 reason="handshake") < before + 3:
        assert time.monotonic() < deadline, "refused handshakes were not counted"
        time.sleep(0.2)
    for sock in socks:
        sock.close()
    ctx.term()
    assert metric(server, "splitserve_workers", state="healthy") == 2
    assert metric(server, "splitserve_control_frames_dropped_total",
                  reason="identity_mismatch") == 0
    assert worker_processes(server).keys() == procs.keys()  # no worker was disturbed
    assert complete(server)


def test_hostile_kv_peers_are_visible_in_metrics(server: Any) -> None:
    """Idle connections and a header for no transfer at the decode worker's KV listener
    show in /metrics (held connections; closed, by reason) and disturb nothing."""
    decode = [w for w in server.workers() if w["role"] == "decode"][0]
    host, port = str(decode["kv_address"]).removeprefix("tcp://").rsplit(":", 1)
    labels = {"worker": decode["id"]}
    rejected = metric(server, "splitserve_kv_listener_closed_connections_total",
                      reason="rejected", **labels)
    body = b"\x81\xa1x\x01"  # msgpack {"x": 1}: not a header
    prelude = struct.pack("<4sBBHQ32s", b"SSKV", 1, 0, 0, len(body), os.urandom(32))
    idle = [socket.create_connection((host, int(port))) for _ in range(3)]
    try:
        with socket.create_connection((host, int(port))) as forger:
            forger.sendall(prelude + body)
            deadline = time.monotonic() + 20
            while (metric(server, "splitserve_kv_listener_closed_connections_total",
                          reason="rejected", **labels) < rejected + 1
                   or metric(server, "splitserve_kv_listener_held_connections", **labels) < 3):
                assert time.monotonic() < deadline, server.get_text("/metrics")[-3000:]
                time.sleep(0.2)
        assert complete(server)  # a real transfer still commits beside the idle ones
    finally:
        for sock in idle:
            sock.close()
