"""`splitserve serve --runtime ray` on a real Ray cluster: a head and three nodes on this
machine (ray.cluster_utils.Cluster, one CPU each, custom resources per pool), driven
through the official `openai` client and compared with the local runtime.

The tests share one Ray cluster and run in order: outputs against the local runtime,
frontend replacement (the replacement adopts the same workers), eight workers on one
node, then node loss (which takes a node away for good).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlparse

import pytest
import ray  # the `ray` extra; `make test` installs it
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from ray.cluster_utils import Cluster

from tests.conftest import ServerProcess
from tests.faults.harness import assert_pools_clean

# Long enough for full KV blocks (16 tokens) on every worker that holds it.
SYSTEM = ("You are a careful assistant. Answer in plain English, in full sentences, and "
          "explain each step of your reasoning before you give the final answer.")
PROMPTS = ["What is the capital of France?", "Name three prime numbers.",
           "Why is the sky blue?", "Describe a cat in one line.", "What does a compiler do?",
           "Count from one to five."]
LONG = "Write a short story about a lighthouse keeper and a storm."
MAX_TOKENS, LONG_TOKENS = 24, 160
NAME = "t-main"
FLAGS = ["--runtime", "ray", "--ray-role-resources", "--prefill", "1", "--decode", "2",
         "--disagg-policy", "always"]


def _messages(question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _requests() -> list[dict[str, Any]]:
    """Greedy and seeded sampling, each prompt once."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i}
        out.append({"messages": _messages(prompt), "max_tokens": MAX_TOKENS, **sampling})
    return out


def _complete_all(server: ServerProcess) -> list[str]:
    """Every request of `_requests()` at once (concurrent load), texts in order."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    texts: list[str | None] = [None] * len(PROMPTS)

    def one(i: int, body: dict[str, Any]) -> None:
        texts[i] = client.chat.completions.create(model=model, **body).choices[0].message.content

    threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(_requests())]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(texts), texts
    return [str(t) for t in texts]


def _long(server: ServerProcess) -> str:
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return str(client.chat.completions.create(
        model=client.models.list().data[0].id, messages=_messages(LONG), max_tokens=LONG_TOKENS,
        temperature=0.0).choices[0].message.content)


def _metric(server: ServerProcess, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.get_text("/metrics").splitlines()
               if line.startswith(name) and not line.startswith("#"))


class _Stream:
    """A streaming completion read on a thread: its text, chunk count and error."""

    def __init__(self, server: ServerProcess, prompt: str, max_tokens: int) -> None:
        self.text, self.chunks, self.error = "", 0, None
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                        timeout=300)
        model = client.models.list().data[0].id

        def read() -> None:
            try:
                for chunk in client.chat.completions.create(
                        model=model, messages=_messages(prompt), stream=True,
                        max_tokens=max_tokens, temperature=0.0):
                    self.text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                    self.chunks += 1
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                self.error = exc

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def wait_chunks(self, n: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.chunks < n and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.chunks >= n, (self.chunks, self.error)


def _actor_info(incarnation: str, cluster_name: str) -> dict[str, Any]:
    actor = ray.get_actor(incarnation, namespace=f"splitserve-{cluster_name}")
    return dict(ray.get(actor.info.remote(), timeout=30))


def _node_ip(node_id: str) -> str:
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    for role in ("prefill", "decode", "decode"):
        cluster.add_node(num_cpus=1, resources={role: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The local runtime's outputs, same pools, same requests (bf16, concurrent)."""
    server = ServerProcess("--prefill", "1", "--decode", "2", "--disagg-policy", "always")
    try:
        return {"texts": _complete_all(server), "long": _long(server)}
    finally:
        server.stop()


class _Servers:
    """The module's current Ray frontend (the replacement test swaps it)."""
    current: ServerProcess | None = None


@pytest.fixture(scope="module")
def ray_server(ray_cluster: Cluster, reference: dict[str, Any]) -> Iterator[type[_Servers]]:
    _Servers.current = ServerProcess(*FLAGS, "--ray-address", ray_cluster.address,
                                     "--cluster-name", NAME)
    yield _Servers
    _Servers.current.stop()


def test_same_outputs_as_local_runtime(ray_server: type[_Servers],
                                       reference: dict[str, Any]) -> None:
    server = ray_server.current
    assert server is not None
    workers = server.workers()
    assert sorted(w["id"] for w in workers) == ["decode-0", "decode-1", "prefill-0"]
    # Each worker on its own node, its KV listener on that node's address, as bound.
    nodes = {}
    for w in workers:
        info = _actor_info(w["incarnation"], NAME)
        assert info["pid"] == w["pid"]
        nodes[w["id"]] = info["node_id"]
        if w["role"] == "decode":
            address = urlparse(w["kv_address"])
            assert address.hostname == _node_ip(info["node_id"]) and address.port
            assert w["kv_address"] == info["kv_address"]
    assert len(set(nodes.values())) == 3, nodes
    assert _complete_all(server) == reference["texts"]
    assert _long(server) == reference["long"]
    # Real KV bytes crossed between the prefill node and the decode nodes, over TCP.
    assert _metric(server, "splitserve_kv_transfer_bytes_total") > 0
    assert server.restarts() == 0


def test_replaced_frontend_adopts_the_workers(ray_cluster: Cluster, ray_server: type[_Servers],
                                              reference: dict[str, Any]) -> None:
    old = ray_server.current
    assert old is not None
    before = {w["id"]: (w["pid"], w["incarnation"]) for w in old.workers()}
    stream = _Stream(old, LONG, LONG_TOKENS)  # in flight when the frontend dies
    stream.wait_chunks(3)
    warm = [w for w, n in old.get_json("/admin/health")["index"]["by_worker"].items() if n]
    assert warm  # the stream's prompt at least (run alone, this test has no other)
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait(10)
    stream.thread.join(30)
    assert stream.error is not None  # its client lost the connection: a clean failure

    started = time.monotonic()
    new = ray_server.current = ServerProcess(*FLAGS, "--ray-address", ray_cluster.address,
                                             "--cluster-name", NAME)
    assert "adopted" in new.log()
    after = {w["id"]: (w["pid"], w["incarnation"]) for w in new.workers()}
    assert after == before  # same processes, same incarnations: nothing was reloaded
    # The dead frontend's request ended on its workers: nothing held, nothing leaked.
    assert_pools_clean(new, 3)
    # Their cached prefixes came with them (KVSnapshot after WorkerReady): the new
    # router's index starts warm.
    deadline = time.monotonic() + 10
    while not all(new.get_json("/admin/health")["index"]["by_worker"].get(w, 0) > 0
                  for w in warm):
        assert time.monotonic() < deadline, new.get_json("/admin/health")["index"]
        time.sleep(0.2)
    assert _complete_all(new) == reference["texts"]
    assert new.restarts() == 0
    print(f"replacement frontend ready in {time.monotonic() - started:.1f} s")


def test_eight_workers_on_one_node(ray_cluster: Cluster) -> None:
    node = ray_cluster.add_node(num_cpus=8, resources={"both": 8})
    server = None
    try:
        server = ServerProcess("--runtime", "ray", "--ray-address", ray_cluster.address,
                               "--cluster-name", "t-eight", "--ray-role-resources",
                               "--mode", "agg", "--decode", "8",
                               "--kv-cache-memory-bytes", str(32 << 20))
        workers = server.workers()
        assert len(workers) == 8 and all(w["healthy"] for w in workers)
        addresses = [urlparse(w["kv_address"]) for w in workers]
        assert len({(a.hostname, a.port) for a in addresses}) == 8  # no two on one port
        assert {a.hostname for a in addresses} == {_node_ip(node.node_id)}
        assert {_actor_info(w["incarnation"], "t-eight")["node_id"] for w in workers} == {
            node.node_id}
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for prompt in PROMPTS:
            assert client.chat.completions.create(model=model, messages=_messages(prompt),
                                                  max_tokens=4).choices[0].message.content
        assert server.restarts() == 0
        assert "restarting" not in server.log()
    finally:
        if server is not None:
            assert server.stop() == 0
        ray_cluster.remove_node(node)


def test_placement_groups_pack_and_spread(ray_cluster: Cluster) -> None:
    """pack: one PACK group (a prefill and a decode worker share a node where one fits
    both); spread: one SPREAD group per pool (a pool's workers on different nodes). The
    groups go with the server."""
    nodes = [ray_cluster.add_node(num_cpus=2) for _ in range(2)]
    try:
        for placement, decode in (("pack", 1), ("spread", 2)):
            name = f"t-{placement}"
            server = ServerProcess("--runtime", "ray", "--ray-address", ray_cluster.address,
                                   "--cluster-name", name, "--ray-placement", placement,
                                   "--prefill", "1", "--decode", str(decode),
                                   "--kv-cache-memory-bytes", str(32 << 20))
            try:
                where = {w["id"]: _actor_info(w["incarnation"], name)["node_id"]
                         for w in server.workers()}
                if placement == "pack":
                    assert where["prefill-0"] == where["decode-0"], where
                else:
                    assert where["decode-0"] != where["decode-1"], where
                groups = {g["name"]: g["strategy"] for g in
                          ray.util.placement_group_table().values() if g["state"] == "CREATED"}
                expected = ({f"splitserve-{name}-all": "PACK"} if placement == "pack" else
                            {f"splitserve-{name}-prefill": "SPREAD",
                             f"splitserve-{name}-decode": "SPREAD"})
                assert {k: v for k, v in groups.items() if name in k} == expected
                assert _complete_all(server)
            finally:
                assert server.stop() == 0
            assert not [g for g in ray.util.placement_group_table().values()
                        if name in g["name"] and g["state"] == "CREATED"]
    finally:
        for node in nodes:
            ray_cluster.remove_node(node)


def test_node_loss_mid_stream(ray_cluster: Cluster, ray_server: type[_Servers],
                              reference: dict[str, Any]) -> None:
    server = ray_server.current
    assert server is not None
    stream = _Stream(server, LONG, LONG_TOKENS)
    stream.wait_chunks(8)
    busy = [w for w in server.workers() if w["role"] == "decode" and w["requests"]]
    assert len(busy) == 1, server.workers()
    victim = busy[0]
    index = server.get_json("/admin/health")["index"]["by_worker"]
    assert index.get(victim["id"], 0) > 0, index  # the router knows its cached blocks
    node_id = _actor_info(victim["incarnation"], NAME)["node_id"]
    node = next(n for n in ray_cluster.list_all_nodes() if n.node_id == node_id)
    ray_cluster.remove_node(node)

    stream.thread.join(300)
    assert stream.error is None, stream.error
    assert stream.text == reference["long"]  # resumed elsewhere, exactly
    health = server.get_json("/admin/health")
    live = {w["id"] for w in health["workers"]}
    assert victim["id"] not in live and victim["id"] not in health["index"]["by_worker"]
    assert _metric(server, "splitserve_migrations_total") >= 1
    # The restart is counted; Ray cannot place it (no node has a free `decode`).
    assert server.restarts() == 1
    survivor = next(w for w in health["workers"] if w["role"] == "decode")
    assert _complete_all(server) == reference["texts"]
    assert survivor["id"] in server.get_json("/admin/health")["index"]["by_worker"]
    print(json.dumps(health["workers"]))
