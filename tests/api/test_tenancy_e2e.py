"""End to end, real processes and the official openai client: API keys name the tenant
(whatever a client sends), /admin needs the admin key, /health names no worker, and
distinct salts leave nothing behind in the router's index."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import openai
import pytest

KEYS = {"key-of-a": "tenant-a", "key-of-b": "tenant-b"}
FLAGS = ("--mode", "agg", "--threads-per-worker", "1", "--max-model-len", "512",
         "--kv-cache-memory-bytes", str(64 << 20))
SHARED = " ".join(f"Rule {i}: always answer in at most {i + 3} words." for i in range(12))


@pytest.fixture(scope="module")
def keyed(start_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = Path(tmp_path_factory.mktemp("keys")) / "keys.json"
    path.write_text(json.dumps(KEYS))
    return start_server(*FLAGS, "--api-key-file", str(path), "--enable-prompt-tokens-details")


def client(server: Any, key: str, **headers: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120,
                         default_headers=headers or None)


def cached_tokens(c: openai.OpenAI, **extra: str) -> int:
    out = c.completions.create(model=c.models.list().data[0].id, prompt=SHARED, max_tokens=1,
                               temperature=0, extra_body=extra or None)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return int(out.usage.prompt_tokens_details.cached_tokens or 0)


def test_missing_or_wrong_key_is_401(keyed: Any) -> None:
    for key in ("key-of-c", "tenant-a", "key-of-a-"):
        with pytest.raises(openai.AuthenticationError) as info:
            client(keyed, key).completions.create(model="m", prompt="Hi", max_tokens=1)
        body = cast(dict[str, Any], info.value.body)
        assert info.value.status_code == 401 and body["code"] == 401
    request = urllib.request.Request(keyed.url + "/v1/models")  # no Authorization at all
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 401
    assert client(keyed, "key-of-a").models.list().data


def test_key_b_naming_tenant_a_never_hits_as_prompt(keyed: Any) -> None:
    a = client(keyed, "key-of-a")
    assert cached_tokens(a) == 0
    assert cached_tokens(a) > 0, "A hits its own prefix"
    assert cached_tokens(a, cache_salt="x") == 0, "a salt is a sub-namespace of A's"
    # B names A every way a client can: header, user, salts (A's name, A's namespace)
    b_spoofing = client(keyed, "key-of-b", **{"X-Tenant": "tenant-a"})
    assert cached_tokens(b_spoofing, user="tenant-a") == 0
    for salt in ("tenant-a", '["tenant-a", null]', ""):
        assert cached_tokens(b_spoofing, cache_salt=salt, user="tenant-a") == 0, salt
    assert cached_tokens(client(keyed, "key-of-b")) > 0, "B hits what B cached"


def test_admin_needs_the_admin_key_and_health_names_no_worker(keyed: Any) -> None:
    for headers in ({}, {"Authorization": "Bearer key-of-a"},
                    {"Authorization": "Bearer wrong"}):
        request = urllib.request.Request(keyed.url + "/admin/health", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 401, headers
    workers = keyed.workers()  # with the admin key
    assert [w["id"] for w in workers] == ["both-0"] and workers[0]["pid"] > 0
    health = keyed.get_text("/health")
    for w in workers:
        for key in ("id", "incarnation", "pid"):
            assert str(w[key]) not in health, (key, health)
    assert json.loads(health)["workers"]["healthy"] == 1


def test_distinct_salts_leave_nothing_behind(start_server: Any) -> None:
    """Without keys every salt is a tenant too. 240 salts through a pool of ~22 blocks:
    the router remembers only tenants that still own cached blocks."""
    server = start_server("--mode", "agg", "--threads-per-worker", "1", "--max-model-len",
                          "96", "--kv-cache-memory-bytes", str(8 << 20))
    c = client(server, "none")
    model = c.models.list().data[0].id
    prompt = "Count the rules: " + " ".join(f"rule {i}" for i in range(12))

    def one(i: int) -> None:
        c.completions.create(model=model, prompt=prompt, max_tokens=1,
                             extra_body={"cache_salt": f"salt-{i}"})
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(240)))
    index = server.get_json("/admin/health")["index"]
    assert index["tenants"] <= index["blocks"] < 60, index
    assert index["pending_claims"] < 60, index
