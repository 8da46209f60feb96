"""Live migration on the local runtime, as an operator runs it: grow the decode pool
(POST /admin/workers), then drain the busy decode worker (POST /admin/drain) while eight
sequences stream from it. Every sequence moves with its KV (nothing recomputed, no retry)
and its text is identical to an undisturbed run; the drained worker held nothing when it
stopped and is not restarted."""
from __future__ import annotations

import threading
import time
from typing import Any

from openai import OpenAI

from tests.faults.harness import metric

QUESTIONS = ["Tell me about the ocean.", "Describe a forest at dawn.", "Explain how bread rises.",
             "Write about a train journey.", "What is a galaxy?", "Describe a busy market.",
             "Explain why leaves change color.", "Tell a story about a clockmaker."]
MAX_TOKENS = 500  # long enough to still be decoding when the new worker is up


def _bodies() -> list[dict[str, Any]]:
    out = []
    for i, q in enumerate(QUESTIONS):
        sampling = {"temperature": 0.0} if i % 2 else {"temperature": 0.8, "seed": 40 + i}
        out.append({"messages": [{"role": "user", "content": q}], "max_tokens": MAX_TOKENS,
                    "extra_body": {"ignore_eos": True}, **sampling})
    return out


class _Streams:
    """All bodies streamed at once on threads; texts and chunk counts as they arrive."""

    def __init__(self, url: str) -> None:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        bodies = _bodies()
        self.texts = [""] * len(bodies)
        self.chunks = [0] * len(bodies)
        self.errors: list[BaseException] = []

        def read(i: int) -> None:
            try:
                for chunk in client.chat.completions.create(model=model, stream=True,
                                                            **bodies[i]):
                    if chunk.choices:
                        self.texts[i] += chunk.choices[0].delta.content or ""
                        self.chunks[i] += 1
            except Exception as exc:  # noqa: BLE001 - the test reports it
                self.errors.append(exc)

        self.threads = [threading.Thread(target=read, args=(i,), daemon=True)
                        for i in range(len(bodies))]
        for t in self.threads:
            t.start()

    def join(self) -> list[str]:
        for t in self.threads:
            t.join(600)
        assert not self.errors, self.errors
        return self.texts


def test_drain_moves_eight_decoding_sequences_exactly(start_server: Any) -> None:
    server = start_server("--prefill", "1", "--decode", "1", "--disagg-policy", "always")
    reference = _Streams(server.url).join()  # undisturbed: one decode worker throughout

    streams = _Streams(server.url)
    deadline = time.monotonic() + 120
    while min(streams.chunks) < 3:  # every sequence decodes on decode-0
        assert time.monotonic() < deadline and not streams.errors, streams.errors
        time.sleep(0.05)
    added = server.post_json("/admin/workers", {"role": "decode"})
    assert added == {"worker": "decode-1"}
    while not any(w["id"] == "decode-1" and w["healthy"] for w in server.workers()):
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    assert max(streams.chunks) < MAX_TOKENS, "finished before the drain: raise MAX_TOKENS"
    report = server.post_json("/admin/drain", {"worker": "decode-0", "timeout_s": 60},
                              timeout_s=120)
    assert report["moved"] == 8 and report["stayed"] == 0, report
    pool = report["pool"]
    assert pool["ok"] and pool["used_blocks"] == 0 and pool["requests"] == 0, report

    assert streams.join() == reference
    workers = {w["id"]: w for w in server.workers()}
    assert "decode-0" not in workers and workers["decode-1"]["healthy"]
    assert metric(server, "splitserve_live_migrations_total", outcome="moved") == 8
    assert metric(server, "splitserve_retries_total") == 0  # moved, never replayed
    assert metric(server, "splitserve_reprefills_total") == 0  # no import fell back
    assert server.restarts() == 0  # a drained worker is not restarted
    for _, pool in server.get_json("/admin/pools")["workers"].items():
        assert pool["ok"] and pool["used_blocks"] == 0, pool
