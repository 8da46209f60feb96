"""The KV listener under hostile peers (issue 16): idle and slow connections cost a bounded
amount of memory and no thread each, and a real transfer still commits among them; headers
have a size cap and a deadline; the accept loop survives its errors and, if it ever dies,
the receiver says so; shared-memory rings are sealed and unsealed ones are refused."""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

import splitserve.transfer.gate as gate_module
from splitserve.errors import WorkerFailed
from splitserve.transfer.blob import PRELUDE, FrameKind
from splitserve.transfer.gate import HELD_CONNECTION_BYTES, GateLimits
from splitserve.transfer.mac import NO_TAG
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.shm import new_ring
from splitserve.transfer.transport import TransferState, get_transport
from tests.transfer.conftest import DEADLINE_S, PARAMS, PROMPT, Pair

NUM_IDLE = 2000
# Allocator and interpreter noise on top of the documented per-connection bound.
RSS_SLACK = 4 << 20

# Another process opens connections (so their memory is not counted here) and holds them:
# idle (sends nothing; shm peers do not even hand over rings), or "slow" (a prelude
# announcing a header of argv[4] bytes, then 100 bytes of it, then nothing; shm peers
# through real rings: splitserve.transfer.shm imports no torch).
_PEERS = r"""
import resource, socket, struct, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
transport, address, count, claim = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
slow = struct.pack("<4sBBHQ32s", b"SSKV", 1, 0, 0, claim, bytes(32)) + bytes(100)
held = []
for _ in range(count):
    if transport == "tcp":
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
        if claim:
            sock.sendall(slow)
    elif claim:
        from splitserve.transfer.shm import ShmTransport
        sock = ShmTransport().connect(address, time.monotonic() + 30)
        sock.send([slow], time.monotonic() + 30)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(address.removeprefix("shm://"))
    held.append(sock)
print("ready", flush=True)
time.sleep(600)
"""
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def enough_descriptors() -> Iterator[None]:
    """Room for a receiver holding max_connections descriptors (CI defaults to 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096
    if want < 2048:
        pytest.skip(f"descriptor limit {hard} is too low for these tests")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def spawn_peers() -> Iterator[Callable[[str, str, int, int], subprocess.Popen]]:
    procs: list[subprocess.Popen] = []

    def spawn(transport: str, address: str, count: int, claim: int = 0) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _PEERS, transport, address, str(count),
                                 str(claim)], stdout=subprocess.PIPE, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": ROOT})
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 2 * DEADLINE_S)
        assert ready and proc.stdout.readline().strip() == b"ready", "peers did not start"
        return proc

    yield spawn
    for proc in procs:
        proc.kill()
        proc.wait(timeout=DEADLINE_S)


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_for(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed (a reset if it left our bytes unread) before DEADLINE_S."""
    sock.settimeout(DEADLINE_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def with_limits(pair: Pair, transport: str, **limits: object) -> KVReceiver:
    pair.receiver.close()
    pair.receiver = KVReceiver(pair.b.engine, get_transport(transport).listen(),
                               limits=GateLimits(**limits))  # type: ignore[arg-type]
    return pair.receiver


def assert_real_transfer_commits(pair: Pair, rid: str) -> None:
    tokens, send, recv = pair.handoff(rid, PROMPT, PARAMS)
    assert send.poll().state == recv.poll().state == TransferState.DONE
    assert tokens == pair.a.generate(PROMPT, PARAMS)[0].token_ids
    pair.b.engine.check_invariants()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_idle_connections_stay_within_the_memory_bound_and_a_real_transfer_commits(
        make_pair: Callable[..., Pair], spawn_peers: Callable, transport: str) -> None:
    pair = make_pair(transport)
    cap = GateLimits().max_connections
    assert cap < NUM_IDLE  # so the oldest idle connections must make room
    assert_real_transfer_commits(pair, "warm-up")  # threads and buffers of a transfer exist
    rss, threads = rss_bytes(), threading.active_count()
    spawn_peers(transport, pair.receiver.address, NUM_IDLE)
    wait_for(lambda: pair.receiver.stats.accepted >= NUM_IDLE + 1)  # + the warm-up's
    stats = pair.receiver.stats
    grown = rss_bytes() - rss
    assert stats.held <= cap and stats.evicted >= NUM_IDLE - cap, stats
    assert threading.active_count() <= threads, "a thread per connection"
    assert grown <= cap * HELD_CONNECTION_BYTES + RSS_SLACK, f"{grown} bytes for {stats}"
    assert_real_transfer_commits(pair, "among-idle")  # its connection evicts an idle one


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_slow_headers_are_bounded_by_the_header_budget(
        make_pair: Callable[..., Pair], spawn_peers: Callable, transport: str) -> None:
    """Peers announce the largest header allowed and trickle it: the bytes reserved for
    header bodies never pass the budget (the oldest make room), and a real transfer,
    whose header comes whole, commits."""
    pair = make_pair(transport)
    receiver = with_limits(pair, transport, max_header_bytes=1 << 20, header_budget_bytes=4 << 20)
    spawn_peers(transport, receiver.address, 20, 1 << 20)
    wait_for(lambda: receiver.stats.accepted >= 20 and receiver.stats.evicted >= 16)
    assert receiver._gate._reserved <= 4 << 20
    assert_real_transfer_commits(pair, "r")


def test_an_oversized_header_is_refused_before_allocating(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    receiver = with_limits(pair, "tcp", max_header_bytes=1 << 20, header_budget_bytes=1 << 20)
    host, port = receiver.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(PRELUDE.pack(b"SSKV", FrameKind.HEADER, 0, 0, (1 << 20) + 1, NO_TAG))
        assert closed_by_peer(sock)  # nothing read past the prelude
    assert receiver.stats.refused == 1 and receiver._gate._reserved == 0
    assert_real_transfer_commits(pair, "r")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_connection_without_a_header_is_closed_at_the_header_deadline(
        make_pair: Callable[..., Pair], spawn_peers: Callable, transport: str) -> None:
    pair = make_pair(transport)
    receiver = with_limits(pair, transport, header_timeout_s=0.3)
    spawn_peers(transport, receiver.address, 5)
    wait_for(lambda: receiver.stats.timed_out == 5)
    assert receiver.stats.held == 0
    assert_real_transfer_commits(pair, "r")


def test_the_accept_loop_survives_its_errors(make_pair: Callable[..., Pair],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn that raises is logged and counted; out of descriptors, the oldest held
    connection is closed to make room; either way the loop goes on."""
    pair = make_pair("tcp")
    listener = pair.receiver.listener
    accept = listener.accept
    faults = [RuntimeError("a bug"), OSError(errno.EMFILE, "Too many open files")]

    def flaky(deadline: float):  # type: ignore[no-untyped-def]
        if faults:
            raise faults.pop(0)
        return accept(deadline)

    host, port = pair.receiver.address.removeprefix("tcp://").rsplit(":", 1)
    idle = socket.create_connection((host, int(port)))  # held when EMFILE strikes
    wait_for(lambda: pair.receiver.stats.held == 1)
    monkeypatch.setattr(listener, "accept", flaky)
    probe = socket.create_connection((host, int(port)))
    wait_for(lambda: pair.receiver.stats.accepted == 2  # the probe, after both faults
             and pair.receiver.stats.held == 1)
    stats = pair.receiver.stats
    assert stats.failed_turns == 1 and stats.evicted == 1 and stats.held == 1, stats
    assert_real_transfer_commits(pair, "r")
    idle.close()
    probe.close()


def test_a_dead_accept_loop_makes_the_receiver_fail_loudly(
        make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch) -> None:
    pair = make_pair("tcp")
    monkeypatch.setattr(gate_module, "MAX_FAILED_TURNS", 3)

    def broken(deadline: float) -> None:
        raise RuntimeError("the listener is broken for good")

    monkeypatch.setattr(pair.receiver.listener, "accept", broken)
    host, port = pair.receiver.address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))):  # makes the listener readable
        wait_for(lambda: pair.receiver._gate.failure is not None)
    with pytest.raises(WorkerFailed, match="KV listener"):
        pair.receiver.poll()


def test_shared_memory_rings_are_sealed() -> None:
    fd = new_ring("test-ring", 1 << 20)
    try:
        for size in (1 << 19, 1 << 21, 0):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)  # neither shrink nor grow: a reader never faults
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # sealed for good
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)


def _unsealed(size: int) -> int:
    fd = os.memfd_create("hostile")
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize("rings", ["unsealed", "too big", "wrong size", "a pipe"])
def test_hostile_rings_are_refused_and_the_receiver_goes_on(make_pair: Callable[..., Pair],
                                                            rings: str) -> None:
    pair = make_pair("shm")
    sizes = {"too big": 1 << 30, "wrong size": 4096}.get(rings, 1 << 20)
    if rings == "unsealed":
        fds = [_unsealed(1 << 20), _unsealed(1 << 20)]
    elif rings == "a pipe":
        fds = list(os.pipe())
    else:
        fds = [new_ring("hostile", 1 << 20), new_ring("hostile", 1 << 20)]
    if rings != "a pipe":  # a well-formed prelude in the ring: only the ring is wrong
        with mmap.mmap(fds[0], 1 << 20) as ring:
            ring[:PRELUDE.size] = PRELUDE.pack(b"SSKV", FrameKind.HEADER, 0, 0, 1000, NO_TAG)
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.connect(pair.receiver.address.removeprefix("shm://"))
        socket.send_fds(sock, [struct.pack("<4sQQ", b"SSHM", sizes, 1 << 20)], fds)
        try:
            sock.sendall(struct.pack("<BQ", 1, PRELUDE.size))  # a DATA doorbell for the prelude
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused on the rings alone, before the doorbell (a busy machine's timing)
        else:
            assert closed_by_peer(sock)  # refused
    finally:
        sock.close()
        for fd in fds:
            os.close(fd)
    assert pair.receiver.stats.refused == 1
    assert_real_transfer_commits(pair, "r")
