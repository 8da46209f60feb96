"""End to end: `splitserve serve` as real processes (frontend, prefill and decode workers),
the official `openai` client over real HTTP, outputs checked against the offline engine.

Every server here runs the default dtype (bfloat16) with the engine's default batch-invariant
("exact") CPU kernels and one torch thread per worker; the offline reference runs the same
dtype and kernels with two threads. A token's bits do not depend on what else is in the batch,
on the prefill chunk size, on prefill vs decode, on the worker or on the thread count, so
outputs must agree bit for bit, greedy and seeded alike, whatever the concurrency: the KV a
decode worker imports from a prefill worker is the KV it would have computed itself.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
import pytest

from splitserve import LLM, SamplingParams
from tests.faults.harness import metric

FLAGS = ("--threads-per-worker", "1", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(256 << 20))
MAX_TOKENS = 24
LONG = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(60))
SYSTEM = ("You are a meticulous assistant. Answer briefly and precisely. " * 12).strip()
CHATS: dict[str, list[dict[str, str]]] = {
    "short": [{"role": "user", "content": "What is the capital of France?"}],
    "long": [{"role": "user", "content": LONG + "\nWhat is 7 squared?"}],
    "shared_prefix_a": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Name a primary color."}],
    "shared_prefix_b": [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Name a prime number."}],
    "multi_turn": [{"role": "user", "content": "Hi! My name is Ada."},
                   {"role": "assistant", "content": "Hello Ada! How can I help you today?"},
                   {"role": "user", "content": "What is my name?"}],
}
COMPLETION = "The three primary colors are"


@pytest.fixture(scope="module")
def offline() -> LLM:
    """The offline engine: default dtype (bf16, exact kernels) like the workers, but two
    torch threads where agg's worker has one and disagg's prefill worker one and a helper
    on the decode worker's core (outputs must not depend on either)."""
    return LLM(num_threads=2, max_model_len=2048)


@pytest.fixture(scope="module")
def reference(offline: LLM) -> dict[str, str]:
    """The offline engine's greedy answers."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    names = list(CHATS)
    outs = [offline.chat(CHATS[n], greedy)[0].text for n in names]
    answers = dict(zip(names, outs))
    answers["completion"] = offline.generate([COMPLETION], greedy)[0].text
    return answers


@pytest.fixture(scope="module")
def disagg(start_server: Any) -> Any:
    # "always": every request goes prefill worker -> KV transfer -> decode worker. The
    # prefill worker borrows the decode worker's core (--prefill-borrows-cores, the
    # default: a helper there takes its tasks while the decode worker is idle and keeps
    # out while it steps, the lease raised and lowered many times a prefill under these
    # tests' concurrent streams), and with a TPOT target the decode worker paces its steps
    # while the prefill has prompts (--pace-decode, the default), lending the core between
    # them: outputs must not change.
    return start_server("--mode", "disagg", "--disagg-policy", "always",
                        "--slo-tpot-ms", "50", *FLAGS[2:])


@pytest.fixture(scope="module")
def agg(start_server: Any) -> Any:
    return start_server("--mode", "agg", *FLAGS)


@pytest.fixture(scope="module")
def mixed(start_server: Any) -> Any:
    """The layout `--mode auto` picks on a small machine for long prompts: the decode worker
    prefills what the router keeps local, the prefill worker (borrowing its core) the rest,
    so local chunked prefills share the decode worker's steps with sequences whose KV came
    over the wire."""
    return start_server("--mode", "disagg", "--disagg-policy", "auto",
                        "--slo-tpot-ms", "50", *FLAGS[2:])


def client(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def model_name(server: Any) -> str:
    return str(client(server).models.list().data[0].id)


def chat(server: Any, messages: list[dict[str, str]], stream: bool = False, **kw: Any) -> str:
    c = client(server)
    kw = {"temperature": 0, "max_tokens": MAX_TOKENS, **kw}
    typed = cast(list[ChatCompletionMessageParam], messages)
    if not stream:
        r = c.chat.completions.create(model=model_name(server), messages=typed, **kw)
        return r.choices[0].message.content or ""
    chunks = cast(openai.Stream[ChatCompletionChunk], c.chat.completions.create(
        model=model_name(server), messages=typed, stream=True, **kw))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


@pytest.mark.parametrize("mode", ["disagg", "agg"])
def test_greedy_chat_matches_the_offline_engine(mode: str, request: pytest.FixtureRequest,
                                                reference: dict[str, str]) -> None:
    server = request.getfixturevalue(mode)
    for name, messages in CHATS.items():
        assert chat(server, messages) == reference[name], f"{mode} {name}"
        assert chat(server, messages, stream=True) == reference[name], f"{mode} {name} stream"


@pytest.mark.parametrize("mode", ["disagg", "agg"])
def test_completions_stream_and_not(mode: str, request: pytest.FixtureRequest,
                                    reference: dict[str, str]) -> None:
    server = request.getfixturevalue(mode)
    c = client(server)
    r = c.completions.create(model=model_name(server), prompt=COMPLETION, temperature=0,
                             max_tokens=MAX_TOKENS)
    assert r.choices[0].text == reference["completion"]
    assert r.usage is not None and r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.prompt_tokens == len(LLM_TOKENS(COMPLETION))
    chunks = list(c.completions.create(model=model_name(server), prompt=COMPLETION,
                                       temperature=0, max_tokens=MAX_TOKENS, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == reference["completion"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    # Without --enable-prompt-tokens-details no response tells what was cached (the second
    # request repeats the first's prompt: a prefix hit it must not reveal).
    assert r.usage.prompt_tokens_details is None
    assert chunks[-1].usage.prompt_tokens_details is None


def LLM_TOKENS(text: str) -> list[int]:  # noqa: N802
    from splitserve.model.loader import open_checkpoint
    return open_checkpoint(None).tokenizer.encode(text)


def test_seeded_sampling_is_identical_across_modes(disagg: Any, agg: Any) -> None:
    kw: dict[str, Any] = dict(temperature=0.8, top_p=0.95, seed=1234)
    a = chat(disagg, CHATS["short"], **kw)
    b = chat(agg, CHATS["short"], **kw)
    assert a == b and a


def test_32_concurrent_streams_match_their_single_outputs(disagg: Any) -> None:
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    name = model_name(disagg)
    c = client(disagg)
    single = [c.completions.create(model=name, prompt=p, temperature=0,
                                   max_tokens=12).choices[0].text for p in prompts]

    async def run_all() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=disagg.url + "/v1", api_key="none", max_retries=0,
                                timeout=300)

        async def one(p: str) -> str:
            stream = await ac.completions.create(model=name, prompt=p, temperature=0,
                                                 max_tokens=12, stream=True)
            return "".join([ch.choices[0].text async for ch in stream if ch.choices])
        return await asyncio.gather(*(one(p) for p in prompts))
    outs = asyncio.run(run_all())
    assert all(outs), "every stream produced text"
    assert outs == single


# 16 distinct prompts, a few tokens to several prefill chunks (--max-num-batched-tokens 512)
# long; every fourth one is sampled (temperature > 0) with a fixed seed. ignore_eos: every
# stream runs its full length (some prompts end at once otherwise), so they overlap longer.
CONCURRENT = [
    "Hi",
    "Count from 1 to 10:",
    "The capital of Japan is",
    "Write a haiku about the sea.",
    " ".join(f"Item {i} costs {i * 3} dollars." for i in range(12)) + " What does item 5 cost?",
    "Explain in one sentence why the sky is blue.",
    LONG + "\nWhat is 12 squared?",
    "List three animals that live in the ocean:",
    SYSTEM + " Question: what is 2 + 2?",
    "def fibonacci(n):",
    " ".join(f"Step {i}: add {i} to the total." for i in range(40)) + " What is the total?",
    "Translate to French: good morning.",
    "Once upon a time, in a small village,",
    LONG[: len(LONG) // 3] + "\nWhat is 9 squared?",
    "The opposite of hot is",
    "Name the largest planet in the solar system.",
]
CONCURRENT_SAMPLING: list[dict[str, Any]] = [
    dict(temperature=0.8, top_p=0.95, seed=700 + i) if i % 4 == 3 else dict(temperature=0.0)
    for i in range(len(CONCURRENT))
]
CONCURRENT_MAX_TOKENS = [12 + (5 * i) % 17 for i in range(len(CONCURRENT))]


@pytest.fixture(scope="module")
def alone(offline: LLM) -> list[str]:
    """Each CONCURRENT prompt's offline output, generated by itself (a batch of one)."""
    assert len(set(CONCURRENT)) == len(CONCURRENT) == 16
    outs = [offline.generate([p], SamplingParams(max_tokens=n, ignore_eos=True, **s))[0].text
            for p, s, n in zip(CONCURRENT, CONCURRENT_SAMPLING, CONCURRENT_MAX_TOKENS)]
    assert all(outs), "every offline reference produced text"
    return outs


@pytest.mark.parametrize("mode", ["disagg", "agg", "mixed"])
def test_16_concurrent_streams_match_each_prompt_generated_alone_offline(
        mode: str, request: pytest.FixtureRequest, alone: list[str]) -> None:
    """16 streams at once (mixed lengths, so chunked prefills share steps with decodes and
    batches change every step) each give exactly the text the offline engine gives for
    that prompt run by itself, in a batch of one. In the mixed layout a third of them are
    forced local and a third remote (the per-request override; the rest the router's
    choice), so both kinds certainly meet on the decode worker."""
    server = request.getfixturevalue(mode)
    name = model_name(server)
    overrides = ([{"disagg": ("auto", "never", "always")[i % 3]} for i in range(16)]
                 if mode == "mixed" else [{}] * 16)
    counts = ("", "forced_local", "forced_remote")  # all decisions, then two of them
    before = [decided(server, kind) for kind in counts]

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                      max_retries=0, timeout=300) as ac:
            async def one(i: int) -> str:
                stream = await ac.completions.create(
                    model=name, prompt=CONCURRENT[i], max_tokens=CONCURRENT_MAX_TOKENS[i],
                    stream=True, extra_body={"ignore_eos": True, **overrides[i]},
                    **CONCURRENT_SAMPLING[i])
                return "".join([ch.choices[0].text async for ch in stream if ch.choices])
            return list(await asyncio.gather(*(one(i) for i in range(len(CONCURRENT)))))
    outs = asyncio.run(run_all())
    for i, (got, want) in enumerate(zip(outs, alone)):
        assert got == want, (f"{mode} prompt {i} {CONCURRENT[i][:40]!r} "
                             f"{CONCURRENT_SAMPLING[i]}: {got!r} != {want!r}")
    made = [decided(server, kind) - b for kind, b in zip(counts, before)]
    assert made[0] == len(CONCURRENT), made
    if mode == "mixed":
        assert made[1] == made[2] == 5, made


def decided(server: Any, kind: str) -> float:
    """Routing decisions so far, of one kind ("": all)."""
    labels = {"decision": kind} if kind else {}
    return metric(server, "splitserve_router_decisions_total", **labels)


def test_metrics_after_traffic(disagg: Any) -> None:
    chat(disagg, CHATS["shared_prefix_a"])
    chat(disagg, CHATS["shared_prefix_b"])
    text = disagg.get_text("/metrics")

    def value(pattern: str) -> float:
        found = re.findall(rf"^{pattern} ([0-9.e+-]+)$", text, flags=re.M)
        assert found, f"{pattern} not in /metrics"
        return sum(float(v) for v in found)
    assert value(r"splitserve_time_to_first_token_seconds_count") > 0
    assert value(r"splitserve_time_per_output_token_seconds_count") > 0
    assert value(r"splitserve_inter_token_latency_seconds_count") > 0
    assert value(r"splitserve_kv_transfer_bytes_total") > 0
    assert value(r'splitserve_router_decisions_total\{decision="[a-z_]+"\}') > 0
    assert value(r'splitserve_prefix_cache_hit_tokens_total\{[^}]*\}') > 0
    assert value(r'splitserve_kv_blocks_total\{worker="decode-0"\}') > 0


def post(server: Any, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(server.url + path, data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_input_gets_openai_errors_and_the_server_keeps_serving(
        disagg: Any, reference: dict[str, str]) -> None:
    name = model_name(disagg)
    good = {"model": name, "prompt": "hi", "max_tokens": 2}
    cases = [
        (b"{not json", 400, None),
        (json.dumps({**good, "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({**good, "max_tokens": -3}).encode(), 400, "max_tokens"),
        (json.dumps({**good, "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({**good, "prompt": "word " * 3000}).encode(), 400, "prompt"),
        (json.dumps({**good, "model": "no-such-model"}).encode(), 404, "model"),
        # Issue 16: these took workers down (500, then IndexError in the sampler).
        (json.dumps({**good, "prompt": [[-5, 1000000000]]}).encode(), 400, "prompt"),
        (json.dumps({**good, "stop_token_ids": [1000000000], "min_tokens": 1}).encode(), 400,
         "stop_token_ids"),
    ]
    pids = disagg.worker_pids()
    for body, status, param in cases:
        code, payload = post(disagg, "/v1/completions", body)
        assert code == status, (body[:60], payload)
        assert set(payload["error"]) >= {"message", "type", "code"}, payload
        if param is not None:
            assert payload["error"]["param"] == param, payload
    assert disagg.worker_pids() == pids
    assert chat(disagg, CHATS["short"]) == reference["short"]


def test_client_disconnect_aborts_and_frees_blocks(disagg: Any) -> None:
    c = client(disagg)
    stream = c.completions.create(model=model_name(disagg), prompt="Tell me a long story.",
                                  temperature=0, max_tokens=1500, stream=True,
                                  extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = disagg.get_json("/health")
        metrics = disagg.get_text("/metrics")
        used = [float(v) for v in re.findall(r'^splitserve_kv_blocks_used\{[^}]*\} ([0-9.e+-]+)$',
                                             metrics, flags=re.M)]
        if health["in_flight"] == 0 and used and not any(used):
            break
        time.sleep(0.2)
    assert health["in_flight"] == 0, health
    assert used and not any(used), used
    assert 'splitserve_requests_total{outcome="abort"}' in metrics
    pools = disagg.get_json("/admin/pools")["workers"]  # check_invariants() on every worker
    assert all(p["ok"] and p["used_blocks"] == 0 and p["requests"] == 0
               for p in pools.values()), pools


def test_logprobs_cover_every_token_in_both_modes(disagg: Any, agg: Any) -> None:
    """In disagg the first token's logprob comes from the prefill worker, the rest from
    the decode worker; the merged list must still have one entry per token, and with the
    exact kernels every logprob is the same number in both modes."""
    got = {}
    for mode, server in (("disagg", disagg), ("agg", agg)):
        r = client(server).chat.completions.create(
            model=model_name(server), messages=CHATS["short"],  # type: ignore[arg-type]
            temperature=0, max_tokens=8, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content if r.choices[0].logprobs else None
        assert content is not None and r.usage is not None
        assert len(content) == r.usage.completion_tokens, mode
        assert all(len(t.top_logprobs) == 2 for t in content)
        got[mode] = [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                     for t in content]
    assert got["disagg"] == got["agg"]


def test_fault_injection_is_refused_unless_enabled(disagg: Any) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:  # with the admin key
        disagg.post_json("/admin/faults", {"worker": "decode-0", "kind": "kill"})
    assert err.value.code == 403
    assert "--enable-fault-injection" in json.loads(err.value.read())["error"]["message"]
    assert len(disagg.workers()) == 2  # nothing was killed
    pools = disagg.get_json("/admin/pools")["workers"]
    assert sorted(pools) == ["decode-0", "prefill-0"] and all(p["ok"] for p in pools.values())


def test_idle_keep_alive_connection_outlasts_the_client_pool(disagg: Any) -> None:
    """httpx (the `openai` client) reuses idle connections for up to 5 s; a server that
    closes them at 5 s (uvicorn's default) races the client and fails requests at random.
    One connection, idle 6 s, must still serve the next request."""
    import http.client
    from splitserve.bench.client import CLIENT_KEEPALIVE_S

    conn = http.client.HTTPConnection("127.0.0.1", disagg.port, timeout=10)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().read() and conn.sock is not None
    sock = conn.sock
    time.sleep(6.0)
    conn.request("GET", "/v1/models")
    response = conn.getresponse()
    assert response.status == 200 and json.loads(response.read())["data"]
    assert conn.sock is sock, "the server closed the idle connection"
    assert CLIENT_KEEPALIVE_S < 5.0, "the bench client must drop idle connections first"
    conn.close()
