"""Role switching on the local runtime (POST /admin/switch): the prefill worker becomes a
decode worker and back, in the same process, without loading its weights again, and in
each role it serves, with the same outputs as before."""
from __future__ import annotations

import re
import threading
from typing import Any

from openai import OpenAI

QUESTIONS = ["What is the tallest mountain?", "Name a primary color.", "Why do birds sing?",
             "What is two plus two?"]


def _complete_all(server: Any) -> list[str]:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    texts: list[str] = [""] * len(QUESTIONS)

    def one(i: int) -> None:
        sampling: dict[str, Any] = ({"temperature": 0.0} if i % 2 else
                                    {"temperature": 0.7, "seed": 5 + i})
        texts[i] = str(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=32,
            **sampling).choices[0].message.content)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(QUESTIONS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(texts), texts
    return texts


def _decode_steps(server: Any, worker: str) -> float:
    pattern = re.compile(r'splitserve_decode_batch_size_count\{worker="([^"]+)"\} (\S+)')
    return sum(float(m.group(2)) for m in pattern.finditer(server.get_text("/metrics"))
               if m.group(1) == worker)


def test_prefill_worker_becomes_decode_and_back(start_server: Any) -> None:
    server = start_server("--prefill", "1", "--decode", "1", "--disagg-policy", "always")
    pid = {w["id"]: w["pid"] for w in server.workers()}["prefill-0"]
    reference = _complete_all(server)

    report = server.post_json("/admin/switch", {"worker": "prefill-0", "role": "decode"},
                              timeout_s=120)
    assert report["worker"] == "decode-1" and report["was"] == "prefill-0", report
    workers = {w["id"]: w for w in server.workers()}
    assert set(workers) == {"decode-0", "decode-1"}
    assert workers["decode-1"]["pid"] == pid and workers["decode-1"]["incarnation"] == "decode-1:2"
    assert workers["decode-1"]["kv_address"]  # a decode worker receives KV
    for _ in range(3):  # enough requests that the least busy worker gets some
        assert _complete_all(server) == reference
    assert _decode_steps(server, "decode-1") > 0  # it decodes in its new role

    report = server.post_json("/admin/switch", {"worker": "decode-1", "role": "prefill"},
                              timeout_s=120)
    assert report["worker"] == "prefill-0", report
    workers = {w["id"]: w for w in server.workers()}
    assert workers["prefill-0"]["pid"] == pid and workers["prefill-0"]["incarnation"] == \
        "prefill-0:3"
    assert _complete_all(server) == reference  # disaggregated again, through it
    # Two engines loaded in this server's life, for three registrations of that process.
    server.log()  # flushes
    assert server.log_path.read_text(errors="replace").count("engine ready") == 2
    for _, pool in server.get_json("/admin/pools")["workers"].items():
        assert pool["ok"] and pool["used_blocks"] == 0 and pool["requests"] == 0, pool
    assert server.restarts() == 0
