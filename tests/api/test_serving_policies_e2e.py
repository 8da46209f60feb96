"""End to end, real processes: conditional disaggregation (and its per-request override),
tenant isolation, admission control (429 + Retry-After) and deadlines (504), each through
the openai client."""
from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx2 as httpx
import openai
import pytest

from splitserve import LLM, SamplingParams

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
