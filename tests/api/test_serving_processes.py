"""`splitserve serve` as an operating system sees it: process titles, every worker thread's
niceness, the startup heap frozen in each process, a clean shutdown that leaves no worker
behind, and SIGTERM draining the requests in flight (real processes, the official
`openai` client over real HTTP)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from typing import Any

import openai

FLAGS = ("--threads-per-worker", "1", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(256 << 20))


def _titles() -> dict[int, str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    titles = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        titles[int(pid)] = args
    return titles


def _thread_nice(pid: int) -> dict[int, int]:
    nices = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            nices[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice
    return nices


def _thread_nices(pid: int) -> set[int]:
    return set(_thread_nice(pid).values())


def _leases(frontend: int) -> list[str]:
    """The lease files of the server whose frontend is `frontend` (cluster/specs.py)."""
    from splitserve.cluster.worker.lending import lease_dir
    return sorted(n for n in os.listdir(lease_dir()) if n.startswith(f"splitserve-{frontend}-"))


def test_process_titles_niceness_and_clean_shutdown(start_server: Any) -> None:
    server = start_server("--mode", "disagg", *FLAGS[2:])  # borrowing: the default
    pids = server.worker_pids()
    titles = _titles()
    assert titles[server.proc.pid].startswith("splitserve-frontend")
    assert sorted(titles[p].split()[0] for p in pids) == ["splitserve-decode-0",
                                                          "splitserve-prefill-0"]
    # Every thread of a worker (engine, OpenMP, ZeroMQ, KV) runs --worker-nice (5) nicer
    # than the frontend, whose own threads keep its niceness, pinned to the worker's
    # cores; but the prefill worker's helper threads, one on each core the decode worker
    # lends it, at 19 (cluster/worker/lending.py), each with that core's lease file.
    [front] = _thread_nices(server.proc.pid)
    cores = os.sched_getaffinity(server.proc.pid)
    roles = {titles[p].split()[0]: p for p in pids}
    prefill, decode = roles["splitserve-prefill-0"], roles["splitserve-decode-0"]
    worker_nice = min(19, front + 5)
    assert _thread_nices(decode) == {worker_nice}
    assert os.sched_getaffinity(decode) < cores or len(cores) == 1
    if len(cores) > 1:
        lent = os.sched_getaffinity(decode)
        assert os.sched_getaffinity(prefill) == cores - lent
        nices = _thread_nice(prefill)
        helpers = sorted(tid for tid, nice in nices.items() if nice == 19)
        assert {nices[t] for t in nices if t not in helpers} == {worker_nice}
        assert sorted(c for t in helpers for c in os.sched_getaffinity(t)) == sorted(lent)
        assert sorted(n.rsplit("-core", 1)[1] for n in _leases(server.proc.pid)) == sorted(
            f"{c}.lease" for c in lent)
    # Each process froze its startup heap before serving (cluster/heap.py).
    frozen = re.findall(r"(\S+): froze the startup heap \((\d+) objects\)", server.log())
    assert sorted(name for name, _ in frozen) == ["decode-0", "frontend", "prefill-0"], frozen
    assert all(int(n) > 10_000 for _, n in frozen), frozen
    assert server.stop() == 0, server.log()
    assert "when stopped" not in server.log(), server.log()  # each worker exited 0
    time.sleep(0.5)
    alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
             "zombie" not in open(f"/proc/{p}/status").read().lower()]
    assert not alive, f"workers left behind: {alive}"
    assert not _leases(server.proc.pid), "lease files left behind"


def test_sigterm_drains_in_flight_requests(start_server: Any) -> None:
    server = start_server("--mode", "agg", *FLAGS)
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    name = c.models.list().data[0].id
    got: list[str] = []
    started = threading.Event()

    def stream() -> None:
        for chunk in c.completions.create(model=name, prompt="Tell me a story.", max_tokens=40,
                                          temperature=0, stream=True,
                                          extra_body={"ignore_eos": True},
                                          stream_options={"include_usage": True}):
            started.set()
            if chunk.usage is not None:
                got.append(str(chunk.usage.completion_tokens))
    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)  # mid-stream
    t.join(120)
    assert got == ["40"], "the in-flight request finished"
    assert server.stop() == 0, server.log()


def test_a_paced_decode_worker_lends_its_core_between_steps(start_server: Any) -> None:
    """--slo-tpot-ms 200, disagg, borrowing (the defaults otherwise): while the prefill
    worker computes a long prompt, the decode worker steps its stream about every 160 ms
    (0.8 x the target) and keeps its lease down in between, so the prefill's helper gets
    the core (cluster/worker/lending.py); the stream's tokens are those it gets alone."""
    import struct

    from splitserve.cluster.worker.lending import lease_dir
    if len(os.sched_getaffinity(0)) < 2:
        return  # one core: nothing to lend (test_runtimes covers the specs)
    server = start_server("--mode", "disagg", "--disagg-policy", "always",
                          "--slo-tpot-ms", "200", *FLAGS[2:])
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    name = c.models.list().data[0].id
    [lease] = [os.path.join(lease_dir(), n) for n in _leases(server.proc.pid)]
    # The workers told the router (its TPOT rule for local prefills counts the pace).
    told = {w["id"]: (w["pace_s"] and round(w["pace_s"], 6), w["borrows_cores"])
            for w in server.get_json("/admin/health")["workers"]}
    assert told == {"prefill-0": (None, True), "decode-0": (0.16, False)}, told
    story = dict(model=name, prompt="Tell me a story.", max_tokens=64, temperature=0,
                 extra_body={"ignore_eos": True})
    arrivals: list[float] = []
    texts: list[str] = []

    def stream() -> None:
        for chunk in c.completions.create(stream=True, **story):  # type: ignore[call-overload]
            arrivals.append(time.monotonic())
            texts.append(chunk.choices[0].text)
    long_prompt = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(110))
    done = threading.Event()

    def prefill() -> None:
        c.completions.create(model=name, prompt=long_prompt, max_tokens=1)
        done.set()
    decoding = threading.Thread(target=stream)
    decoding.start()
    deadline = time.monotonic() + 120
    while len(arrivals) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = time.monotonic()
    threading.Thread(target=prefill).start()
    samples = []  # (time, lease wanted, prefill demand) while the stream decodes
    while not done.is_set() and decoding.is_alive():
        raw = open(lease, "rb").read(128)
        samples.append((time.monotonic(), struct.unpack_from("I", raw, 0)[0],
                        struct.unpack_from("I", raw, 68)[0]))
        time.sleep(0.001)
    decoding.join(300)
    assert done.wait(300)
    window = [s for s in samples if s[2] and s[0] < arrivals[-1]]
    assert len(window) > 100, len(window)
    lent = sum(1 for s in window if not s[1]) / len(window)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if a >= sent and b <= window[-1][0]]
    assert lent > 0.5, f"lease down {lent:.0%} of the time the prefill wanted it"
    assert gaps and sorted(gaps)[len(gaps) // 2] > 0.12, gaps
    alone = c.completions.create(**story)  # type: ignore[call-overload]
    assert "".join(texts) == alone.choices[0].text
