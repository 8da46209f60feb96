"""Session fixtures shared by every test: the default GGUF, tiny random HF checkpoints, and the
dense fp32 HF reference of the default model."""
from __future__ import annotations

from collections.abc import Iterator

import functools
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from splitserve.model.default import default_model_path as _default_model_path
from splitserve.model.gguf_file import GGUFFile
from splitserve.model.tokenizer import Tokenizer

torch.set_num_threads(2)

# Shared by tiny_llama_dir and tiny_qwen2_dir; the vocab size is the default tokenizer's (49152).
TINY_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=512,
)


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default SmolLM2-135M-Instruct Q4_1 GGUF."""
    return _default_model_path()


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path: str) -> Tokenizer:
    """The default model's tokenizer (built from the GGUF metadata)."""
    return Tokenizer.from_gguf_metadata(GGUFFile.open(default_model_path).metadata)


def _rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


def _write_tiny(model_cls: Any, config: Any, path: Path, tokenizer: Tokenizer) -> str:
    torch.manual_seed(0)
    model = model_cls(config)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Tokenizer) -> str:
    """Random-weight 2-layer Llama HF checkpoint (untied lm_head, theta 1e4) with the default
    tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **TINY_SHAPE, vocab_size=default_tokenizer.vocab_size, rope_parameters=_rope(10000.0),
        tie_word_embeddings=False,
    )
    return _write_tiny(LlamaForCausalLM, config, tmp_path_factory.mktemp("tiny_llama"),
                       default_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Tokenizer) -> str:
    """Random-weight 2-layer Qwen2 HF checkpoint (q/k/v biases, tied, theta 1e6) with the
    default tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **TINY_SHAPE, vocab_size=default_tokenizer.vocab_size, rope_parameters=_rope(1e6),
        tie_word_embeddings=True,
    )
    return _write_tiny(Qwen2ForCausalLM, config, tmp_path_factory.mktemp("tiny_qwen2"),
                       default_tokenizer)


@pytest.fixture(scope="session")
def hf_reference_smollm2(default_model_path: str) -> Any:
    """Dense fp32 HF `LlamaForCausalLM` with exactly the GGUF's dequantized weights, eval mode.

    Built as FACTS.md says: transformers' own GGUF path keeps weights packed, so the config
    comes from the GGUF and the tensors from `load_gguf_checkpoint` (which undoes llama.cpp's
    Q/K permutation); lm_head is tied to the embedding. Used by the model-math tests.
    """
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = os.path.split(default_model_path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    # every parameter is overwritten below; skipping random init saves seconds
    with no_init_weights():
        model = LlamaForCausalLM(config)
    with pytest.MonkeyPatch.context() as patch:
        # NOTE: transformers rebuilds gguf's (pure, read-only) tensor name map once per submodule,
        # ~400 times (~8 s); memoizing it changes nothing but the time.
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        tensors = load_gguf_checkpoint(default_model_path, return_tensors=True,
                                       model_to_load=model)["tensors"]
    result = model.load_state_dict(tensors, strict=False, assign=True)
    assert not result.unexpected_keys, result.unexpected_keys
    assert result.missing_keys == ["lm_head.weight"], result.missing_keys
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.float().eval()


@pytest.fixture
def engine_defaults() -> dict[str, Any]:
    """Engine arguments `make_llm` starts from; a test package may override this fixture."""
    return {"dtype": "float32", "debug_invariants": True, "num_blocks": 256}


@pytest.fixture
def make_llm(tiny_llama_dir: str, engine_defaults: dict[str, Any]) -> Iterator[Any]:
    """Builds engines over the tiny random Llama (fp32 by default); after the test, checks
    every engine's block pool invariants and that no request was left unfinished."""
    from splitserve import LLM
    made: list[LLM] = []

    def make(**kwargs: Any) -> LLM:
        kwargs = {**engine_defaults, **kwargs}
        llm = LLM(str(kwargs.pop("model", tiny_llama_dir)), **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.engine.check_invariants()
        assert not llm.engine.has_unfinished


class ServerProcess:
    """`splitserve serve` as a real process on a free port; stopped with SIGTERM. It gets
    an admin key (SPLITSERVE_ADMIN_KEY, unless `env` names one), which `get_json`,
    `get_text` and `post_json` send to /admin/* routes."""

    def __init__(self, *flags: str, ready_timeout_s: float = 300.0, cwd: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        """`cwd` and `env` (default: this process's) let a benchmark run another checkout."""
        self.flags = flags
        import secrets
        import socket
        import subprocess
        import sys

        env = dict(os.environ if env is None else env)
        self.admin_key = env.setdefault("SPLITSERVE_ADMIN_KEY", secrets.token_urlsafe(16))
        # The free port is released before the server binds it, seconds later; meanwhile
        # a socket the server itself opens on an ephemeral port (a worker's, a
        # connection's) may take it: then it exits on "address already in use", and
        # another port is tried.
        for attempt in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            self.log_path = (Path(os.environ.get("TMPDIR", "/tmp"))
                             / f"splitserve-{self.port}.log")
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.cli", "serve", "--port", str(self.port),
                 *flags], stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=env)
            try:
                self._wait_ready(ready_timeout_s)
                return
            except RuntimeError:
                if attempt == 2 or "address already in use" not in self.log():
                    raise
                self._log.close()

    def _wait_ready(self, timeout_s: float) -> None:
        import time
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready in {timeout_s} s: {self.log()}")

    def _request(self, path: str, body: Any = None) -> Any:
        import json
        import urllib.request

        headers = {"Content-Type": "application/json"}
        if path.startswith("/admin/"):
            headers["Authorization"] = f"Bearer {self.admin_key}"
        data = json.dumps(body).encode() if body is not None else None
        return urllib.request.Request(self.url + path, data=data, headers=headers,
                                      method="POST" if body is not None else "GET")

    def get_json(self, path: str) -> Any:
        import json
        import urllib.request

        with urllib.request.urlopen(self._request(path), timeout=10) as r:
            return json.loads(r.read())

    def get_text(self, path: str) -> str:
        import urllib.request

        with urllib.request.urlopen(self._request(path), timeout=10) as r:
            return str(r.read().decode())

    def post_json(self, path: str, body: Any, timeout_s: float = 10.0) -> Any:
        import json
        import urllib.request

        with urllib.request.urlopen(self._request(path, body), timeout=timeout_s) as r:
            return json.loads(r.read())

    def delete_json(self, path: str, timeout_s: float = 30.0) -> Any:
        import json
        import urllib.request

        request = self._request(path)
        request.method = "DELETE"
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return json.loads(r.read())

    def workers(self) -> list[dict[str, Any]]:
        """Every worker's id, role, health, incarnation, pid and requests (/admin/health;
        a checkout from before it listed them in /health)."""
        import urllib.error

        try:
            return list(self.get_json("/admin/health")["workers"])
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            return list(self.get_json("/health")["workers"])

    def restarts(self) -> float:
        """splitserve_worker_restarts_total over every worker."""
        return sum(float(line.rsplit(" ", 1)[1]) for line in self.get_text("/metrics").splitlines()
                   if line.startswith("splitserve_worker_restarts_total"))

    def worker_pids(self) -> list[int]:
        return [int(w["pid"]) for w in self.workers()]

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout_s: float = 60.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def start_server() -> Iterator[Any]:
    """Factory: start_server(*flags) -> ServerProcess; a module's servers are stopped when
    it ends (each is ~1 GB per worker: a session's worth of them would not fit in memory)."""
    servers: list[ServerProcess] = []

    def start(*flags: str) -> ServerProcess:
        server = ServerProcess(*flags)
        servers.append(server)
        return server
    yield start
    for server in servers:
        # A restart must never hide a failure: a server that no test broke on purpose
        # (fault injection) ends with every worker in its first incarnation.
        if "--enable-fault-injection" not in server.flags and server.proc.poll() is None:
            assert server.restarts() == 0, f"a worker was restarted: {server.log()}"
        server.stop()
