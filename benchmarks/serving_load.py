"""TTFT under decode load (`benchmarks/serving.py --decode-load`): a fresh 512-token prompt
through `splitserve serve` in disagg (1 prefill + 1 decode worker, one core each, bf16,
`--disagg-policy always`) while the decode worker D decodes N = 0, 1, 16 other sequences.

The load: N streaming requests with 16-token prompts and long outputs (ignore_eos), started
before each timed request and confirmed on D (every stream has streamed tokens past the
first, which P produces, and D's `splitserve_worker_running_requests` >= N); then one
timed request (random ids, no prefix hits, 4 output tokens): TTFT = sent -> first chunk.
Then the load streams are closed (the server aborts them) and the server is drained
(nothing in flight, nothing running) before the next phase. Every wait has a timeout.

`--baseline-rev REV` also runs the server of git revision REV from a temporary
`git worktree` (this venv, PYTHONPATH = the worktree); `--baseline-flags F` a baseline with
other flags (of REV, else of this checkout), `--flags F` adds flags to the current server
(e.g. the TPOT target a pacing decode worker keeps: cluster/worker/lending.py). Both
servers are up before the first round (startup is not measured; the idle one sleeps);
every round measures each N on both, the order alternating per round, so drift of the
machine hits both alike. The load streams' TPOT during the timed request (their chunks'
gaps from its send to its first chunk; N > 0) is reported beside the TTFT.
"""
from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from benchmarks.common import (CpuMonitor, busy_processes, machine_description,
                               markdown_table, median, process_cpu_seconds, write_section)
from benchmarks.serving import _ROOT, PROMPT_TOKENS, Served, prompt_ids

LOADS = (0, 1, 16)
LOAD_PROMPT_TOKENS, LOAD_OUTPUT_TOKENS, TIMED_OUTPUT_TOKENS = 16, 1500, 4
FLAGS = ["--mode", "disagg", "--disagg-policy", "always", "--max-model-len", "2048"]
WAIT_S = 120.0  # the longest any one wait (load confirmed, drain, thread exit) may take


def _samples(metrics: str, name: str) -> dict[str, float]:
    """{label value: value} of the one-label metric `name` in Prometheus text."""
    found = re.findall(rf'^{name}\{{\w+="([^"]+)"\}} (\S+)$', metrics, re.M)
    return {label: float(value) for label, value in found}


def _wait_for(what: str, ready: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.05)


class LoadStream(threading.Thread):
    """One background streaming completion; counts chunks until `stop` is set."""

    def __init__(self, side: LoadedServer, seed: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        rng = random.Random(seed)
        self.prompt = [rng.randrange(1000, 40000) for _ in range(LOAD_PROMPT_TOKENS)]
        self.side, self.stop, self.num_chunks = side, stop, 0
        self.arrivals: list[float] = []  # perf_counter() of each chunk
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.side.served.client.completions.create(
                    model=self.side.served.model, prompt=self.prompt,
                    max_tokens=LOAD_OUTPUT_TOKENS, temperature=0, stream=True,
                    extra_body={"ignore_eos": True}) as stream:
                for _ in stream:
                    self.arrivals.append(time.perf_counter())
                    self.num_chunks += 1
                    if self.stop.is_set():
                        return  # closing the stream aborts the request
            self.error = RuntimeError("a load stream finished before it was stopped")
        except BaseException as e:  # reported by check()
            self.error = e

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"load stream failed: {self.error!r}") from self.error


class LoadedServer:
    """A served disagg cluster (one checkout) that can put N streams on its decode worker."""

    def __init__(self, label: str, checkout: str, flags: Sequence[str]) -> None:
        self.label, self.served = label, Served([*FLAGS, *flags], checkout)
        workers = self.served.server.workers()
        decode_ids = [str(w["id"]) for w in workers if str(w["role"]).lower().endswith("decode")]
        if len(decode_ids) != 1:
            self.served.stop()
            raise RuntimeError(f"{label}: expected one decode worker in /health: {workers}")
        self.decode_id = decode_ids[0]
        self.streams: list[LoadStream] = []
        self.stop = threading.Event()

    def running(self) -> dict[str, float]:
        return _samples(self.served.server.get_text("/metrics"),
                        "splitserve_worker_running_requests")

    def start_load(self, n: int, seed: int) -> None:
        self.stop = threading.Event()
        self.streams = [LoadStream(self, seed + i, self.stop) for i in range(n)]
        for s in self.streams:
            s.start()

        def on_decode() -> bool:
            for s in self.streams:
                s.check()
            # Past the first chunk (P's token) a stream's tokens come from D's steps.
            return (all(s.num_chunks >= 3 for s in self.streams)
                    and self.running().get(self.decode_id, 0) >= n)
        _wait_for(f"{self.label}: {n} streams decoding on {self.decode_id}", on_decode)

    def stop_load(self) -> None:
        self.stop.set()
        for s in self.streams:
            s.join(WAIT_S)
            assert not s.is_alive(), "a load stream did not stop"
        self.streams = []

        def drained() -> bool:
            health = self.served.server.get_json("/health")
            return (not health.get("in_flight") and not health.get("queued")
                    and not any(self.running().values()))
        _wait_for(f"{self.label}: drain", drained)

    def ttft(self, rep: int) -> tuple[float, float | None]:
        """Seconds to the first chunk of a fresh 512-token prompt, and the load streams'
        median chunk gap meanwhile (None without load); the load must survive it."""
        t0 = time.perf_counter()
        first = None
        for _ in self.served.client.completions.create(
                model=self.served.model, prompt=prompt_ids(rep),
                max_tokens=TIMED_OUTPUT_TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True}):
            if first is None:
                first = time.perf_counter()
        assert first is not None, "the timed request streamed nothing"
        for s in self.streams:
            s.check()
            assert s.is_alive(), "a load stream ended during the timed request"
        gaps = [b - a for s in self.streams for a, b in zip(s.arrivals, s.arrivals[1:])
                if a >= t0 and b <= first]
        return first - t0, median(gaps) if gaps else None

    def decisions(self) -> str:
        """The router's placement decisions so far (disagg runs: all remote)."""
        found = _samples(self.served.server.get_text("/metrics"),
                         "splitserve_router_decisions_total")
        return ", ".join(f"{decision} {count:.0f}" for decision, count in found.items())

    def cpu_seconds(self) -> float:
        """CPU time of the server and its workers so far."""
        server = self.served.server
        return process_cpu_seconds([server.proc.pid, *server.worker_pids()])

    def close(self) -> None:
        self.stop.set()
        self.served.stop()


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", _ROOT, *args], check=True, capture_output=True,
                          text=True, timeout=120).stdout.strip()


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[str]:
    """A detached worktree of `rev` in /tmp, removed afterwards."""
    path = tempfile.mkdtemp(prefix="splitserve-baseline-")
    os.rmdir(path)
    _git("worktree", "add", "--detach", path, rev)
    try:
        yield path
    finally:
        _git("worktree", "remove", "--force", path)


def _revision(rev: str) -> str:
    commit, subject = _git("log", "-1", "--format=%h %s", rev).split(" ", 1)
    return f"`{commit}` ({subject[:60]}{'...' if len(subject) > 60 else ''})"


Runs = dict[str, dict[int, list[tuple[float, float | None]]]]


def _measure(sides: list[LoadedServer], reps: int) -> Runs:
    """{side: {N: [(TTFT, load TPOT), ...]}}"""
    runs: Runs = {s.label: {n: [] for n in LOADS} for s in sides}
    counter = 0
    for rnd in range(-1, reps):  # -1: warm-up round, not recorded
        for n in LOADS:
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                counter += 1
                try:
                    if n:
                        side.start_load(n, seed=10_000 * counter)
                    ttft, tpot = side.ttft(20_000 + counter)  # fresh ids: no prefix hits
                finally:
                    side.stop_load()
                if rnd >= 0:
                    runs[side.label][n].append((ttft, tpot))
                print(f"round {rnd}: {side.label} N={n} TTFT {ttft * 1000:.1f} ms, load TPOT "
                      f"{'-' if tpot is None else f'{tpot * 1000:.1f} ms'}", flush=True)
    return runs


def _ms(values: list[float | None]) -> str:
    found = [v for v in values if v is not None]
    return f"{median(found) * 1000:.1f}" if found else "-"


def run_decode_load(baseline_rev: str | None, quick: bool, reps: int, output: str,
                    flags: Sequence[str] = (), baseline_flags: Sequence[str] | None = None
                    ) -> int:
    reps = 2 if quick else reps
    baseline = bool(baseline_rev) or baseline_flags is not None
    sides: list[LoadedServer] = []
    with contextlib.ExitStack() as stack:
        if baseline:
            checkout = stack.enter_context(worktree(baseline_rev)) if baseline_rev else _ROOT
            sides.append(LoadedServer("baseline", checkout, baseline_flags or ()))
            stack.callback(sides[-1].close)
        sides.append(LoadedServer("current", _ROOT, flags))
        stack.callback(sides[-1].close)
        monitor, t0 = CpuMonitor().start(), time.monotonic()
        served_s = -sum(side.cpu_seconds() for side in sides)
        runs = _measure(sides, reps)
        served_s += sum(side.cpu_seconds() for side in sides)
        # The servers are ours, but CpuMonitor only counts children once they are reaped.
        others = max(0.0, monitor.stop() - served_s / (time.monotonic() - t0))
        for side in sides:
            print(f"{side.label}: router decisions: {side.decisions()}")
    rows: list[list[Any]] = []
    for n in LOADS:
        cur = runs["current"][n]
        row: list[Any] = [n]
        if baseline:
            base = runs["baseline"][n]
            ratio = median([c[0] / b[0] for c, b in zip(cur, base)])
            row += [_ms([b[0] for b in base]), _ms([c[0] for c in cur]), f"{ratio:.2f}",
                    _ms([b[1] for b in base]), _ms([c[1] for c in cur])]
        else:
            row += [_ms([c[0] for c in cur]), _ms([c[1] for c in cur])]
        rows.append(row)
    dirty = " + uncommitted changes" if _git("status", "--porcelain") else ""
    header = ["N decoding on D", "TTFT ms", "load TPOT ms"]
    text = [
        f"TTFT of a fresh {PROMPT_TOKENS}-token prompt (random ids, no prefix hits, "
        f"{TIMED_OUTPUT_TOKENS} output tokens, greedy, bf16) through `splitserve serve "
        f"{' '.join([*FLAGS, *flags])}` (1 prefill + 1 decode worker, one core each; openai "
        "client, "
        f"HTTP/SSE) while the decode worker decodes N other streams ({LOAD_PROMPT_TOKENS}-token "
        "prompts, ignore_eos; started and confirmed decoding on D before each timed request, "
        "closed after it; N = 0 is the idle reference); load TPOT: the median gap between "
        "the load streams' chunks while the timed request waited for its first. Medians of "
        f"{reps} rounds after one warm-up round. Current = {_revision('HEAD')}{dirty}."]
    if baseline:
        header = ["N decoding on D", "baseline TTFT ms", "current TTFT ms",
                  "current / baseline", "baseline load TPOT ms", "current load TPOT ms"]
        where = (f"{_revision(baseline_rev)}, run from a git worktree with the same venv"
                 if baseline_rev else "this checkout")
        extra = f", with `{' '.join(baseline_flags)}`" if baseline_flags else ""
        text[0] += (f" Baseline = {where}{extra}; both servers are up at once and each round "
                    "measures both, in alternating order; the ratio is the median of the "
                    "per-round ratios.")
    text += ["", markdown_table(header, rows), "",
             f"Other processes used {others:.2f} cores on average during the run."]
    busy = busy_processes()
    if busy and others > 0.2:
        text.append("Busy processes: " + "; ".join(busy[:3]))
    body = "\n".join(text)
    print(body)
    if not quick:
        write_section(output, "TTFT under decode load", body, machine=machine_description())
    return 0
