"""End to end, real processes: conditional disaggregation (and its per-request override),
tenant isolation, admission control (429 + Retry-After), deadlines (504) and clients that
leave mid-request, each through a real HTTP client."""
from __future__ import annotations

import asyncio
import random
import re
import time
from typing import Any

import httpx2 as httpx
import openai
import pytest

from splitserve import LLM, SamplingParams
from tests.faults.harness import assert_pools_clean

FLAGS = ("--threads-per-worker", "1", "--max-model-len", "2048",
         "--kv-cache-memory-bytes", str(256 << 20))
SHARED = " ".join(f"Rule {i}: always answer in at most {i + 3} words." for i in range(20))


@pytest.fixture(scope="module")
def auto(start_server: Any) -> Any:
    # usage.prompt_tokens_details.cached_tokens shows tenant isolation
    return start_server("--mode", "disagg", "--disagg-policy", "auto",
                        "--enable-prompt-tokens-details", *FLAGS)


@pytest.fixture(scope="module")
def tight(start_server: Any) -> Any:
    """One aggregated worker that runs one sequence at a time, a one-slot admission queue
    and a 4 s request deadline."""
    return start_server("--mode", "agg", "--max-num-seqs", "1", "--max-queue-len", "1",
                        "--request-timeout-s", "4", *FLAGS)


def client(server: Any, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120, default_headers=headers or None)


def name(server: Any) -> str:
    return str(client(server).models.list().data[0].id)


def decisions(server: Any) -> dict[str, float]:
    metrics = server.get_text("/metrics")
    return {reason: float(value) for reason, value in re.findall(
        r'^splitserve_router_decisions_total\{decision="(\w+)"\} (\S+)$', metrics, flags=re.M)}


def test_conditional_disagg_output_matches_offline(auto: Any) -> None:
    llm = LLM(num_threads=2, max_model_len=2048)  # bf16, exact kernels; other thread count
    prompts = ["Say hello.", SHARED + " Now: what is 2 + 2?"]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.text for o in llm.generate(prompts, greedy)]
    c = client(auto)
    got = [c.completions.create(model=name(auto), prompt=p, temperature=0,
                                max_tokens=16).choices[0].text for p in prompts]
    assert got == expected
    assert sum(decisions(auto).values()) >= 2, decisions(auto)


def test_per_request_disagg_override(auto: Any) -> None:
    c = client(auto)
    texts = {}
    for policy, reason in (("always", "forced_remote"), ("never", "forced_local")):
        before = decisions(auto).get(reason, 0.0)
        texts[policy] = c.completions.create(
            model=name(auto), prompt="Say hello.", temperature=0, max_tokens=8,
            extra_body={"disagg": policy}).choices[0].text
        assert decisions(auto)[reason] == before + 1
    assert texts["always"] == texts["never"]  # disaggregated output = aggregated output
    with pytest.raises(openai.BadRequestError) as info:
        c.completions.create(model=name(auto), prompt="Hi", extra_body={"disagg": "half"})
    assert info.value.param == "disagg"


def cached_tokens(server: Any, prompt: str, tenant: str) -> int:
    r = client(server, **{"X-Tenant": tenant}).completions.create(
        model=name(server), prompt=prompt, temperature=0, max_tokens=2)
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def test_tenants_never_share_cached_prefixes(auto: Any) -> None:
    prompt = SHARED + " Question: name a color."
    assert cached_tokens(auto, prompt, "tenant-a") == 0
    time.sleep(0.3)  # the worker's KV events reach the router
    assert cached_tokens(auto, prompt, "tenant-a") > 0  # A hits its own prefix
    assert cached_tokens(auto, prompt, "tenant-b") == 0  # B does not see A's
    assert cached_tokens(auto, prompt, "tenant-b") > 0


def test_overload_is_refused_with_429_and_retry_after(tight: Any) -> None:
    body = {"model": name(tight), "prompt": "Write a long story.", "max_tokens": 400,
            "ignore_eos": True, "temperature": 0}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=tight.url, timeout=60) as http:
            async def one(delay: float) -> httpx.Response:
                await asyncio.sleep(delay)
                return await http.post("/v1/completions", json=body)
            # one runs, one waits in the queue, the rest find the queue full
            return await asyncio.gather(*(one(0.3 * i) for i in range(4)))
    responses = asyncio.run(fire())
    codes = sorted(r.status_code for r in responses)
    rejected = [r for r in responses if r.status_code == 429]
    assert len(rejected) >= 1, codes
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == 429
    # the running one and the queued one end at the 4 s deadline (400 tokens take longer)
    timed_out = [r for r in responses if r.status_code == 504]
    assert timed_out, codes
    assert "deadline" in timed_out[0].json()["error"]["message"]
    # and the server still serves
    ok = client(tight).completions.create(model=name(tight), prompt="Hi", max_tokens=4)
    assert ok.choices[0].text
    metrics = tight.get_text("/metrics")
    assert re.search(r'^splitserve_admission_rejections_total\{status="429"\} [1-9]', metrics,
                     flags=re.M)
    assert re.search(r'^splitserve_requests_total\{outcome="timeout"\} [1-9]', metrics,
                     flags=re.M)


def test_clients_leaving_at_random_moments_leave_nothing_behind(auto: Any) -> None:
    """24 requests at once under conditional disaggregation (local and remote prefills,
    KV transfers, decodes, some queued), most abandoned by their client at a random moment:
    in the queue, during a prefill on either worker, mid-transfer or mid-decode. Afterwards
    nothing is in flight, every pool is consistent and empty, no worker restarted, and the
    server answers as before."""
    rng = random.Random(20261206)
    plans = [(SHARED * rng.choice([0, 1, 2]) + f" Question {i}: count to {rng.choice([5, 20])}.",
              rng.choice([4, 64, 300]), rng.choice([True, True, True, False]),
              rng.uniform(0.0, 3.0) if i % 4 else None) for i in range(24)]

    async def fire() -> list[str]:
        async with httpx.AsyncClient(base_url=auto.url, timeout=120) as http:
            async def one(prompt: str, max_tokens: int, stream: bool,
                          leave_after_s: float | None) -> str:
                body = {"model": name(auto), "prompt": prompt, "max_tokens": max_tokens,
                        "stream": stream, "ignore_eos": True, "temperature": 0}
                try:
                    async with asyncio.timeout(leave_after_s):
                        async with http.stream("POST", "/v1/completions", json=body) as r:
                            await r.aread()
                            return str(r.status_code)
                except TimeoutError:
                    return "left"
            return list(await asyncio.gather(*(one(*plan) for plan in plans)))
    outcomes = asyncio.run(fire())
    assert set(outcomes) <= {"200", "left"} and "left" in outcomes, outcomes
    assert outcomes.count("200") >= sum(plan[3] is None for plan in plans), outcomes
    assert_pools_clean(auto, num_workers=2)  # nothing in flight, every pool ok and empty
    assert auto.restarts() == 0
    assert client(auto).completions.create(model=name(auto), prompt="Hi", temperature=0,
                                           max_tokens=4).choices[0].text
