"""Placement as users see it (`splitserve serve --mode agg --decode 2`, the openai client):
a worker whose request just finished is idle for the router at once, not one load-report
interval later."""
from __future__ import annotations

import threading
from typing import Any

from openai import OpenAI


def _query_tokens(server: Any) -> dict[str, float]:
    """splitserve_prefix_cache_query_tokens_total per worker: the prompt tokens each took."""
    out = {}
    for line in server.get_text("/metrics").splitlines():
        if line.startswith("splitserve_prefix_cache_query_tokens_total{"):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            out[worker] = float(line.rsplit(" ", 1)[1])
    return out


def test_back_to_back_requests_go_to_the_idle_worker_not_the_decoding_one(
        start_server: Any) -> None:
    """One worker decodes a long stream; a closed-loop client sends short requests one
    after another. Each goes to the other worker: the one before it finished there
    milliseconds earlier, and that worker's report says so before the next is placed (it
    used to be counted running for up to a report interval, and every other request went
    to the decoding worker, stalling its stream)."""
    # The stream must outlast the 8 short requests on a slow CPU too (an AVX2-only one
    # prefills a 96-token prompt in ~0.6 s on one core): 1,000 tokens, ~10-15 s there.
    server = start_server("--mode", "agg", "--decode", "2", "--max-model-len", "1024")
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    decoding, done = threading.Event(), threading.Event()

    def stream() -> None:  # until the short requests are done (then the client leaves)
        with client.completions.create(model=model, prompt=list(range(100, 116)),
                                       max_tokens=1000, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}) as chunks:
            for _ in chunks:
                decoding.set()
                if done.is_set():
                    return
    busy = threading.Thread(target=stream)
    busy.start()
    assert decoding.wait(60), server.log()
    busy_on = [w["id"] for w in server.workers() if w["requests"]]
    other = next(w["id"] for w in server.workers() if w["id"] not in busy_on)
    for seed in range(8):
        prompt = [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(96)]
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert busy.is_alive(), "the stream outlasts the short requests"
    done.set()
    busy.join(300)
    taken = _query_tokens(server)
    assert taken.get(other) == 8 * 96 and taken.get(busy_on[0]) == 16, (busy_on, taken)
