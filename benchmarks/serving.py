"""Serving overhead: TTFT and TPOT of one request through `splitserve serve` (disagg and
agg) against the offline engine on the same prompt, measured in one run.

    python benchmarks/serving.py          # ~7 min on 2 cores (3 starts x 5 rounds);
                                          # writes docs/benchmarks.md
    python benchmarks/serving.py --quick  # 1 start, 2 rounds, no doc
    python benchmarks/serving.py --vllm   # + vLLM-CPU served against its LLMEngine
                                          # (benchmarks/serving_vllm.py)
    python benchmarks/serving.py --decode-load [--baseline-rev REV] [--flags F]
        [--baseline-flags F] [--quick]
                                          # TTFT while D decodes: benchmarks/serving_load.py

One streaming completion at a time (the openai client, real HTTP, SSE), a 512-token prompt
of random token ids (fresh per repetition, so no prefix-cache hits), 64 output tokens
(ignore_eos), greedy, bf16. TTFT = request sent -> first chunk, where "sent" is the moment
the openai client hands the HTTP request to its transport: the client library's own work
before that (building and validating the request, ~7-10 ms for a 512-id prompt) is the
client's cost, not the server's, and is reported in its own column. The TTFT overhead is
also given at the first event: when the response's first body bytes (the first SSE event,
which carries the first token) reach the client's socket, as a raw-SSE client (vLLM's
`bench serve`) sees them, before the openai library parses and validates the chunk on the
same cores. TPOT = (E2E - TTFT) / (tokens - 1). Baselines run the engine alone in a
process pinned like the workers: disagg's decode worker gets one core and one thread, so
its TPOT's baseline is the engine on one core; its prefill worker computes on both (its
own core's thread and a helper on the idle decode core: --prefill-borrows-cores, the
default), so its TTFT's is the engine on two, as agg's worker's both figures are. Each
measured request follows an unmeasured one on the same setup: on the VMs these figures
come from, a prefill after a second or more of idle ran up to 2x slower (no page faults
in the guest), which hit the setups unequally.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import httpx2 as httpx

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, busy_processes,  # noqa: E402
                               descendants, machine_description, markdown_table, median,
                               write_section)

# --prompt-tokens sets the env var, so the engine's child process reads the same length;
# benchmarks/serving_floor.py sets both.
PROMPT_TOKENS = int(os.environ.get("SPLITSERVE_BENCH_PROMPT_TOKENS", "512"))
OUTPUT_TOKENS = int(os.environ.get("SPLITSERVE_BENCH_OUTPUT_TOKENS", "64"))


def prompt_ids(rep: int) -> list[int]:
    rng = random.Random(1000 + rep)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


class Timing(NamedTuple):
    ttft_s: float
    tpot_s: float
    client_s: float = 0.0  # served: the client library's time before the request left
    first_event_s: float | None = None  # served: sent -> the first body bytes arrived


class _FirstBytes(httpx.BaseTransport):
    """The default transport, noting when a response's first body bytes arrive."""

    def __init__(self, on_first: Callable[[], None]) -> None:
        self.inner = httpx.HTTPTransport()
        self.on_first = on_first

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        assert isinstance(response.stream, httpx.SyncByteStream)
        response.stream = _NotedStream(response.stream, self.on_first)
        return response

    def close(self) -> None:
        self.inner.close()


class _NotedStream(httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, on_first: Callable[[], None]) -> None:
        self.stream, self.on_first = stream, on_first

    def __iter__(self) -> Iterator[bytes]:
        noted = False
        for chunk in self.stream:
            if chunk and not noted:
                self.on_first()
                noted = True
            yield chunk

    def close(self) -> None:
        self.stream.close()


_ENGINE_LOOP = """
import json, os, sys, time
sys.path.insert(0, {root!r})
os.sched_setaffinity(0, {cores!r})
from benchmarks.serving import prompt_ids, OUTPUT_TOKENS
from splitserve.config import EngineConfig, ServeConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
# Scheduled as a served worker is (serve's step time budget too).
engine = LLMEngine(EngineConfig.from_kwargs(num_threads={threads}, max_model_len=2048,
                                            max_step_ms=ServeConfig().max_step_ms))
params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
print("ready", flush=True)
for line in sys.stdin:
    rep = int(line)
    t0 = time.perf_counter()
    engine.add_request(f"r{{rep}}", prompt_ids(rep), params)
    first = None
    while engine.has_unfinished:
        for out in engine.step():
            if first is None and out.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    print(json.dumps([first - t0, (end - first) / (OUTPUT_TOKENS - 1)]), flush=True)
"""


class OfflineEngine:
    """The engine alone in a child process pinned to `cores`; one request per `run`."""

    def __init__(self, threads: int, cores: list[int]) -> None:
        code = _ENGINE_LOOP.format(root=_ROOT, cores=cores, threads=threads)
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def run(self, rep: int) -> Timing:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{rep}\n")
        self.proc.stdin.flush()
        ttft, tpot = json.loads(self.proc.stdout.readline())
        return Timing(ttft, tpot)

    def pause(self, paused: bool) -> None:
        pause_tree(self.proc.pid, paused)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class StreamClient:
    """The openai client over `url`, its transport noting when a request leaves and when
    the response's first bytes come; one streaming completion per `run`."""

    def __init__(self, url: str) -> None:
        import openai
        self.sent_at = self.first_bytes_at = 0.0
        http = openai.DefaultHttpxClient(event_hooks={"request": [self._on_send]},
                                         transport=_FirstBytes(self._on_first_bytes))
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="none",
                                    max_retries=0, timeout=300, http_client=http)
        self.model = self.client.models.list().data[0].id

    def _on_send(self, request: object) -> None:
        self.sent_at = time.perf_counter()

    def _on_first_bytes(self) -> None:
        self.first_bytes_at = time.perf_counter()

    def run(self, rep: int) -> Timing:
        t0 = time.perf_counter()
        first = None
        for _ in self.client.completions.create(
                model=self.model, prompt=prompt_ids(rep), max_tokens=OUTPUT_TOKENS,
                temperature=0, stream=True, extra_body={"ignore_eos": True}):
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None and t0 < self.sent_at < self.first_bytes_at <= first
        return Timing(first - self.sent_at, (end - first) / (OUTPUT_TOKENS - 1),
                      self.sent_at - t0, self.first_bytes_at - self.sent_at)


class Setup(Protocol):
    """One measured setup: a request per `run`; paused while another one is measured."""

    def run(self, rep: int) -> Timing: ...
    def pause(self, paused: bool) -> None: ...
    def stop(self) -> None: ...


def pause_tree(pid: int, paused: bool) -> None:
    """SIGSTOP (or SIGCONT) `pid` and its descendants."""
    for child in descendants(pid):
        try:
            os.kill(child, signal.SIGSTOP if paused else signal.SIGCONT)
        except ProcessLookupError:
            pass


class Served:
    """`splitserve serve` with `flags`; one streaming request per `run`. `checkout` runs
    the server from another source tree (a git worktree) with this venv."""

    def __init__(self, flags: list[str], checkout: str = _ROOT) -> None:
        sys.path.insert(0, os.path.join(_ROOT, "tests"))
        from conftest import ServerProcess  # the same launcher the e2e tests use
        # `python -m` puts the cwd first on sys.path and the workers inherit both.
        self.server = ServerProcess(*flags, ready_timeout_s=600, cwd=checkout,
                                    env={**os.environ, "PYTHONPATH": checkout})
        self.stream = StreamClient(self.server.url)
        self.client, self.model = self.stream.client, self.stream.model

    def run(self, rep: int) -> Timing:
        return self.stream.run(rep)

    def pause(self, paused: bool) -> None:
        """SIGSTOP (or SIGCONT) the frontend and its workers: an idle server still wakes
        for heartbeats and load reports (~4% of a core for disagg), and on 2 cores each
        wake-up preempts a thread of the measured setup's OpenMP team. Paused for one
        round's other requests, seconds, far inside the 30 s heartbeat timeout."""
        pause_tree(self.server.proc.pid, paused)

    def stop(self) -> None:
        self.pause(False)
        self.server.stop()


def run_rounds(setups: dict[str, Setup], instance: int, rounds: int,
               runs: dict[str, list[Timing]]) -> None:
    """One start of every setup: `rounds` rounds (after a warm-up one, not recorded), each
    setup in turn with the others paused, an unmeasured request then the measured one
    (appended to `runs[name]`); stops every setup at the end."""
    try:
        for rnd in range(-1, rounds):
            for name, setup in setups.items():
                for other in setups.values():  # only the measured setup is awake
                    other.pause(other is not setup)
                seed = instance * 1000 + rnd
                setup.run(seed + 500)  # unmeasured: the measured request runs warm
                timing = setup.run(seed + 100)
                if rnd >= 0:
                    runs.setdefault(name, []).append(timing)
    finally:
        for setup in setups.values():
            setup.stop()


def main() -> int:
    global PROMPT_TOKENS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None,
                    help="rounds per instance (5; --decode-load: rounds, 9)")
    ap.add_argument("--instances", type=int, default=3,
                    help="fresh processes of every setup, one after the other")
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    ap.add_argument("--decode-load", action="store_true",
                    help="TTFT of a 512-token prompt in disagg while D decodes 0, 1, 16 others")
    ap.add_argument("--baseline-rev", metavar="REV",
                    help="with --decode-load: also run the server of git revision REV")
    ap.add_argument("--flags", default="", help="with --decode-load: more `splitserve serve` "
                    "flags of the current server, e.g. '--slo-tpot-ms 100'")
    ap.add_argument("--baseline-flags", help="with --decode-load: a baseline server with "
                    "these flags instead (of --baseline-rev, else of this checkout)")
    ap.add_argument("--vllm", action="store_true", help="also vLLM-CPU's engine alone and "
                    "its OpenAI server, in the same rounds (benchmarks/serving_vllm.py; "
                    "its env: benchmarks/vllm_peer.py --setup)")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help="the timed prompt's length (512); with another, its own section")
    args = ap.parse_args()
    PROMPT_TOKENS = args.prompt_tokens
    os.environ["SPLITSERVE_BENCH_PROMPT_TOKENS"] = str(PROMPT_TOKENS)
    if (args.baseline_rev or args.baseline_flags is not None or args.flags
            ) and not args.decode_load:
        ap.error("--baseline-rev, --flags and --baseline-flags need --decode-load")
    if args.decode_load:
        from benchmarks.serving_load import run_decode_load
        return run_decode_load(args.baseline_rev, args.quick, args.reps or 9, args.output,
                               args.flags.split(), None if args.baseline_flags is None
                               else args.baseline_flags.split())
    reps, instances = (2, 1) if args.quick else (args.reps or 5, args.instances)
    disagg = "disagg (1 prefill + 1 decode, 1 core each; the prefill's helper on D's core)"
    base = {disagg: ("engine, 2 cores", "engine, 1 core"),  # (TTFT's, TPOT's)
            "agg (1 worker, 2 cores)": ("engine, 2 cores", "engine, 2 cores")}
    peer = None
    if args.vllm:
        from benchmarks.serving_vllm import ENGINE_ALONE, SERVED
        from benchmarks.vllm_peer import VllmPeer
        peer = VllmPeer.prepare()  # an install never runs inside a measurement
        base[SERVED] = (ENGINE_ALONE, ENGINE_ALONE)
    runs: dict[str, list[Timing]] = {}
    monitor = CpuMonitor().start()
    # Fresh processes of every setup, `instances` times: two starts of the same server
    # differ by up to ~3% in step time on these VMs (three identical servers in one run:
    # TTFT 2.8-3.0 ms apart, paired), as much as the overhead measured.
    for instance in range(instances):
        # Every setup is up at once (idle ones sleep) and the repetitions are interleaved
        # A, B, C, D, A, B, ...: drift of this shared machine hits all setups alike, and
        # each served figure is compared with the engine-alone figure of the same round.
        setups: dict[str, Setup] = {
            "engine, 1 core": OfflineEngine(1, [1]),
            "engine, 2 cores": OfflineEngine(2, [0, 1]),
            disagg: Served(
                ["--mode", "disagg", "--disagg-policy", "always", "--max-model-len", "2048"]),
            "agg (1 worker, 2 cores)": Served(["--mode", "agg", "--max-model-len", "2048"]),
        }
        if peer is not None:
            from benchmarks.serving_vllm import vllm_setups
            setups.update(vllm_setups(peer, instance))
        run_rounds(setups, instance, reps, runs)
    others = monitor.stop()
    rows = []
    for name, timings in runs.items():
        ttft = median([t.ttft_s for t in timings]) * 1000
        tpot = median([t.tpot_s for t in timings]) * 1000
        if name not in base:
            rows.append([name, f"{ttft:.1f}", f"{tpot:.2f}", "-", "-", "-", "-"])
            continue
        client = median([t.client_s for t in timings]) * 1000
        pairs = list(zip(timings, runs[base[name][0]]))
        d_ttft = median([(a.ttft_s - b.ttft_s) * 1000 for a, b in pairs])
        r_ttft = median([a.ttft_s / b.ttft_s for a, b in pairs])
        tpot_pairs = list(zip(timings, runs[base[name][1]]))
        d_tpot = median([(a.tpot_s - b.tpot_s) * 1000 for a, b in tpot_pairs])
        r_tpot = median([a.tpot_s / b.tpot_s for a, b in tpot_pairs])
        d_event = median([(a.first_event_s - b.ttft_s) * 1000 for a, b in pairs
                          if a.first_event_s is not None])
        r_event = median([a.first_event_s / b.ttft_s for a, b in pairs
                          if a.first_event_s is not None])
        rows.append([name, f"{ttft:.1f}", f"{tpot:.2f}", f"{d_ttft:+.1f} ms ({r_ttft:.2f}x)",
                     f"{d_event:+.1f} ms ({r_event:.2f}x)", f"{d_tpot:+.2f} ms ({r_tpot:.2f}x)",
                     f"{client:.1f}"])
    body = [
        f"One streaming request at a time: {PROMPT_TOKENS}-token prompt (random ids, no "
        f"prefix hits), {OUTPUT_TOKENS} output tokens, greedy, bf16, medians of "
        f"{instances * reps} rounds: {instances} fresh start(s) of every setup, "
        f"{reps} interleaved rounds each after one warm-up round; overheads are medians of "
        "the per-round differences and ratios; every measured request follows an "
        "unmeasured one on the same setup (warm). The servers not being measured are paused "
        "(SIGSTOP), so their idle wake-ups do not preempt the measured one. "
        "Served = `splitserve serve` + openai client over "
        "HTTP/SSE; disagg uses `--disagg-policy always` (every request: prefill worker -> "
        "KV transfer over TCP -> decode worker). Overhead = served minus the engine alone "
        "on the same cores (disagg's TTFT: 2 cores, its prefill worker's and, through its "
        "helper, the idle decode worker's; its TPOT: 1). A served TTFT starts when the "
        "openai client hands the request to its HTTP transport; the client library's own "
        "time before that (building the request in the benchmark's process) is the last "
        "column, not the server's tax. "
        "\"At the first event\": the TTFT overhead when the response's first bytes (the "
        "first SSE event, with the first token) reach the client's socket, before the "
        "openai library parses them (what a raw-SSE client such as vLLM's `bench serve` "
        "times)." + ("" if peer is None else
                     " vLLM-CPU rows (`--vllm`, benchmarks/serving_vllm.py): its v1 "
                     "`LLMEngine` alone and its OpenAI server, both with its default CPU "
                     "binding (the model worker's one thread on one core; its engine core, "
                     "and the API server when served, on the other); the served row's "
                     "overhead is against its engine alone. Its engine is not ours: compare "
                     "the overheads, not the times."), "",
        markdown_table(["setup", "TTFT ms", "TPOT ms", "TTFT overhead",
                        "TTFT overhead at the first event", "TPOT overhead",
                        "client library ms"], rows), "",
        f"Other processes used {others:.2f} cores on average during the run.",
    ]
    busy = busy_processes()
    if busy and others > 0.2:
        body.append("Busy processes: " + "; ".join(busy[:3]))
    text = "\n".join(body)
    print(text)
    if not args.quick:
        title = "Serving overhead" + ("" if PROMPT_TOKENS == 512 else
                                      f", {PROMPT_TOKENS}-token prompts")
        write_section(args.output, title, text, machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
