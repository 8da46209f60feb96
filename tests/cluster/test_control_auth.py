"""The control plane's authentication (cluster/auth.py, frontend/link.py) with real ZeroMQ
sockets against a real dispatcher: who gets in, under which identity, what is counted."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import KeyRing, ServerKeys, WorkerSecret
from splitserve.cluster.frontend.dispatcher import Dispatcher
from splitserve.cluster.runtime.local import LocalRuntime
from splitserve.cluster.worker.spec import WorkerSpec
from tests.cluster.test_dispatcher import (ScriptedWorker, collect, output, request, run,
                                           workers)


def dropped(d: Dispatcher, reason: str) -> float:
    value = d.metrics.registry.get_sample_value("splitserve_control_frames_dropped_total",
                                                {"reason": reason})
    return value or 0.0


def table(d: Dispatcher) -> object:
    """Everything registration decides, to compare before and after an attack."""
    return (sorted((i, repr(w.ready), w.healthy) for i, w in d.table.workers.items()),
            sorted(d.table.by_id), d.max_model_len, d.table.fingerprint)


async def until(pred: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def peer(ctx: zmq.asyncio.Context, d: Dispatcher, identity: bytes | None,
         secret: WorkerSecret | None) -> zmq.asyncio.Socket:
    """A DEALER to the dispatcher: `secret` None speaks plain ZeroMQ (no CURVE)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    if secret is not None:
        secret.connect(sock)
    sock.connect(d.address)
    return sock


def test_a_worker_secret_round_trips_and_never_shows_its_key() -> None:
    secret = WorkerSecret.generate(ServerKeys.generate().public)
    assert WorkerSecret.from_bytes(secret.to_bytes()) == secret
    assert secret.client_secret.decode() not in repr(secret)
    with_store = WorkerSecret.generate(ServerKeys.generate().public, bytes(range(32)))
    assert WorkerSecret.from_bytes(with_store.to_bytes()) == with_store
    assert bytes(range(32)).hex() not in repr(with_store) and "store_key" not in repr(with_store)
    assert ServerKeys.generate().secret.decode() not in repr(ServerKeys.generate())
    for bad in (b"", b"--spec", secret.to_bytes()[:-8],
                secret.to_bytes().replace(b"splitserve-curve/2", b"other/1"),
                with_store.to_bytes().replace(bytes(range(32)).hex().encode(), b"zz" * 32),
                with_store.to_bytes().replace(bytes(range(32)).hex().encode(), b"ab"),
                secret.to_bytes().replace(secret.client_secret[:5], b"\x00\x01\x02\x03\x04")):
        with pytest.raises(ValueError):
            WorkerSecret.from_bytes(bad)


def test_the_key_ring_maps_each_key_to_one_identity() -> None:
    ring = KeyRing()
    a, b = zmq.curve_keypair()[0], zmq.curve_keypair()[0]
    ring.allow(b"both-0:1", a)
    assert ring.identity_of(a) == b"both-0:1" and ring.is_allowed(b"both-0:1")
    with pytest.raises(ValueError):  # one key never speaks for two identities
        ring.allow(b"both-1:1", a)
    ring.allow(b"both-0:1", b)  # a new key replaces the identity's old one
    assert ring.identity_of(a) is None and ring.identity_of(b) == b"both-0:1"
    ring.revoke(b"both-0:1")
    assert ring.identity_of(b) is None and not ring.is_allowed(b"both-0:1")
    for bad_identity in (b"", b"\x00abc", b"x" * 256, "é".encode()):
        with pytest.raises(ValueError):
            ring.allow(bad_identity, a)
    with pytest.raises(ValueError):
        ring.allow(b"both-0:1", b"not a key")


def test_unauthenticated_peers_are_dropped_and_counted() -> None:
    """Plain ZeroMQ, an unregistered CURVE key and a wrong server key all fail at the
    handshake: nothing they send reaches the dispatcher, each attempt is counted."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        before = table(d)
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        stranger = WorkerSecret.generate(d.link.server_public_key)  # never registered
        wrong_server = WorkerSecret.generate(ServerKeys.generate().public)
        socks = [peer(ctx, d, b"both-0:1", None), peer(ctx, d, b"both-7:1", stranger),
                 peer(ctx, d, b"both-8:1", wrong_server)]
        evil = P.encode(output("r1", 0, [666], 0, "evil", finished=True))
        ready = P.encode(P.WorkerReady("both-7", P.Role.BOTH, 1, "f" * 32, 16, 1, 1, 1,
                                       "tcp://127.0.0.1:1", 1))
        for sock in socks:
            for frame in (ready, evil):
                # A peer whose handshake failed may have no pipe to queue on: then nothing
                # is sent at all (waiting for one would hang on a busy machine).
                with contextlib.suppress(zmq.Again):
                    await sock.send(frame, flags=zmq.NOBLOCK)
        await until(lambda: dropped(d, "handshake") >= 2 and dropped(d, "unknown_key") >= 1)
        await asyncio.sleep(0.2)
        assert table(d) == before and not task.done()
        assert dropped(d, "identity_mismatch") == dropped(d, "refused") == 0
        await w.send(output("r1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]  # the real worker's tokens only
        for sock in socks:
            sock.close()
    run(scenario)


def test_a_valid_key_cannot_speak_as_another_worker() -> None:
    """A peer with a registered key sends under other routing ids: a registered but not
    yet connected worker's, a connected one's, and one ZeroMQ makes up. Nothing it sends
    is taken as theirs; the mismatches are counted; the real workers go on."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        (w,) = await workers(d, ctx, "both")
        task = asyncio.create_task(collect(d.generate(request())))
        await w.expect(P.Generate)
        own = d.link.enroll(b"both-5:1")  # a worker's key, used under other names
        d.link.enroll(b"both-1:1")  # registered for another worker, not connected yet
        before = table(d)
        evil = P.encode(output("r1", 0, [666], 0, "evil", finished=True))
        forged_ready = P.encode(P.WorkerReady("both-1", P.Role.BOTH, 1, "f" * 32, 16, 100,
                                              8, 8, "tcp://127.0.0.1:1", 1))
        as_other = peer(ctx, d, b"both-1:1", own)
        made_up = peer(ctx, d, None, own)
        as_connected = peer(ctx, d, b"both-0:1", own)  # ZeroMQ refuses a taken id
        for sock in (as_other, made_up, as_connected):
            await sock.send(forged_ready)
            await sock.send(evil)
        await until(lambda: dropped(d, "identity_mismatch") == 4)
        await asyncio.sleep(0.3)  # nothing more arrives (as_connected's frames never do)
        assert dropped(d, "identity_mismatch") == 4
        assert table(d) == before and not task.done()
        await w.send(output("r1", 0, [7], 0, "a", finished=True))
        assert [x.token_ids for x in await task] == [[7]]
        for sock in (as_other, made_up, as_connected):
            sock.close()
        # both-1's own key registers it, once the ROUTER noticed the impostor left its
        # routing id. Until then ZeroMQ refuses the id, and a refused connection stays up
        # with everything sent on it dropped: each try is a new connection.
        for _ in range(50):
            real = ScriptedWorker(ctx, d, "both", index=1)
            await real.register()
            await asyncio.sleep(0.2)
            if "both-1" in d.table.by_id:
                break
            real.sock.close()
        assert "both-1" in d.table.by_id
    run(scenario)


def test_a_removed_worker_s_key_is_revoked() -> None:
    """A worker that leaves loses its key: its connection is fenced (told to exit) and a
    new connection with the key fails the handshake."""
    async def scenario(d: Dispatcher, ctx: zmq.asyncio.Context) -> None:
        identity = b"both-0:1"
        secret = d.link.enroll(identity)
        w = peer(ctx, d, identity, secret)
        await w.send(P.encode(P.WorkerReady("both-0", P.Role.BOTH, 1, "f" * 32, 16, 100,
                                            2048, 8, "tcp://127.0.0.1:1", 1)))
        await d.wait_for_workers(1, 5)
        d.mark_dead(identity, "missed its heartbeat deadline")
        assert not d.link.is_allowed(identity)
        await w.send(P.encode(P.KVEventBatch(1, [])))
        assert isinstance(P.decode(await asyncio.wait_for(w.recv(), 10)), P.Shutdown)
        w.close()
        again = peer(ctx, d, identity, secret)
        await again.send(P.encode(P.WorkerReady("both-0", P.Role.BOTH, 1, "f" * 32, 16, 100,
                                                2048, 8, "tcp://127.0.0.1:1", 1)))
        await until(lambda: dropped(d, "unknown_key") >= 1)
        assert not d.table.workers
        again.close()
    run(scenario)


class _Pipe:
    def __init__(self) -> None:
        self.data, self.closed = b"", False

    def write(self, data: bytes) -> None:
        self.data += data

    def close(self) -> None:
        self.closed = True


def test_the_local_runtime_hands_the_secret_over_stdin_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[dict[str, Any]] = []

    class FakePopen:
        def __init__(self, args: list[str], env: dict[str, str], stdin: int) -> None:
            self.pid, self.stdin = 4242, _Pipe()
            started.append({"args": args, "env": env, "stdin": stdin, "pipe": self.stdin})

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    secret = WorkerSecret.generate(ServerKeys.generate().public)
    spec = WorkerSpec(P.Role.DECODE, 0, 1, "tcp://127.0.0.1:5555")
    LocalRuntime().start_worker(spec, secret)
    (call,) = started
    visible = " ".join(call["args"]) + " ".join(call["env"].values())
    for key in (secret.client_secret, secret.client_public, secret.server_public):
        assert key.decode() not in visible
    pipe = call["pipe"]
    assert call["stdin"] == subprocess.PIPE and pipe.closed  # type: ignore[attr-defined]
    assert WorkerSecret.from_bytes(pipe.data) == secret  # type: ignore[attr-defined]


def test_a_worker_started_without_a_secret_refuses_to_run() -> None:
    spec = WorkerSpec(P.Role.DECODE, 0, 1, "tcp://127.0.0.1:1").to_json()
    proc = subprocess.run([sys.executable, "-m", "splitserve.cluster.worker", spec],
                          input=b"", capture_output=True, timeout=120)
    assert proc.returncode == 2 and b"no control-plane secret" in proc.stderr
