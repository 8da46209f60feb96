"""`splitserve chat` as a real process."""
from __future__ import annotations

import os
import subprocess
import sys

from splitserve import LLM, SamplingParams


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "splitserve.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_one_shot_chat_prints_the_greedy_answer(tiny_llama_dir: str) -> None:
    res = run_cli("chat", "--model", tiny_llama_dir, "--dtype", "float32", "--prompt", "Hello",
                  "--max-tokens", "8")
    assert res.returncode == 0, res.stderr
    llm = LLM(tiny_llama_dir, dtype="float32")
    expected = llm.chat([{"role": "user", "content": "Hello"}],
                        SamplingParams(temperature=0, max_tokens=8))[0].text
    assert res.stdout.strip() == expected.strip()


def test_interactive_chat_reads_turns_until_eof(tiny_llama_dir: str) -> None:
    res = run_cli("chat", "--model", tiny_llama_dir, "--max-tokens", "4", stdin="hi\nmore\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("assistant> ") == 2


def test_bad_model_path_exits_with_a_clear_error(tmp_path) -> None:
    res = run_cli("chat", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert res.returncode == 2
    assert "error:" in res.stderr and "missing" in res.stderr


def test_serve_config_reads_yaml_and_flags_override(tmp_path: object) -> None:
    import argparse
    from pathlib import Path

    import pytest

    from splitserve.cli import add_serve_args, serve_config

    path = Path(str(tmp_path)) / "serve.yaml"
    path.write_text("mode: agg\ndecode: 2\nmax-model-len: 1024\nworker_cores: [[0], [1]]\n"
                    "deadlines:\n  kv_timeout_s: 5\n")
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    cfg = serve_config(parser.parse_args(["--config", str(path), "--decode", "3",
                                          "--request-timeout-s", "9",
                                          "--worker-cores", "0;1;1"]))
    assert (cfg.mode, cfg.decode, cfg.max_model_len) == ("agg", 3, 1024)
    assert cfg.worker_cores == [[0], [1], [1]]
    assert (cfg.deadlines.kv_timeout_s, cfg.deadlines.request_timeout_s) == (5, 9)
    path.write_text("nonsense_key: 1\n")
    with pytest.raises(ValueError, match="nonsense_key"):
        serve_config(parser.parse_args(["--config", str(path)]))
    with pytest.raises(ValueError, match="mode"):
        serve_config(argparse.Namespace(config=None, mode="weird"))


def test_every_worker_gets_the_step_time_budget_unless_it_is_off() -> None:
    import argparse

    import pytest

    from splitserve.cli import add_serve_args, serve_config

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve_config(parser.parse_args([])).engine_args()["max_step_ms"] == 1000.0
    cfg = serve_config(parser.parse_args(["--max-step-ms", "250"]))
    assert cfg.engine_args()["max_step_ms"] == 250.0
    assert serve_config(parser.parse_args(["--max-step-ms", "0"])).engine_args()[
        "max_step_ms"] is None
    with pytest.raises(ValueError, match="max_step_ms"):
        serve_config(parser.parse_args(["--max-step-ms", "-5"]))


def test_kv_stream_layers_flag_reaches_every_worker_spec() -> None:
    import argparse

    import pytest

    from splitserve.cli import add_serve_args, serve_config
    from splitserve.cluster.specs import worker_specs
    from splitserve.config import ServeConfig
    from splitserve.transfer.sender import LayerStreaming

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve_config(parser.parse_args([])).kv_stream_layers == "auto"
    cfg = serve_config(parser.parse_args(["--mode", "disagg", "--kv-stream-layers", "off"]))
    specs = worker_specs(cfg, "tcp://127.0.0.1:1")
    assert specs and {s.kv_stream_layers for s in specs} == {"off"}
    assert LayerStreaming(specs[0].kv_stream_layers) is LayerStreaming.OFF
    with pytest.raises(ValueError, match="kv_stream_layers"):
        ServeConfig(kv_stream_layers="sometimes")


def test_kv_transport_flag_reaches_every_worker_spec() -> None:
    import argparse

    import pytest

    from splitserve.cli import add_serve_args, serve_config
    from splitserve.cluster.specs import worker_specs
    from splitserve.config import ServeConfig

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    cfg = serve_config(parser.parse_args(["--mode", "disagg"]))
    assert {s.kv_transport for s in worker_specs(cfg, "tcp://127.0.0.1:1")} == {"tcp"}
    cfg = serve_config(parser.parse_args(["--mode", "disagg", "--kv-transport", "shm"]))
    assert {s.kv_transport for s in worker_specs(cfg, "tcp://127.0.0.1:1")} == {"shm"}
    assert ServeConfig(runtime="ray").kv_transport == "tcp"
    with pytest.raises(ValueError, match="kv_transport"):
        ServeConfig(kv_transport="rdma")


def test_serve_config_http_edge_flags_env_and_yaml(tmp_path: object, monkeypatch) -> None:
    import argparse
    from pathlib import Path

    import pytest

    from splitserve.cli import ADMIN_KEY_ENV, API_KEY_ENV, add_serve_args, serve_config

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    path = Path(str(tmp_path)) / "serve.yaml"
    path.write_text("http:\n  body-timeout-s: 5\n  limit_concurrency: 8\nheader_timeout_s: 3\n")
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    monkeypatch.setenv(ADMIN_KEY_ENV, "admin-from-env")
    cfg = serve_config(parser.parse_args(["--config", str(path), "--api-key-file", "k.json",
                                          "--enable-prompt-tokens-details",
                                          "--timeout-keep-alive", "7", "--admin-key", "flag"]))
    http = cfg.http
    assert (http.body_timeout_s, http.limit_concurrency, http.header_timeout_s) == (5, 8, 3)
    assert (http.api_key, http.api_key_file, http.admin_key) == ("from-env", "k.json", "flag")
    assert http.enable_prompt_tokens_details and http.timeout_keep_alive == 7
    assert "from-env" not in repr(cfg) and "flag" not in repr(cfg), "keys stay out of logs"
    assert serve_config(parser.parse_args(["--limit-concurrency", "0"])).http.limit_concurrency \
        is None
    path.write_text("http:\n  api_keys: [x]\n")
    with pytest.raises(ValueError, match="unknown http options"):
        serve_config(parser.parse_args(["--config", str(path)]))
    with pytest.raises(ValueError, match="header_timeout_s"):
        serve_config(parser.parse_args(["--header-timeout-s", "0"]))


def test_serve_with_a_bad_key_file_exits_before_starting_workers(tmp_path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text('["not", "a", "mapping"]')
    res = run_cli("serve", "--api-key-file", str(keys), "--port", "1")
    assert res.returncode == 2, res.stderr
    assert "error:" in res.stderr and "JSON object" in res.stderr
    assert "worker" not in res.stderr.lower(), res.stderr


def test_serve_config_ray_runtime_flags_and_yaml(tmp_path: object) -> None:
    import argparse
    from pathlib import Path

    import pytest

    from splitserve.cli import add_serve_args, serve_config

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert serve_config(parser.parse_args([])).runtime == "local"
    path = Path(str(tmp_path)) / "serve.yaml"
    path.write_text("runtime: ray\nray:\n  ray-address: auto\n  ray_placement: spread\n"
                    "cluster_name: prod-a\n")
    cfg = serve_config(parser.parse_args(["--config", str(path), "--ray-role-resources",
                                          "--ray-cpus-per-worker", "2"]))
    ray = cfg.ray
    assert cfg.runtime == "ray" and (ray.ray_address, ray.cluster_name) == ("auto", "prod-a")
    assert (ray.ray_placement, ray.ray_role_resources, ray.ray_cpus_per_worker) == (
        "spread", True, 2.0)
    with pytest.raises(ValueError, match="kv-transport tcp"):
        serve_config(parser.parse_args(["--runtime", "ray", "--kv-transport", "shm"]))
    with pytest.raises(ValueError, match="cluster_name"):
        serve_config(parser.parse_args(["--cluster-name", "a b"]))
    path.write_text("ray:\n  placement: pack\n")
    with pytest.raises(ValueError, match="unknown ray options"):
        serve_config(parser.parse_args(["--config", str(path)]))
    with pytest.raises(ValueError, match="slo-ttft-ms"):
        serve_config(parser.parse_args(["--admission", "reject"]))
    assert serve_config(parser.parse_args(["--admission", "reject", "--slo-ttft-ms", "900"])
                        ).admission == "reject"
