"""`splitserve serve` with no --mode (auto, the default) as a real process: it measures
this machine's cost curves (an empty cache), starts the layout it chose, says which and
why in its log, /metrics and /admin/health, and serves; the frontend itself never loads
torch; curves cached for an engine the workers do not run are dropped."""
from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

from openai import OpenAI

from splitserve.cluster.planner.layout import candidate_threads


def test_the_default_mode_measures_chooses_and_serves(start_server: Any,
                                                      tmp_path: Path) -> None:
    cache = tmp_path / "profiles.json"
    server = start_server("--profile-cache", str(cache), "--workload-hint", "256:64",
                          "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20))
    layout = server.get_json("/admin/health")["layout"]
    assert layout["layout"] in ("agg", "disagg", "mixed"), layout
    policy = {"agg": "never", "disagg": "always", "mixed": "auto"}[layout["layout"]]
    assert layout["disagg_policy"] == policy, layout
    # Measured and compared: every candidate on this machine's cores has a rate.
    cores = len(os.sched_getaffinity(0))
    assert len(layout["candidates"]) >= 2 if cores > 1 else len(layout["candidates"]) == 1
    assert "for 256+64-token requests" in layout["reason"] and layout["slo_derived"]
    entries = json.loads(cache.read_text())["entries"].values()
    assert sorted(e["key"]["threads"] for e in entries) == candidate_threads(cores)

    # The workers are the chosen ones.
    roles = Counter(w["role"] for w in server.workers())
    if layout["layout"] == "agg":
        assert roles == {"both": layout["decode"]}
    else:
        assert roles == {"prefill": layout["prefill"], "decode": layout["decode"]}

    [line] = [x for x in server.get_text("/metrics").splitlines()
              if x.startswith("splitserve_layout_info{")]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    assert labels["layout"] == layout["layout"] and labels["reason"] == layout["reason"]
    assert labels["decode"] == str(layout["decode"]) and line.endswith(" 1.0")
    assert "layout: " in server.log_path.read_text()  # the startup line, however long the log

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.choices[0].text

    # The frontend ran no model (the profile child and the workers did): no torch in it.
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps
    assert "measured on another engine" not in server.log_path.read_text()

    # Curves that name another engine than the one the workers register with (as if the
    # kernels had stopped building here): this start still serves the layout they chose,
    # says so, and drops them, so that the next start measures again.
    data = json.loads(cache.read_text())
    for entry in data["entries"].values():
        entry["fingerprint"] = "0" * 32
    cache.write_text(json.dumps(data))
    again = start_server("--profile-cache", str(cache), "--workload-hint", "256:64",
                         "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20))
    assert again.get_json("/admin/health")["layout"]["layout"] == layout["layout"]
    assert "measured on another engine (fingerprint 0000" in again.log_path.read_text()
    assert json.loads(cache.read_text())["entries"] == {}
