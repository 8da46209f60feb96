"""Helpers shared by the benchmark scripts in benchmarks/.

- `machine_description()`: CPU model, cores, memory, library versions, torch threads.
- `CpuMonitor` / `other_cpu_load()`: how much CPU *other* processes used, so a run on a
  busy machine is flagged (on 2 cores, OpenMP threads that get descheduled turn 20 us ops
  into 12 ms ones: such figures are not performance).
- `measure_gemm_flops()`, `measure_dram_read_bandwidth()`: the machine's ceilings.
- `timed()`, `median()`: repetitions.
- `write_section()`: replaces (or appends) one `## <title>` section of docs/benchmarks.md
  and leaves every other section as it is, so each script owns its own section.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import os
import platform
import select
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.model.memory import huge_page_buffer

DEFAULT_OUTPUT = "docs/benchmarks.md"
_DOC_PREAMBLE = (
    "# Benchmarks\n\n"
    "Each `##` section below is written by one script in `benchmarks/` (it replaces only its own "
    "section). Every section names the machine, the command and the date it was measured "
    "with; figures from different sections or dates are not directly comparable.\n")


# -- the machine ------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_family_model() -> str:
    """'family F model M' from /proc/cpuinfo (tells CPU generations apart: AMD family 25 is
    Zen 3/4, family 26 Zen 5), or ''."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("cpu family", "model") and key not in found:
                    found[key] = line.split(":", 1)[1].strip()
                if len(found) == 2:
                    break
    except OSError:
        pass
    return f"family {found['cpu family']} model {found['model']}" if len(found) == 2 else ""


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def total_memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def machine_description() -> dict[str, str]:
    """Facts that make a figure interpretable; rendered by `machine_markdown`."""
    flags = cpu_flags()
    isa = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"),
                                   ("amx_bf16", "AMX-BF16"), ("avx2", "AVX2")) if flag in flags]
    if "avx512f" in flags:
        isa = [i for i in isa if i != "AVX2"]
    if "amx_bf16" not in flags and flags:
        isa.append("no AMX")
    mem = total_memory_gib()
    desc = {
        "cpu": cpu_model() + (f" ({', '.join(filter(None, [cpu_family_model(), *isa]))})"),
        "cores": str(os.cpu_count()),
        "memory": f"{mem:.0f} GiB" if mem else "?",
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
    }
    try:
        import transformers
        desc["transformers"] = transformers.__version__
    except ImportError:
        pass
    return desc


def machine_markdown(desc: dict[str, str]) -> str:
    return "; ".join(f"{k}: {v}" for k, v in desc.items())


def command_line() -> str:
    """How this run was started, relative to the repository root when possible."""
    argv = list(sys.argv)
    try:
        argv[0] = os.path.relpath(argv[0])
    except ValueError:
        pass
    return " ".join(shlex.quote(a) for a in ["python", *argv])


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# -- is anybody else using the CPU? --------------------------------------------------------
def _cpu_busy_seconds() -> float:
    """Busy CPU time of the whole machine (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / hz


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuMonitor:
    """CPU used by other processes between start() and stop(), in cores (0 = quiet).

    The machine's busy time minus this process's CPU time over the wall time. Our own
    OpenMP threads spinning count as ours, so a quiet machine reads ~0.
    """

    def __init__(self) -> None:
        self._t0 = self._busy0 = self._own0 = 0.0

    def start(self) -> "CpuMonitor":
        self._t0, self._busy0, self._own0 = (time.monotonic(), _cpu_busy_seconds(),
                                             _own_cpu_seconds())
        return self

    def stop(self) -> float:
        wall = time.monotonic() - self._t0
        if wall <= 0:
            return 0.0
        others = (_cpu_busy_seconds() - self._busy0) - (_own_cpu_seconds() - self._own0)
        return max(0.0, others / wall)


def process_cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time used so far by the live processes `pids` (and their reaped children): what
    CpuMonitor counts as *other* for servers this script started and has not yet stopped."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except OSError:
            continue  # gone
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """`pid` and every process under it (from /proc: children of each thread)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue  # gone
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except OSError:
                continue
    return found


def other_cpu_load(seconds: float = 1.0) -> float:
    """Cores used by other processes while we sleep for `seconds`."""
    mon = CpuMonitor().start()
    time.sleep(seconds)
    return mon.stop()


def busy_processes(min_cpu_percent: float = 10.0) -> list[str]:
    """`ps` lines of other processes using CPU (best effort, for the warning)."""
    try:
        import subprocess
        out = subprocess.run(["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"],
                             capture_output=True, text=True, timeout=5).stdout.splitlines()
    except Exception:
        return []
    me = os.getpid()
    lines = []
    for line in out[1:]:
        parts = line.split(None, 3)
        if len(parts) < 4 or int(parts[0]) == me:
            continue
        try:
            if float(parts[1]) >= min_cpu_percent:
                lines.append(line.strip()[:160])
        except ValueError:
            continue
    return lines


# -- timing ------------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def timed(fn: Callable[[], object], reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of fn, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# -- the machine's ceilings ----------------------------------------------------------------------
@dataclass
class Ceiling:
    median: float
    best: float
    unit: str

    def __str__(self) -> str:
        return f"{self.best:.4g} {self.unit} (best; median {self.median:.4g})"


def measure_gemm_flops(dtype: torch.dtype = torch.bfloat16, n: int = 2048,
                       reps: int = 7) -> Ceiling:
    """FLOP/s of an n^3 GEMM with the current torch thread count (2*n^3 FLOP)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    times = timed(lambda: torch.mm(a, b, out=out), reps, warmup=2)
    flop = 2.0 * n ** 3
    return Ceiling(flop / median(times), flop / min(times), "FLOP/s")


def measure_linear_flops(shapes: list[tuple[int, int]], rows: int, num_layers: int,
                         dtype: torch.dtype = torch.bfloat16, reps: int = 7) -> Ceiling:
    """FLOP/s of torch's own linear (oneDNN on CPU) over a model's projections: `rows`
    rows through `num_layers` layers of distinct (out, in) weights, `shapes` per layer."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(dtype) for _ in range(num_layers)
               for n, k in shapes]
    xs = {k: torch.randn(rows, k, generator=g).to(dtype) for _, k in shapes}

    def run() -> None:
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
    times = timed(run, reps, warmup=2)
    flop = 2.0 * rows * num_layers * sum(n * k for n, k in shapes)
    return Ceiling(flop / median(times), flop / min(times), "FLOP/s")


def measure_dram_read_bandwidth(nbytes: int = 1 << 30, reps: int = 7) -> Ceiling:
    """Bytes/s of summing a filled fp32 buffer of `nbytes` on 2 MB pages, as the engine's
    weights are (on 4 KB pages it read ~10% slower on a Zen 4). Filled first: untouched
    memory maps the zero page and reads at impossible speed."""
    buf = huge_page_buffer(nbytes).view(torch.float32)
    buf.fill_(1.0)
    times = timed(lambda: buf.sum(), reps, warmup=2)
    return Ceiling(nbytes / median(times), nbytes / min(times), "B/s")


# -- docs/benchmarks.md ------------------------------------------------------------------------
def _split_sections(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(preamble, [(title, full section text incl. its heading)]) at `## ` headings
    outside fenced code blocks."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    in_fence = False
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        if not in_fence and line.startswith("## "):
            sections.append((line[3:].strip(), [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            preamble.append(line)
    return "".join(preamble), [(t, "".join(body)) for t, body in sections]


def replace_section(text: str, title: str, body: str) -> str:
    """`text` with its `## title` section replaced by `body` (appended when absent)."""
    new = f"## {title}\n\n{body.strip()}\n"
    preamble, sections = _split_sections(text)
    if not preamble.strip() and not sections:
        preamble = _DOC_PREAMBLE
    out, done = [], False
    for t, section in sections:
        if t == title:
            if not done:
                out.append(new)
                done = True
        else:
            out.append(section)
    if not done:
        out.append(new)
    parts = [preamble.rstrip("\n") + "\n"] if preamble.strip() else []
    parts += [s.rstrip("\n") + "\n" for s in out]
    return "\n".join(parts)


def write_section(path: str, title: str, body: str, *, machine: dict[str, str] | None = None,
                  command: str | None = None, date: str | None = None) -> None:
    """Writes `## title` into the markdown file at `path` (created if missing), with a
    header naming the machine, the command and the date; other sections are kept.
    The file is locked while it is rewritten, so two scripts can write their sections."""
    header = [f"Measured {date or now_utc()} with `{command or command_line()}`.",
              "", f"Machine: {machine_markdown(machine or machine_description())}."]
    full = "\n".join(header) + "\n\n" + body.strip() + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            updated = replace_section(f.read(), title, full)
            f.seek(0)
            f.truncate()
            f.write(updated)
            f.flush()
            os.fsync(f.fileno())
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class ServeChild:
    """A child process `python SCRIPT --serve KIND` that prints its address first, then
    talks in lines on stdin/stdout; closing its stdin ends it."""

    def __init__(self, script: str, kind: str) -> None:
        self.proc = subprocess.Popen([sys.executable, script, "--serve", kind],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self.readline(300)

    def readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"child {self.proc.args!r} did not answer")
        return line.strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
