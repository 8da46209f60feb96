"""DESIGN 7, row by row, with real processes: a fault is armed through the admin endpoint
(cluster/faults.py), a request goes through the openai client, and the client sees either
the output an unbroken cluster gives (the offline engine's) or a clear error within the
deadline; afterwards every surviving pool passes check_invariants() and holds nothing.
Workers and the offline reference run the default dtype (bf16) with the exact kernels, so
"the same output" is bit for bit even after a replay on another worker.

Rows covered elsewhere: client disconnect (tests/api/test_serving_e2e.py, blocks freed),
SIGTERM drain (same file), admission limits (tests/api/test_serving_policies_e2e.py).
"""
from __future__ import annotations

import os
import urllib.error
from typing import Any

import pytest

from splitserve import LLM, SamplingParams
from tests.faults.harness import (FLAGS, arm, assert_pools_clean, client, metric, model,
                                  wait_healthy, worker_holding_a_request)

NUM_WORKERS = 3  # prefill-0, decode-0, decode-1
PROMPT = "List the planets of the solar system, one per line, with one fact each."
SHARED = " ".join(f"Rule {i}: answer in at most {i + 3} words." for i in range(24))
GREEDY = dict(temperature=0.0)
SEEDED = dict(temperature=0.8, top_p=0.95, seed=4321)


@pytest.fixture(scope="module")
def cluster(start_server: Any) -> Any:
    """1 prefill + 2 decode workers, every request disaggregated; short heartbeat and KV
    deadlines so faults are noticed quickly; workers restart when they exit."""
    return start_server("--mode", "disagg", "--prefill", "1", "--decode", "2",
                        "--disagg-policy", "always", "--heartbeat-timeout-s", "4",
                        "--kv-timeout-s", "5", *FLAGS)


@pytest.fixture(scope="module")
def retry_cluster(start_server: Any) -> Any:
    return start_server("--mode", "disagg", "--prefill", "1", "--decode", "1",
                        "--disagg-policy", "always", "--kv-failure-policy", "retry", *FLAGS)


@pytest.fixture(scope="module")
def offline() -> LLM:
    """Default dtype (bf16, exact kernels) like the workers, two threads to their one."""
    return LLM(num_threads=2, max_model_len=2048)


def expected(llm: LLM, prompt: str, max_tokens: int, sampling: dict[str, Any]) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                               **sampling))[0].text


def complete(server: Any, prompt: str, max_tokens: int, sampling: dict[str, Any]) -> str:
    r = client(server).completions.create(model=model(server), prompt=prompt,
                                          max_tokens=max_tokens, extra_body={"ignore_eos": True},
                                          **sampling)
    assert r.usage is not None and r.usage.completion_tokens == max_tokens
    return str(r.choices[0].text)


def test_prefill_worker_dies_before_publishing(cluster: Any, offline: LLM) -> None:
    """Retried within the deadline; with no prefill worker left, the decode worker
    prefills locally (temporary colocation) until the prefill worker is restarted."""
    arm(cluster, "prefill-0", kind="kill", point="prefill")
    assert complete(cluster, PROMPT, 16, GREEDY) == expected(offline, PROMPT, 16, GREEDY)
    assert metric(cluster, "splitserve_retries_total", reason="worker_dead") >= 1
    assert_pools_clean(cluster, NUM_WORKERS)  # waits for the restart (after its backoff)
    assert metric(cluster, "splitserve_worker_restarts_total", worker="prefill-0") == 1
    prefill = [w for w in cluster.workers() if w["id"] == "prefill-0"]
    assert prefill[0]["incarnation"] == "prefill-0:2"


def test_prefill_worker_error_is_retried(cluster: Any, offline: LLM) -> None:
    arm(cluster, "prefill-0", kind="error", point="prefill")
    assert complete(cluster, PROMPT, 8, GREEDY) == expected(offline, PROMPT, 8, GREEDY)
    assert metric(cluster, "splitserve_retries_total", reason="worker_error") >= 1
    assert_pools_clean(cluster, NUM_WORKERS)


@pytest.mark.parametrize("point", ["prefill", "first_token"])
def test_a_request_that_raises_in_a_worker_fails_alone(cluster: Any, offline: LLM,
                                                       point: str) -> None:
    """An unexpected exception in a worker's code for one request (issue 16) fails that
    attempt with a typed error and leaves the process up; the retry gives the exact output."""
    restarts = metric(cluster, "splitserve_worker_restarts_total", worker="prefill-0")
    retries = metric(cluster, "splitserve_retries_total", reason="worker_error")
    arm(cluster, "prefill-0", kind="raise", point=point)
    assert complete(cluster, PROMPT, 8, SEEDED) == expected(offline, PROMPT, 8, SEEDED)
    assert metric(cluster, "splitserve_retries_total", reason="worker_error") == retries + 1
    assert metric(cluster, "splitserve_worker_restarts_total", worker="prefill-0") == restarts
    assert_pools_clean(cluster, NUM_WORKERS)


def test_corrupt_transfer_is_recomputed_never_used(cluster: Any, offline: LLM) -> None:
    before = metric(cluster, "splitserve_reprefills_total")
    arm(cluster, "prefill-0", kind="corrupt_kv")
    assert complete(cluster, PROMPT, 12, SEEDED) == expected(offline, PROMPT, 12, SEEDED)
    assert metric(cluster, "splitserve_reprefills_total") == before + 1
    assert metric(cluster, "splitserve_kv_transfers_total", side="receiver",
                  outcome="ChecksumMismatch") >= 1
    assert_pools_clean(cluster, NUM_WORKERS)


def test_a_recomputed_prompt_reports_one_logprob_per_token(cluster: Any, offline: LLM) -> None:
    """After a failed import the decode worker samples the first token itself: its logprobs
    start at that token (the prefill worker's was streamed already), so the client gets one
    logprob per token, each the offline engine's number."""
    arm(cluster, "prefill-0", kind="corrupt_kv")
    r = client(cluster).completions.create(model=model(cluster), prompt=PROMPT, max_tokens=8,
                                           temperature=0.0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    got = r.choices[0].logprobs
    assert got is not None and got.token_logprobs is not None and r.usage is not None
    [want] = offline.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True,
                                                     temperature=0.0, logprobs=2))
    assert want.logprobs is not None
    assert r.usage.completion_tokens == len(got.token_logprobs) == 8
    assert got.token_logprobs == [t.logprob for t in want.logprobs]
    assert_pools_clean(cluster, NUM_WORKERS)


def test_kv_that_never_arrives_hits_the_kv_deadline(cluster: Any, offline: LLM) -> None:
    """The decode worker's reservation expires (--kv-timeout-s 5), its blocks are released
    and, under the default policy, it prefills locally."""
    before = metric(cluster, "splitserve_reprefills_total")
    arm(cluster, "prefill-0", kind="drop_kv")
    assert complete(cluster, PROMPT, 8, GREEDY) == expected(offline, PROMPT, 8, GREEDY)
    assert metric(cluster, "splitserve_reprefills_total") == before + 1
    assert_pools_clean(cluster, NUM_WORKERS)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_decode_worker_dies_mid_sequence(cluster: Any, offline: LLM,
                                         sampling: dict[str, Any]) -> None:
    """The stream goes on from another decode worker (replay of prompt + generated
    tokens): the client's text is exactly the uninterrupted one, nothing lost or doubled."""
    migrations = metric(cluster, "splitserve_migrations_total")
    stream = client(cluster).completions.create(
        model=model(cluster), prompt=PROMPT, max_tokens=96, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True}, **sampling)
    text, usage = [], None
    for i, chunk in enumerate(stream):
        if chunk.choices:
            text.append(chunk.choices[0].text)
        usage = chunk.usage or usage
        if i == 3:
            arm(cluster, worker_holding_a_request(cluster, "decode"), kind="kill", point="now")
    assert "".join(text) == expected(offline, PROMPT, 96, sampling)
    assert usage is not None and usage.completion_tokens == 96
    assert metric(cluster, "splitserve_migrations_total") == migrations + 1
    assert_pools_clean(cluster, NUM_WORKERS)


def test_a_client_naming_a_retried_attempt_neither_gets_nor_disturbs_it(
        cluster: Any, offline: LLM) -> None:
    """Issue 16: clients that send the victim's id, or the ids its retries run under
    (`<id>#1`, `<id>#2`), as X-Request-Id while the victim is being migrated get their own
    outputs; the victim's stream goes on exactly."""
    other = "Name three rivers of Europe."
    stream = client(cluster).completions.create(
        model=model(cluster), prompt=PROMPT, max_tokens=48, stream=True, temperature=0,
        extra_body={"ignore_eos": True})
    text, imposters = [], []
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].text if chunk.choices else "")
        if i == 2:
            arm(cluster, worker_holding_a_request(cluster, "decode"), kind="kill", point="now")
            for label in (f"{chunk.id}#1", f"{chunk.id}#2", chunk.id):
                raw = client(cluster).completions.with_raw_response.create(
                    model=model(cluster), prompt=other, max_tokens=8, temperature=0,
                    extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": label})
                imposters.append((label, raw, chunk.id))
    assert "".join(text) == expected(offline, PROMPT, 48, GREEDY)
    for label, raw, victim_id in imposters:
        assert raw.headers["x-request-id"] == label
        assert raw.parse().id != victim_id
        assert raw.parse().choices[0].text == expected(offline, other, 8, GREEDY)
    assert_pools_clean(cluster, NUM_WORKERS)


def test_stale_directory_is_invalidated_and_recomputed(cluster: Any, offline: LLM) -> None:
    prompt = SHARED + " Question: name a planet."
    want = expected(offline, prompt, 4, GREEDY)
    assert complete(cluster, prompt, 4, GREEDY) == want  # the prefill worker caches it
    wait_healthy(cluster, NUM_WORKERS)
    stale = metric(cluster, "splitserve_stale_routes_total")
    arm(cluster, "prefill-0", kind="forget_cache", point="now")  # and tells nobody
    assert complete(cluster, prompt, 4, GREEDY) == want
    assert metric(cluster, "splitserve_stale_routes_total") == stale + 1
    assert_pools_clean(cluster, NUM_WORKERS)


def test_partitioned_decode_worker_is_fenced(cluster: Any, offline: LLM) -> None:
    """A decode worker stops answering (a stall longer than the heartbeat deadline): it is
    removed, its request resumes elsewhere; when it wakes up its late messages are refused
    and it is told to exit, and a new incarnation takes its place."""
    fenced = metric(cluster, "splitserve_fenced_messages_total")
    stream = client(cluster).completions.create(
        model=model(cluster), prompt=PROMPT, max_tokens=64, stream=True, temperature=0,
        extra_body={"ignore_eos": True})
    text, victim = [], ""
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].text if chunk.choices else "")
        if i == 3:
            victim = worker_holding_a_request(cluster, "decode")
            arm(cluster, victim, kind="stall", point="now", seconds=7)
    assert "".join(text) == expected(offline, PROMPT, 64, GREEDY)
    workers = wait_healthy(cluster, NUM_WORKERS)
    assert metric(cluster, "splitserve_fenced_messages_total") > fenced
    incarnation = [w["incarnation"] for w in workers if w["id"] == victim][0]
    assert not incarnation.endswith(":1"), workers
    assert_pools_clean(cluster, NUM_WORKERS)


def test_hung_decode_worker_is_killed_and_replaced(cluster: Any, offline: LLM) -> None:
    """A decode worker hangs for good (a 10-minute stall: it will never hear it was
    fenced): removed at its heartbeat deadline, its request resumes elsewhere; still alive
    a deadline later, it is killed and a new incarnation takes its place (the pool keeps
    its size, the cores come back)."""
    restarts = metric(cluster, "splitserve_worker_restarts_total")
    stream = client(cluster).completions.create(
        model=model(cluster), prompt=PROMPT, max_tokens=48, stream=True, temperature=0,
        extra_body={"ignore_eos": True})
    text, victim, pid = [], "", 0
    for i, chunk in enumerate(stream):
        text.append(chunk.choices[0].text if chunk.choices else "")
        if i == 3:
            victim = worker_holding_a_request(cluster, "decode")
            pid = [w["pid"] for w in cluster.workers() if w["id"] == victim][0]
            arm(cluster, victim, kind="stall", point="now", seconds=600)
    assert "".join(text) == expected(offline, PROMPT, 48, GREEDY)
    workers = wait_healthy(cluster, NUM_WORKERS)
    assert not os.path.exists(f"/proc/{pid}"), f"the hung worker (pid {pid}) lives on"
    assert [w["pid"] for w in workers if w["id"] == victim] != [pid], workers
    assert metric(cluster, "splitserve_worker_restarts_total") > restarts
    assert_pools_clean(cluster, NUM_WORKERS)


def test_corrupt_transfer_is_retried_under_the_retry_policy(retry_cluster: Any,
                                                             offline: LLM) -> None:
    arm(retry_cluster, "prefill-0", kind="corrupt_kv")
    assert complete(retry_cluster, PROMPT, 12, SEEDED) == expected(offline, PROMPT, 12, SEEDED)
    assert metric(retry_cluster, "splitserve_retries_total", reason="kv_transfer") == 1
    assert metric(retry_cluster, "splitserve_reprefills_total") == 0
    assert_pools_clean(retry_cluster, 2)


def test_bad_fault_specs_get_openai_errors(cluster: Any) -> None:
    for spec, status in [({"kind": "explode"}, 400), ({"kind": "kill", "point": "x"}, 400),
                         ({"kind": "kill", "worker": "nobody-9"}, 404)]:
        body = {"worker": "decode-0", **spec}
        with pytest.raises(urllib.error.HTTPError) as err:
            arm(cluster, body.pop("worker"), **body)
        assert err.value.code == status, err.value
